"""The config family: what a run is asked to do, and its refusal in one line. Every key of
the run config written once (``schema``, the parallelism and distributed sections in
``schema_parallel``; a key's facts in ``key``), registered with Hydra with its resolvers and
presets (``registry``), the command line checked before Hydra runs it (``composition``), the
values checked after (``validation``), your own factories behind ``_target_`` (``target``), and
how a run ends: its outcomes, status and exit codes (``errors``).

No JAX import: the device count is decided from the composed config before JAX starts.
"""
