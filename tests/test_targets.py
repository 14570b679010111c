"""Your own parts through Hydra's ``_target_``: optimizer._target_ trains as the preset it names."""

from __future__ import annotations

import json

import pytest
from conftest import make_cfg

from dxrun.errors import ConfigError
from dxrun.optimizer import custom_optimizer
from dxrun.train import train

TINY = ["model=tiny", "model.n_layers=1", "data.seq_len=16", "data.batch_size=8",
        "parallelism=dp1", "logger=none"]


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_an_optimizer_target_is_the_preset_it_names(tmp_path):
    """optimizer._target_ with optax.adamw and the preset's numbers trains exactly as
    optimizer=adamw does (no weight decay: the preset's mask is then moot)."""
    same = [*TINY, "optimizer.weight_decay=0.0", "train.steps=3", "train.log_every=1",
            "train.eval_every=0", "checkpoint.every=0"]
    train(make_cfg(*same), tmp_path / "preset")
    train(make_cfg(*same, "optimizer._target_=optax.adamw", "+optimizer.kwargs.b1=0.9",
                   "+optimizer.kwargs.b2=0.95", "+optimizer.kwargs.eps=1e-8",
                   "+optimizer.kwargs.weight_decay=0.0"), tmp_path / "target")
    losses = [[r["train/loss"] for r in _rows(tmp_path / d)] for d in ("preset", "target")]
    assert len(losses[0]) == 3 and losses[0] == losses[1]


def test_an_optimizer_target_that_is_no_optax_factory_is_refused():
    with pytest.raises(ConfigError, match=r"^optimizer._target_=optax.nope cannot be imported"):
        custom_optimizer("optax.nope", lambda s: 0.1, {})
    with pytest.raises(ConfigError, match=r"returned a dict, not an optax"):
        custom_optimizer("builtins.dict", lambda s: 0.1, {})
