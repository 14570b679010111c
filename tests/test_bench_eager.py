"""The PyTorch comparison's plumbing (benchmarks/eager.py), without torch: the workers' line
format and the reference's arguments from the compared config."""

from __future__ import annotations

import re

import pytest

from benchmarks.eager import ROOT, SHAPE, parse_line, torch_argv
from benchmarks.speed import compose_cfg


def test_parse_line_reads_both_workers_lines():
    doc = (ROOT / "benchmarks" / "torch_reference.py").read_text()
    example = re.search(r"^\s+(torch_reference ms_per_step=.*)$", doc, re.M).group(1)
    torch_line = parse_line(example)  # the line the reference documents
    assert torch_line["name"] == "torch_reference" and torch_line["ms_per_step"] == 33.41
    assert torch_line["cpu_ms_per_step"] == 60.2 and torch_line["threads"] == 2.0
    dx = parse_line("dxrun ms_per_step=41.250 cpu_ms_per_step=70.1 steps=100 loss=2.5432 "
                    "devices=1 jax=0.10.2")
    assert (dx["ms_per_step"], dx["steps"], dx["jax"]) == (41.25, 100.0, "0.10.2")
    for bad in ("ready devices=1", "dxrun ms_per_step=fast", "dxrun ms_per_step 3"):
        with pytest.raises(ValueError):
            parse_line(bad)


def test_torch_reference_gets_the_compared_config():
    argv = torch_argv(compose_cfg(*SHAPE))
    assert argv[0].endswith("benchmarks/torch_reference.py") and "--serve" in argv
    args = dict(a[2:].split("=") for a in argv[2:])
    assert {k: args[k] for k in ("vocab", "seq", "batch", "layers", "d-model", "heads", "d-ff")} \
        == {"vocab": "64", "seq": "64", "batch": "12", "layers": "4", "d-model": "128",
            "heads": "4", "d-ff": "512"}
    assert (float(args["lr"]), float(args["wd"]), float(args["clip"])) == (1e-2, 0.1, 1.0)
    with pytest.raises(ValueError, match="without biases"):  # a block the reference lacks
        torch_argv(compose_cfg(*SHAPE, "model.bias=true"))
