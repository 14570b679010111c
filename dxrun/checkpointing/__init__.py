"""A run that survives, what the rest may use: its checkpoints, resuming from them and saving
during the run.

- ``store.py``: the Orbax store: where a run's checkpoints live, saving one, reading one.
- ``damage.py``: what counts as a damaged checkpoint; the failures of reads given up kept quiet.
- ``resume.py``: which checkpoint a run continues from, whether it may, and restoring it.
- ``run_checkpoints.py``: saving between two steps (the cadence, SIGUSR1's save, the committed
  save a stop waits for) and the run's failures told in one line.
- ``vocab_padding.py``: a checkpoint restored where the vocabulary (or ZeRO-1's optimizer state)
  is padded differently.
"""

from dxrun.checkpointing.damage import (
    IncompleteMeta,
    check_meta,
    is_a_given_up_read,
    is_damage,
    quiet_reads_that_finish_late,
)
from dxrun.checkpointing.resume import (
    DATA_SOURCE,
    MODEL_SHAPE,
    VOCABULARY,
    Resume,
    changed,
    check_compatible,
    data_position,
    find_resume,
    gone,
    locate,
    newest_meta,
    plan_resume,
    restore,
    tokens_seen,
)
from dxrun.checkpointing.run_checkpoints import RunCheckpoints, halted, refused, time_due
from dxrun.checkpointing.store import (
    POINTER,
    Checkpointer,
    checkpoint_dir,
    committed_steps,
    run_id,
)
from dxrun.checkpointing.vocab_padding import padding_differs

__all__ = ["DATA_SOURCE", "MODEL_SHAPE", "POINTER", "VOCABULARY", "Checkpointer",
           "IncompleteMeta", "Resume", "RunCheckpoints", "changed", "check_compatible",
           "check_meta", "checkpoint_dir", "committed_steps", "data_position", "find_resume",
           "gone", "halted", "is_a_given_up_read", "is_damage", "locate", "newest_meta",
           "padding_differs", "plan_resume", "quiet_reads_that_finish_late", "refused",
           "restore", "run_id", "time_due", "tokens_seen"]
