"""A run that survives: Orbax saves of the train state and resuming from them (``checkpoint``),
a checkpoint restored where the vocabulary is padded differently (``vocab_padding``), and
SIGTERM/SIGINT/SIGUSR1 turned into a save and a clean stop (``preempt``)."""
