"""The schema's value checks: every numeric key has a range, the README lists them."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from dxrun import config
from dxrun.errors import ConfigError

# Numeric keys checked elsewhere, and where: the plan (mesh axes accept -1 = inferred).
CHECKED_ELSEWHERE = {"parallelism.dp", "parallelism.fsdp", "parallelism.tp", "train.seed",
                     "data.seed", "runtime.peak_tflops"}


def _numeric_keys() -> list[str]:
    keys = []
    for group in dataclasses.fields(config.RunConfig):
        cls = getattr(config, group.type) if isinstance(group.type, str) else group.type
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in (int, float):
                keys.append(f"{group.name}.{f.name}")
    return keys


def test_every_numeric_key_has_a_range():
    missing = [k for k in _numeric_keys() if k not in config.RANGES and k not in CHECKED_ELSEWHERE]
    assert not missing, f"add these to config.RANGES: {missing}"


def test_readme_lists_the_generated_ranges():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert config.ranges_markdown() in readme, (
        "README's table of ranges is stale: paste the output of "
        "python -c 'from dxrun.config import ranges_markdown; print(ranges_markdown())'")


@pytest.mark.parametrize("override, bad", [
    ("optimizer.b1=1.0", True), ("optimizer.b1=0.0", False), ("optimizer.b2=-0.1", True),
    ("optimizer.eps=0", True), ("optimizer.momentum=1.0", True),
    ("optimizer.min_lr_ratio=1.0", False), ("optimizer.min_lr_ratio=1.01", True),
    ("optimizer.decay_frac=0", True), ("optimizer.decay_frac=1.0", False),
    ("model.init_std=0", True), ("model.rope_theta=-1", True), ("model.dropout=1.0", True),
    ("model.dropout=0.0", False), ("data.val_fraction=1.0", True),
    ("data.val_fraction=0.0", False),
])
def test_ranges_refuse_with_key_value_and_fix(cfg_factory, override, bad):
    cfg = cfg_factory(override)
    if not bad:
        config.validate(cfg)
        return
    with pytest.raises(ConfigError) as err:
        config.validate(cfg)
    key, value = override.split("=")
    msg = str(err.value)
    assert msg.startswith(f"{key}={value}") and "set " + key in msg and "\n" not in msg


def test_warmup_longer_than_training_warns(cfg_factory):
    (w,) = config.config_warnings(cfg_factory("train.steps=10", "optimizer.warmup_steps=20"))
    assert "optimizer.warmup_steps=20" in w and "train.steps=10" in w
    assert config.config_warnings(cfg_factory("train.steps=100")) == []
