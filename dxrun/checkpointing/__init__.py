"""A run that survives: its checkpoints (``store``: the Orbax store, what counts as damaged,
resuming and saving during the run), when it saves (``cadence``) and a checkpoint restored
where the vocabulary is padded differently (``vocab_padding``)."""
