"""The console's log lines: a window whose tokens/s a checkpoint save slowed says so, with the
seconds the metrics row records (issue 25: the first Orbax save of a process halved the first
window's throughput, and the line said nothing; that save no longer holds the loop:
test_checkpoint.py's test_a_save_compiles_nothing_and_restores_bitwise)."""

from __future__ import annotations

from dxrun.tracking.console import format_line
from dxrun.tracking.goodput import save_note


def test_format_line_puts_the_note_after_the_tokens_per_s_it_explains():
    m = {"train/loss": 2.5, "perf/tokens_per_s": 1234.4, "train/lr": 1e-3}
    assert format_line(20, 40, m, save_note(8.62)) == (
        "step 20/40  loss 2.5000  1,234 tok/s (tok/s includes 8.6 s of checkpoint saving)  "
        "lr 1.00e-03")
    assert format_line(20, 40, m) == "step 20/40  loss 2.5000  1,234 tok/s  lr 1.00e-03"
