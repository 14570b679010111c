"""The trainer's hooks (dxrun/train.py): their cadence, Levanter's ``every=N``. The hooks' work
is asserted through real runs (tests/test_train.py, test_resume.py, test_goodput.py, ...)."""

from __future__ import annotations

from dxrun.train import Hook, StepInfo


def test_a_hook_runs_every_n_steps_and_at_the_last():
    hook = Hook()
    hook.every = 3
    assert [done for done in range(1, 11) if hook.due(done, 10)] == [3, 6, 9, 10]
    hook.every = 1
    assert [done for done in range(5, 8) if hook.due(done, 7)] == [5, 6, 7]
    hook.every = 0  # never: train.eval_every=0, or no held-out data
    assert not any(hook.due(done, 10) for done in range(1, 11))


def test_each_step_gets_a_row_of_its_own():
    a, b = StepInfo(1, None, None), StepInfo(2, None, None)
    a.row["train/loss"] = 1.0
    assert b.row == {}
