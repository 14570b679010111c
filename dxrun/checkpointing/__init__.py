"""A run that survives: the Orbax store of its checkpoints (``store``), what counts as a damaged
one (``damage``), resuming from them (``resume``), saving during the run (``saving``), a
checkpoint restored where the vocabulary is padded differently (``vocab_padding``), and the
save between steps that a signal asks for (turned into flags by ``dxrun.run.signals``)."""
