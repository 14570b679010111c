"""Every command-line tool answers ``--help`` with its usage and exit 0 (issue 25: evaluate and
sample used to read ``--help`` as a run dir)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (module, a phrase its usage must contain)
TOOLS = [
    ("dxrun", "Configuration groups"),  # Hydra's app help
    ("dxrun.evaluate", "usage: python -m dxrun.evaluate <run dir"),
    ("dxrun.sample", "usage: python -m dxrun.sample <run dir"),
    ("dxrun.export", "usage: python -m dxrun.export <run dir"),
    ("dxrun.logits", "usage: python -m dxrun.logits <run dir"),
    ("dxrun.launch", "--nproc"),
    ("dxrun.report", "sweep_dir"),
    ("benchmarks", "--quick"),  # the checkout's, not installed: found through PYTHONPATH
    ("dxrun.data.prepare", "out_dir"),
    ("dxrun.dashboard", "--entity"),
    ("dxrun.profile", "run_dir"),
]


@pytest.mark.e2e  # a subprocess per tool
@pytest.mark.parametrize("module,phrase", TOOLS, ids=[m for m, _ in TOOLS])
def test_every_tool_answers_help(module, phrase, tmp_path):
    # From an empty dir: --help must not be taken for a path, and writes nothing.
    env = dict(os.environ)
    if module == "benchmarks":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    p = subprocess.run([sys.executable, "-m", module, "--help"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert phrase in p.stdout
    assert "error" not in p.stderr.lower()
    assert list(tmp_path.iterdir()) == []
