"""The run and its directory: the process set up before JAX (``runtime``: devices, caches, the
run directory), the run dir claimed, continued or refused (``run_dir``) and the files that
record it (``bookkeeping``), the log file (``run_log``), where the run sits among others
(``job``), the job's status and how it ended (``job_dir``), SIGTERM/SIGINT/SIGUSR1 turned into
a save and a clean stop (``signals``) and the test-only faults (``faults``).
"""
