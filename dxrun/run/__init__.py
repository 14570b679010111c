"""The run and its directory: the process set up, joined and signalled, and the run dir claimed,
continued or refused (``runtime``), the files that record it (``bookkeeping``), the job's status
and how it ended (``job_dir``) and the test-only faults (``faults``).
"""
