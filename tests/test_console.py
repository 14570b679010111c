"""The console's log lines: a window whose tokens/s a checkpoint save slowed says so, with the
seconds the metrics row records (issue 25: the first Orbax save of a process halves the first
window's throughput, and the line said nothing)."""

from __future__ import annotations

import json
import re

import pytest
from conftest import run_cli

from dxrun.tracking.console import format_line, save_note


def test_format_line_puts_the_note_after_the_tokens_per_s_it_explains():
    m = {"train/loss": 2.5, "perf/tokens_per_s": 1234.4, "train/lr": 1e-3}
    assert format_line(20, 40, m, save_note(8.62, True)) == (
        "step 20/40  loss 2.5000  1,234 tok/s (tok/s includes 8.6 s of checkpoint saving; a "
        "process's first save also sets up Orbax's writers)  lr 1.00e-03")
    assert format_line(20, 40, m, save_note(0.71, False)) == (
        "step 20/40  loss 2.5000  1,234 tok/s (tok/s includes 0.7 s of checkpoint saving)  "
        "lr 1.00e-03")
    assert format_line(20, 40, m) == "step 20/40  loss 2.5000  1,234 tok/s  lr 1.00e-03"


@pytest.mark.e2e
def test_the_line_after_the_first_save_says_why_it_is_slow(tmp_path):
    # Saves at 10, 20, ...; the save at step 10 holds the loop in the window (10, 20]. The
    # training program is test_chaos.py's (model=tiny, 40 steps; no eval, which would compile
    # one more at the last step): a whole-suite session has it in its compile cache already.
    p = run_cli("train.steps=40", "checkpoint.every=10", "train.log_every=10",
                "train.eval_every=0", "logger=none", "hydra.run.dir=run", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = {int(m.group(1)): line for line in (p.stdout + p.stderr).splitlines()
             if (m := re.search(r"step (\d+)/40", line))}
    assert "checkpoint saving" not in lines[10]  # no save in (0, 10]: the compile is not timed
    held = float(re.search(r"tok/s includes ([\d.]+) s of checkpoint saving; a process's "
                           r"first save also sets up Orbax's writers\)", lines[20]).group(1))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    row10 = next(r for r in rows if r.get("step") == 10)
    # The row of step 10 holds that save's blocking time (written after its save point).
    assert held == round(row10["perf/checkpoint_block_s"], 1) and held >= 0.5
