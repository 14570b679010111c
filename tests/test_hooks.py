"""The trainer's hooks (dxrun/train/hooks.py): their cadence, Levanter's ``every=N``, and a
user's hook added to a run (``Trainer.add_hook``) the way the built-ins are. The built-ins' work is
asserted through real runs (tests/test_train.py, test_resume.py, test_goodput.py, ...)."""

from __future__ import annotations

import json

from conftest import make_cfg

from dxrun.train import Hook, StepInfo, open_run
from dxrun.train.hooks import CheckpointHook, EvalHook, GoodputHook, LogHook, TraceHook


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


def test_a_users_hook_is_called_at_its_steps_beside_the_built_ins(tmp_path):
    """A function added with ``every=3`` to a 10-step run is called after steps 3, 6, 9 and the
    last, with the state and metrics of that step and the row the built-ins built before it
    (the log's at its log steps, every 2); the built-ins are hooks added the same way."""
    cfg = make_cfg("model=tiny", "model.n_layers=1", "data.seq_len=16", "data.batch_size=8",
                   "logger=none", "parallelism=dp2", "train.steps=10", "train.log_every=2",
                   "train.eval_every=0", "checkpoint.every=0")
    trainer = open_run(cfg, tmp_path)
    kinds = [type(h) for h in trainer.hooks]
    for builtin in (TraceHook, LogHook, EvalHook, CheckpointHook, GoodputHook):
        assert builtin in kinds
    seen: list[tuple[int, int, set[str]]] = []

    @trainer.add_hook(every=3)
    def record(info: StepInfo) -> None:
        seen.append((info.done, int(info.state.step), {k for k in info.row if k == "train/loss"}))

    summary = trainer.train()
    assert [(done, step) for done, step, _ in seen] == [(3, 3), (6, 6), (9, 9), (10, 10)]
    # the log's part is in the row at its log steps (6, 10), not at 3 and 9
    assert [bool(keys) for _, _, keys in seen] == [False, True, False, True]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6, 8, 10]
    assert summary["train/loss"] == rows[-1]["train/loss"]
