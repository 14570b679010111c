"""The run config: the schema registered with Hydra, its resolvers and presets (every preset
file shipped: ``preset_files``), and the composition's errors in one line.

The schema (dxrun/config/schema.py: every key, its default, meaning, range and choices, written once)
is registered in Hydra's ConfigStore as ``dxrun_schema`` and is the first entry of
``conf/config.yaml``'s defaults, so every group file and every command-line override is merged
into typed, closed (struct) nodes: an unknown key or a value of the wrong type fails at
composition. ``dxrun.checks.validation`` then checks the values. No JAX import: the device count is
decided from the composed config before JAX starts.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from dxrun.config import ConfigError, ModelConfig, RunConfig, apply_hf_model

DEFAULT_BATCH = 32  # data.batch_size when no per-device batch is given


def default_batch(per_device: Any) -> int | None:
    """The ``default_batch`` resolver behind ``data.batch_size``'s default: 32, or null when a
    per-device batch gives the global one (dxrun/plan/batch.py)."""
    return DEFAULT_BATCH if per_device is None else None


def register() -> None:
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="dxrun_schema", node=RunConfig)
    OmegaConf.register_new_resolver("data_meta", data_meta, replace=True)
    OmegaConf.register_new_resolver("default_batch", default_batch, replace=True)
    OmegaConf.register_new_resolver("tokenizer_vocab", tokenizer_vocab, replace=True)
    _register_presets()


def conf_dir() -> Path:
    """conf/: shipped inside the package (dxrun/conf) or beside it in a checkout."""
    here = Path(__file__).resolve().parents[1]  # dxrun/
    shipped = here / "conf"
    return shipped if shipped.is_dir() else here.parent / "conf"


def data_meta(path: Any, key: str, default: Any) -> Any:
    """``${data_meta:${data.path},KEY,DEFAULT}``: KEY of ``meta.json`` in a token dir (what
    ``dxrun.data.prepare`` wrote), else DEFAULT. Resolved at composition, so the saved config,
    W&B and the model built from ``${data.vocab_size}`` all see the data's own values."""
    if path:
        try:
            meta = json.loads((Path(str(path)).expanduser() / "meta.json").read_text())
            value = meta.get(key) if isinstance(meta, dict) else None
        except (OSError, ValueError):  # the data loader refuses a bad meta.json in one line
            value = None
        if value is not None:
            return value
    return default


def model_changes(model: ModelConfig, preset: str | None) -> list[str]:
    """``key=value`` for each model key that differs from the preset ``conf/model/PRESET.yaml``
    (its values over the schema's), so a size made of overrides is never reported as the preset
    itself. Empty for an unknown preset (a user's own, found through hydra.searchpath)."""
    from omegaconf import OmegaConf

    path = conf_dir() / "model" / f"{preset}.yaml"
    if not preset or not path.is_file():
        return []
    raw = OmegaConf.load(path)
    preset_cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), raw.get("model", raw))
    # Unresolved on both sides: vocab_size: ${data.vocab_size} is the preset's own value.
    want = OmegaConf.to_container(preset_cfg, resolve=False)
    have = OmegaConf.to_container(model, resolve=False)
    return [f"{k}={model[k]}" for k, v in have.items() if k != "name" and want.get(k) != v]


# Preset groups and the top-level dirs that hold them (plural, beside conf/). A Hydra search
# path maps a group to a dir of the same name, so the files are stored in the ConfigStore
# instead: one mechanism for a checkout, an editable and a regular install (where the dirs
# ship inside the package as dxrun/experiments, dxrun/sweeps). A user's own presets go in
# <their dir>/experiment/NAME.yaml, added with hydra.searchpath=[file://<their dir>].
PRESETS = {"experiment": "experiments", "sweep": "sweeps"}


def preset_dir(group: str) -> Path:
    here = Path(__file__).resolve().parents[1]  # dxrun/
    shipped = here / PRESETS[group]
    return shipped if shipped.is_dir() else here.parent / PRESETS[group]


def _register_presets() -> None:
    from omegaconf import OmegaConf

    for group in PRESETS:
        for path in sorted(preset_dir(group).glob("*.yaml")):
            # Every preset is a "# @package _global_" file (checked by the tests), so it reads
            # the same when copied into a search-path dir.
            ConfigStore.instance().store(group=group, name=path.stem, package="_global_",
                                         node=OmegaConf.load(path))


@functools.cache
def _schema_node() -> Any:
    """The schema as one OmegaConf node, built once (not cheap: ``check_keys`` asks
    for every group's keys, and runs twice per launch)."""
    from omegaconf import OmegaConf

    return OmegaConf.structured(RunConfig)


def _valid_keys(path: str) -> list[str]:
    node = _schema_node()
    for part in filter(None, path.split(".")):
        node = node[part]
    return list(node.keys())


def check_composed(cfg: RunConfig, overrides: list[str]) -> None:
    """A composed config completed and its keys checked: ``model.init_from=hf:<dir>``'s model
    section read from the dir's config.json (``overrides``: the command line's, which it must
    not contradict), then ``check_keys``."""
    apply_hf_model(cfg, overrides)
    check_keys(cfg)


def check_keys(cfg: RunConfig) -> None:
    """Reject keys the schema does not have (Hydra lets ``+group.key=v`` add them)."""
    for group in cfg:
        if group not in RunConfig.__dataclass_fields__:
            raise ConfigError(f"{group} is not a config key; valid top-level keys: "
                              f"{', '.join(_valid_keys(''))}")
        allowed = set(_valid_keys(group))
        for key in cfg[group]:
            if key not in allowed:
                raise ConfigError(f"{group}.{key} is not a key of {group}; check the spelling "
                                  f"(valid: {', '.join(_valid_keys(group))})")


def composition_error(e: BaseException) -> str | None:
    """One line for a Hydra composition error: unknown group option, unknown key, wrong type."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    if isinstance(e, MissingConfigException) and e.options and e.missing_cfg_file:
        group, _, option = e.missing_cfg_file.rpartition("/")
        return (f"{group}={option} is not an option of the {group} group; choose one of: "
                f"{', '.join(e.options)}")
    cause = e.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        parent = cause.full_key.rpartition(".")[0]
        where = f"a key of {parent}" if parent else "a config key"
        try:
            valid = f" (valid: {', '.join(_valid_keys(parent))})"
        except Exception:  # noqa: BLE001 - hydra.* keys: not our schema, no list to offer
            valid = ""
        return f"{cause.full_key} is not {where}; check the spelling{valid}"
    if isinstance(cause, ValidationError) and cause.full_key:
        first = str(cause.msg).splitlines()[0]
        return f"{cause.full_key}: {first}; give a value of the key's type"
    return None


def tokenizer_vocab(path: Any, default: int) -> int:
    """``${tokenizer_vocab:${data.tokenizer},DEFAULT}``: the vocabulary of a tokenizer.json
    (added tokens included), else DEFAULT (bytes). An unreadable file gets DEFAULT here and
    its own one-line refusal when the data loads."""
    if not path:
        return default
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(str(path)).expanduser()))
        return int(tok.get_vocab_size(with_added_tokens=True))
    except Exception:  # noqa: BLE001 - dxrun.data.Tokenizer says what is wrong
        return default


def preset_files() -> dict[str, list[Path]]:
    """Every preset file shipped, by where it is chosen: ``conf/<group>/``, ``experiments/``,
    ``sweeps/``, ``sweeps/wandb/`` and the SLURM batch script. What the docs' Presets page lists
    (rendered by docs/reference/) and what the wheel check compares between the wheel and the
    checkout (.ci/wheel_check)."""
    conf = conf_dir()
    out = {f"{g.name}=": sorted(g.glob("*.yaml")) for g in sorted(conf.iterdir()) if g.is_dir()
           and g.name != "hydra"}
    out["hydra/launcher="] = sorted((conf / "hydra" / "launcher").glob("*.yaml"))
    out["experiment="] = sorted(preset_dir("experiment").glob("*.yaml"))
    out["sweep="] = sorted(preset_dir("sweep").glob("*.yaml"))
    out["wandb sweep"] = sorted((preset_dir("sweep") / "wandb").glob("*.yaml"))
    out["sbatch"] = sorted(preset_dir("experiment").glob("*.sbatch"))
    return out
