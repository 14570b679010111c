"""Every command-line tool answers ``--help`` with its usage and exit 0 (issue 25: evaluate and
sample used to read ``--help`` as a run dir)."""

import subprocess
import sys

import pytest

# (module, a phrase its usage must contain)
TOOLS = [
    ("dxrun", "Configuration groups"),  # Hydra's app help
    ("dxrun.evaluate", "usage: python -m dxrun.evaluate <run dir"),
    ("dxrun.sample", "usage: python -m dxrun.sample <run dir"),
    ("dxrun.launch", "--nproc"),
    ("dxrun.report", "sweep_dir"),
    ("dxrun.bench", "--quick"),
    ("dxrun.data.prepare", "out_dir"),
    ("dxrun.dashboard", "--entity"),
    ("dxrun.profile", "run_dir"),
]


@pytest.mark.parametrize("module,phrase", TOOLS, ids=[m for m, _ in TOOLS])
def test_every_tool_answers_help(module, phrase, tmp_path):
    # From an empty dir: --help must not be taken for a path, and writes nothing.
    p = subprocess.run([sys.executable, "-m", module, "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert phrase in p.stdout
    assert "error" not in p.stderr.lower()
    assert list(tmp_path.iterdir()) == []
