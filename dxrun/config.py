"""The run config: registering the schema with Hydra, and the value checks Hydra cannot express.

The schema (dxrun/schema.py: every key, its default, meaning, range and choices, written once)
is registered in Hydra's ConfigStore as ``dxrun_schema`` and is the first entry of
``conf/config.yaml``'s defaults, so every group file and every command-line override is merged into
typed, closed (struct) nodes: an unknown key or a value of the wrong type fails at composition.
``validate`` then checks what the fields say (``check_section``: choices, ranges) and what no
single key can say (``check_model``'s head counts, ``check_data``'s sequence length...), one
function per section. The schema's names stay importable from here.

This module must not import JAX: the device count is decided from the composed config before
JAX starts.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from dxrun.errors import ConfigError
from dxrun.plan.batch import GLOBAL, PER_DEVICE, check_batch_keys, default_batch, default_seq_len
from dxrun.schema import (  # noqa: F401 - the schema's names, importable from dxrun.config as before
    _CHOICES,
    DATA_SOURCE_KEYS,
    FIELDS,
    FRACTION,
    NON_NEGATIVE,
    NULLABLE,
    POSITIVE,
    RANGES,
    UNRANGED,
    CheckpointConfig,
    DataConfig,
    DistributedConfig,
    EvalConfig,
    LoggerConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    PlanConfig,
    ProfileConfig,
    Range,
    RunConfig,
    RunSection,
    RuntimeConfig,
    TrainConfig,
    choices_of,
    null_is_a_value,
    ranges_markdown,
)


def register() -> None:
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="dxrun_schema", node=RunConfig)
    OmegaConf.register_new_resolver("data_meta", data_meta, replace=True)
    OmegaConf.register_new_resolver("default_batch", default_batch, replace=True)
    OmegaConf.register_new_resolver("tokenizer_vocab", tokenizer_vocab, replace=True)
    _register_presets()


def conf_dir() -> Path:
    """conf/: shipped inside the package (dxrun/conf) or beside it in a checkout."""
    here = Path(__file__).resolve().parent
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


def model_changes(model: Any, preset: str | None) -> list[str]:
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
    here = Path(__file__).resolve().parent
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
    """The schema as one OmegaConf node, built once (about 40 ms each: ``check_keys`` asks
    for every group's keys, and runs twice per launch)."""
    from omegaconf import OmegaConf

    return OmegaConf.structured(RunConfig)


def _valid_keys(path: str) -> list[str]:
    node = _schema_node()
    for part in filter(None, path.split(".")):
        node = node[part]
    return list(node.keys())


def check_keys(cfg: Any) -> None:
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
    except Exception:  # noqa: BLE001 - dxrun.data.corpus.Tokenizer says what is wrong
        return default


def _check_source_keys(d: Any) -> None:
    for key, sources in DATA_SOURCE_KEYS.items():
        value = d[key]
        if d.name in sources or value is None:
            continue
        pick = " or ".join(f"data={s}" for s in sources)
        if key == "path":  # a prepared dir holds train.bin; anything else there is text
            where = Path(str(value)).expanduser()
            if (where / "train.bin").is_file():
                pick = "data=tokens"
            elif where.exists():
                pick = "data=text"
        used_by = " and ".join(f"data={s}" for s in sources)
        raise ConfigError(f"data.{key}={value} is used by {used_by}, not data={d.name}; "
                          f"add {pick} (or drop data.{key})")


def config_warnings(cfg: Any) -> list[str]:
    """Settings that run but probably not as meant; the launcher logs each once."""
    out = []
    steps = cfg.train.steps
    if cfg.optimizer.warmup_steps >= steps:  # make_schedule cuts the warmup to the run
        out.append(f"optimizer.warmup_steps={cfg.optimizer.warmup_steps} >= train.steps="
                   f"{steps}: the warmup is cut to the run's {steps} steps, so the learning "
                   f"rate climbs for the whole run and its last step uses {steps - 1}/{steps} "
                   "of optimizer.lr; lower optimizer.warmup_steps for a run that holds it")
    return out


def validate(cfg: Any) -> None:
    """Check values the schema's types cannot; raise ConfigError naming key, value and fix.
    The model comes before the data: the data's checks read the model's (checked) sizes."""
    for check in (check_checkpoint, check_model, check_parallelism, check_data, check_optimizer,
                  check_logger, check_train, check_eval, check_runtime, check_run, check_plan,
                  check_distributed):
        check(cfg)


def _keys_of(section: str) -> list[str]:
    return [k for k in FIELDS if k.startswith(f"{section}.")]


def _get(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def check_choices(cfg: Any, section: str) -> None:
    """Each key of ``section`` with choices holds one of them (null where null is a setting)."""
    for key in _keys_of(section):
        allowed = FIELDS[key].metadata["choices"]
        if not isinstance(allowed, tuple) or (value := _get(cfg, key)) in allowed:
            continue  # plan.target's list is plan.targets': check_plan
        if value is None and (null_is_a_value(key) or FIELDS[key].metadata["sources"]):
            continue  # a source's key left null: not read, or check_data's (data.dtype)
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}; "
                          f"{FIELDS[key].metadata['fix']}")


def check_ranges(cfg: Any, section: str) -> None:
    """Each numeric key of ``section`` with a range holds a value in it."""
    for key in _keys_of(section):
        if (r := RANGES.get(key)) is None:
            continue
        value = _get(cfg, key)
        if value is None and (key in (GLOBAL, PER_DEVICE) or null_is_a_value(key)
                              or not _source_reads(cfg, key)):
            continue  # the batch key not given (check_batch_keys), auto, a key not read
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} is not a finite number; {r.fix(key)}")
        if value is None or value not in r:
            raise ConfigError(f"{key}={value} is outside its range {r}; {r.fix(key)}")


def _source_reads(cfg: Any, key: str) -> bool:
    sources = FIELDS[key].metadata["sources"]
    return not sources or cfg.data.name in sources


def check_section(cfg: Any, section: str) -> None:
    """What the schema's fields say of ``section``: its choices, then its ranges."""
    check_choices(cfg, section)
    check_ranges(cfg, section)


def check_parallelism(cfg: Any) -> None:
    check_section(cfg, "parallelism")  # the axes against the devices: plan.make_plan


def check_optimizer(cfg: Any) -> None:
    check_section(cfg, "optimizer")


def check_logger(cfg: Any) -> None:
    check_section(cfg, "logger")


def check_eval(cfg: Any) -> None:
    check_section(cfg, "eval")


def check_run(cfg: Any) -> None:
    check_section(cfg, "run")
    wait = cfg.run.wait_for_lock
    if not isinstance(wait, bool) and (not isinstance(wait, (int, float)) or not wait >= 0):
        raise ConfigError(f"run.wait_for_lock={wait!r} must be true, false or a number of "
                          "seconds >= 0")


def check_distributed(cfg: Any) -> None:
    check_section(cfg, "distributed")  # against the environment: distributed.join


def check_model(cfg: Any) -> None:
    check_section(cfg, "model")
    m = cfg.model
    if m.d_model % m.n_heads:
        raise ConfigError(
            f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; "
            "pick n_heads that divides d_model"
        )
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}; "
            "pick n_kv_heads that divides n_heads"
        )
    if m.pos == "rope" and (m.d_model // m.n_heads) % 2:
        raise ConfigError(
            f"model.pos=rope needs an even head dim, got d_model/n_heads={m.d_model // m.n_heads}"
        )


def check_data(cfg: Any) -> None:
    """The ``data`` section, against the model it feeds (checked first)."""
    m, d = cfg.model, cfg.data
    if d.name in ("text", "tokens") and not d.path:
        raise ConfigError(f"data={d.name} needs data.path; e.g. data.path=corpus.txt"
                          if d.name == "text" else
                          f"data={d.name} needs data.path, the folder with train.bin/val.bin")
    check_choices(cfg, "data")
    _check_source_keys(cfg.data)
    if d.name == "tokens" and d.dtype is None:
        raise no_token_dtype(d.path)
    check_batch_keys(cfg.data)
    check_ranges(cfg, "data")
    if d.seq_len is not None and d.seq_len > m.max_seq_len:
        raise ConfigError(
            f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}; "
            f"lower data.seq_len or raise model.max_seq_len"
        )
    if m.loss_chunk is not None and d.seq_len is not None:
        from dxrun.plan.loss_chunk import resolve_loss_chunk

        resolve_loss_chunk(m.loss_chunk, 1, d.seq_len, 1)  # refuses a chunk that does not divide
    if d.name == "markov":
        check_markov(d, m)


def no_token_dtype(path: Any) -> ConfigError:
    """data=tokens whose meta.json gives no dtype (``data_meta`` found none) and no data.dtype:
    refused, never guessed (uint32 ids read as uint16 are other ids, and twice as many)."""
    meta = Path(str(path)).expanduser() / "meta.json"
    which = '("uint32" when ids reach 65536; `python -m dxrun.data.prepare` writes it)'
    if not meta.is_file():
        return ConfigError(f"data.path={path}: no {meta} to say the token files' dtype; write "
                           f'{{"dtype": "uint16"}} there {which}, or set data.dtype')
    return ConfigError(f"data.path={path}: {meta} gives no dtype of the token files; add "
                       f'"dtype": "uint16" to it {which}, or set data.dtype')


def check_markov(d: Any, m: Any) -> None:
    """data=markov: the chain fits the model's vocabulary, its tables fit in memory and its
    stationary solve is quick."""
    symbols = d.symbols or m.vocab_size
    if symbols > m.vocab_size:
        raise ConfigError(
            f"data.symbols={d.symbols} exceeds model.vocab_size={m.vocab_size}; "
            "lower data.symbols or raise model.vocab_size"
        )
    if d.branching > symbols:
        raise ConfigError(
            f"data.branching={d.branching} exceeds the alphabet ({symbols} symbols); lower it"
        )
    from dxrun.data.markov import MAX_TABLE_BYTES, table_bytes

    need = table_bytes(symbols, d.order, d.branching)
    if need > MAX_TABLE_BYTES:
        raise ConfigError(
            f"data.symbols={symbols} with data.order={d.order} makes {symbols**d.order:,} "
            f"contexts whose tables need {need / 2**30:,.1f} GiB (limit "
            f"{MAX_TABLE_BYTES / 2**30:.0f} GiB); lower data.order or data.symbols"
        )
    if symbols**d.order > 2**22:  # small tables, but the stationary solve would take hours
        raise ConfigError(
            f"data.order={d.order} with {symbols} symbols makes {symbols**d.order:,} contexts; "
            "lower data.order or data.symbols (at most 4M contexts)")
    # null: the shortest it can resolve to (the CPU default) must still exceed the order.
    if default_seq_len(d.seq_len, m.max_seq_len, "cpu") <= d.order:
        raise ConfigError(f"data.seq_len={d.seq_len} must exceed data.order={d.order}")


def check_train(cfg: Any) -> None:
    check_section(cfg, "train")
    objective = cfg.train.objective
    if objective and objective.startswith("eval/") and cfg.train.eval_every == 0:
        raise ConfigError(f"train.objective={objective} needs evaluation but train.eval_every=0; "
                          "set train.eval_every > 0 (the run evaluates at its end too)")


def check_runtime(cfg: Any) -> None:
    check_section(cfg, "runtime")
    peak = cfg.runtime.peak_tflops
    if peak is not None and peak != "measure" and (
            isinstance(peak, bool) or not isinstance(peak, (int, float))
            or not 0 < peak < math.inf):  # NaN fails both comparisons
        raise ConfigError(f"runtime.peak_tflops={peak!r} must be a finite positive number, "
                          "'measure' or null (the built-in table)")
    mem = cfg.runtime.memory_gb
    if mem is not None and not 0 < mem < math.inf:  # NaN fails both comparisons
        raise ConfigError(f"runtime.memory_gb={mem} must be a finite positive number, or null "
                          "(what the host or device reports)")


def check_plan(cfg: Any) -> None:
    check_section(cfg, "plan")
    targets = choices_of("plan.target")
    if cfg.plan.target is not None and cfg.plan.target not in targets:
        raise ConfigError(f"plan.target={cfg.plan.target} is not a known target; choose one of "
                          f"{', '.join(targets)} (or leave it null for the visible devices)")


def check_checkpoint(cfg: Any) -> None:
    c = cfg.checkpoint
    if not c.resume:
        raise ConfigError("checkpoint.resume is empty; use auto, none or the path of a "
                          "checkpoints dir")
    check_section(cfg, "checkpoint")

