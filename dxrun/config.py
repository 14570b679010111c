"""The run config: a typed schema for every Hydra group, and value checks Hydra cannot express.

The schema is registered in Hydra's ConfigStore as ``dxrun_schema`` and is the first entry of
``conf/config.yaml``'s defaults, so every group file and every command-line override is merged into
typed, closed (struct) nodes: an unknown key or a value of the wrong type fails at composition.

This module must not import JAX: the device count is decided from the composed config before
JAX starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from dxrun.batch import GLOBAL, PER_DEVICE, check_batch_keys, default_batch, default_seq_len
from dxrun.errors import ConfigError


@dataclass
class ModelConfig:
    name: str = "tiny"
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 4
    d_ff: int = 256
    vocab_size: int = 64
    max_seq_len: int = 128
    bias: bool = True
    norm: str = "layernorm"  # layernorm | rmsnorm
    mlp: str = "gelu"  # gelu | swiglu
    pos: str = "learned"  # learned | rope
    dropout: float = 0.0
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    init_std: float = 0.02
    scan_layers: bool = True  # lax.scan over stacked layers (compile once); false = a loop
    remat: str = "none"  # none | full | dots (keep matmul outputs, recompute the rest)
    attention: str = "dot_product"  # dot_product (jax.nn, fused where available) | reference
    residual_dtype: str = "compute"  # compute (the train.precision dtype) | fp32
    # Cross-entropy and accuracy over chunks of this many positions of each sequence (the
    # logits of one chunk alive at a time); 0 = off; null = auto: on when one micro-batch's
    # fp32 logits would exceed 512 MiB per device (dxrun.chunked_loss).
    loss_chunk: int | None = None


@dataclass
class ParallelismConfig:
    name: str = "auto"
    n_devices: int = 0  # 0 = all visible, k = the first k
    dp: int = -1  # -1 = inferred from the device count (at most one axis)
    fsdp: int = 1
    tp: int = 1
    on_mismatch: str = "error"  # error | shrink
    # The vocab axis (wte / lm_head rows) is padded to a multiple of tp and of this; 0 = the
    # platform's (128 on GPU/TPU, 1 on CPU). E.g. 128 lays a GPU run's checkpoint out on CPU.
    vocab_align: int = 0
    # A multi-process run refuses a tensor-parallel group that spans processes (hosts): its
    # per-layer all-reduces would cross the network. true = allow it anyway.
    allow_cross_host_tp: bool = False
    # ZeRO-1: optimizer state (Adam/Lion moments, SGD momentum) also split over the `data`
    # replicas; null = auto (on when dp > 1). Same losses either way; checkpoints restore across.
    shard_optimizer: bool | None = None
    # parallelism=auto's layout search (dxrun/layout_search.py): none = dp/fsdp/tp as given |
    # measure = rank by estimate, time the top search_top, the fastest wins | model = the
    # estimate's first | fresh = measure, ignoring the cached decision.
    search: str = "none"
    search_top: int = 3  # parallelism.search=measure times this many of the ranking's best


@dataclass
class DataConfig:
    name: str = "markov"  # markov | text | tokens
    # Global (all devices, one optimizer update); its default is 32, or null when a per-device
    # batch is given (dxrun/batch.py: how a set value is told from the default).
    batch_size: int | None = "${default_batch:${data.per_device_batch_size}}"  # type: ignore[assignment]
    # Per data replica and micro-batch: global = this x dp x fsdp x train.grad_accum.
    per_device_batch_size: int | None = None
    # null = the platform's default: model.max_seq_len on an accelerator, 64 on CPU
    # (batch.default_seq_len); data=text and data=tokens default to it.
    seq_len: int | None = 64
    seed: int = 0
    # The vocabulary this data suggests; the small model presets follow it (${data.vocab_size}).
    vocab_size: int = 64
    # Keys only some sources read (DATA_SOURCE_KEYS) default to null and get their values from
    # the source's preset, so a key set for another source stands out and is refused.
    path: str | None = None  # text: file, dir or glob; tokens: dir with train.bin/val.bin
    tokenizer: str | None = None  # text: a local tokenizer.json; None = bytes (vocab 256)
    dtype: str | None = None  # tokens: uint16 | uint32 (default: meta.json's)
    val_fraction: float | None = None  # text: the tail of the corpus held out for eval
    workers: int | None = None  # text/tokens: Grain worker processes (0 = prefetch threads)
    order: int | None = None  # markov: the next token depends on this many previous tokens
    symbols: int | None = None  # markov: alphabet size; 0 = model.vocab_size
    branching: int | None = None  # markov: successors per context (the chain is sparse)


@dataclass
class OptimizerConfig:
    name: str = "adamw"  # adamw | sgd | lion
    lr: float = 1e-2
    weight_decay: float = 0.1
    decay_all: bool = False  # True also decays norms, biases and embeddings
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9  # sgd
    schedule: str = "warmup_cosine"  # constant | warmup_cosine | wsd
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # final lr / peak lr for cosine and wsd
    decay_frac: float = 0.2  # wsd: fraction of steps spent decaying
    clip_norm: float = 1.0  # 0 disables clipping
    lr_scaling: str = "none"  # none | linear | sqrt
    base_batch_size: int = 32  # the batch size at which optimizer.lr is the lr


@dataclass
class ProfileConfig:
    # Trace steps start..start+steps-1 with jax.profiler into <run dir>/profile/ (0 = off; the
    # attempt's first step compiles, so a start on it moves to the next step).
    start: int = 0
    steps: int = 3  # how many steps to trace


@dataclass
class TrainConfig:
    steps: int = 600
    log_every: int = 50
    eval_every: int = 100  # 0 = no evaluation
    seed: int = 0
    precision: str = "fp32"  # fp32 | bf16
    # Micro-batches per optimizer step: data.batch_size is still the batch of one update,
    # computed in grad_accum sequential pieces (less activation memory, same result).
    grad_accum: int = 1
    # The dtype weight gradients are summed over the batch and all-reduced in under
    # precision=bf16: fp32 (the fp32 master weights are cast at each use; Megatron's default)
    # | bf16 (the whole tree cast first: half the gradient traffic, bf16-rounded gradients).
    grad_reduce_dtype: str = "fp32"
    # The summary metric the run returns to a sweeper that minimises one number (Optuna),
    # e.g. "eval/loss"; None returns the whole summary.
    objective: str | None = None
    nan_policy: str = "halt"  # halt | skip: what a non-finite loss or gradient does
    # Test-only: make step k's loss NaN (0 = off), to exercise train.nan_policy.
    inject_nan_at_step: int = 0
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    # Test-only: from step k on (0 = off), the loop waits before each step for a SIGUSR1 (which
    # also asks for a save), so a test's signals land at known steps instead of racing the run.
    hold_at_step: int = 0
    # Test-only: after step k (0 = off) the loop raises an error that is not bad input, so the
    # crash path (one line, the traceback in the run's log) is tested on any host.
    inject_error_at_step: int = 0


@dataclass
class CheckpointConfig:
    # Save every this many steps (and at the last step); 0 = never; null (the default) = by
    # platform: 100 on CPU, on an accelerator a wall-clock cadence whose saves cost < 2% of the
    # run (``plan_mode.save_cadence``).
    every: int | None = None
    # Also save when this many minutes have passed since the last save (0 = off): bounds the
    # work lost and, for a large state at fast steps, the time spent saving (plan mode shows it).
    every_minutes: float = 0.0
    keep: int = 3  # the newest this many are kept
    dir: str | None = None  # None = <run dir>/checkpoints
    resume: str = "auto"  # auto | none | <path to a checkpoints dir or one step dir>
    allow_batch_change: bool = False  # resume with another data.batch_size


@dataclass
class EvalConfig:
    batches: int = 4  # held-out batches per evaluation (the same ones every time)


@dataclass
class LoggerConfig:
    name: str = "wandb"  # wandb | none
    project: str = "dxrun"
    entity: str | None = None
    mode: str | None = None  # offline | online | disabled; None = $WANDB_MODE, else offline
    group: str | None = None
    job_type: str | None = None  # None: "train" for a single run, "sweep" for a multirun job
    tags: list[str] = field(default_factory=list)


@dataclass
class RunSection:
    mode: str = "train"  # train | plan (compile for the mesh, estimate, train nothing)


@dataclass
class PlanConfig:
    # The accelerator plan mode estimates for (dxrun/plan_mode.py: TARGETS); null = the
    # devices this process sees.
    target: str | None = None
    # The checkpoint write bandwidth (GB/s, all processes together) plan mode assumes when it
    # costs a save (1: a shared filesystem from one client; local NVMe does several).
    write_gb_per_s: float = 1.0


@dataclass
class RuntimeConfig:
    cpu_devices: int = 8  # simulated CPU devices when no accelerator is present
    # The memory preflight: refuse a run whose compiled step will not fit (skip = run anyway);
    # memory_gb overrides the memory the preflight believes this host/device has.
    skip_memory_check: bool = False
    memory_gb: float | None = None
    # JAX's persistent compilation cache: "auto" = <user cache dir>/dxrun/jax, a path, or null.
    compile_cache: str | None = "auto"
    # Peak TFLOP/s per device for perf/mfu: null = the built-in table by device kind,
    # a number, or "measure" (a one-off matmul probe; meant for CPUs).
    peak_tflops: Any = None
    # Train on CPU on a host with an NVIDIA GPU (a JAX without its CUDA plugin): refused unless
    # true (or JAX_PLATFORMS=cpu), since it is almost always a missing pip install -e '.[gpu]'.
    allow_cpu: bool = False


@dataclass
class DistributedConfig:
    """Joining a multi-process run through JAX's distributed runtime (dxrun/distributed.py)."""

    # auto: join when the environment says this process is one of several (srun with several
    # tasks; JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID, as
    # python -m dxrun.launch sets them) | off | manual (the keys below)
    mode: str = "auto"
    coordinator: str | None = None  # host:port of process 0
    num_processes: int | None = None
    process_id: int | None = None
    # The accelerators this process drives: null = JAX's choice (under SLURM one per task when
    # a node runs several tasks, all when it runs one).
    local_device_ids: list[int] | None = None
    init_timeout_s: int = 300  # wait at most this long for every process to arrive
    heartbeat_timeout_s: int = 100  # a process silent this long is dead: the others exit


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    run: RunSection = field(default_factory=RunSection)
    plan: PlanConfig = field(default_factory=PlanConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


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


_CHOICES = {
    "model.norm": ("layernorm", "rmsnorm"),
    "model.mlp": ("gelu", "swiglu"),
    "model.pos": ("learned", "rope"),
    "model.remat": ("none", "full", "dots"),
    "model.attention": ("dot_product", "reference"),
    "model.residual_dtype": ("compute", "fp32"),
    "parallelism.on_mismatch": ("error", "shrink"),
    "parallelism.search": ("none", "measure", "model", "fresh"),
    "data.name": ("markov", "text", "tokens"),
    "data.dtype": ("uint16", "uint32"),
    "optimizer.name": ("adamw", "sgd", "lion"),
    "optimizer.schedule": ("constant", "warmup_cosine", "wsd"),
    "optimizer.lr_scaling": ("none", "linear", "sqrt"),
    "train.precision": ("fp32", "bf16"),
    "train.grad_reduce_dtype": ("fp32", "bf16"),
    "train.nan_policy": ("halt", "skip"),
    "logger.name": ("wandb", "none"),
    "run.mode": ("train", "plan"),
    "distributed.mode": ("auto", "off", "manual"),
}

@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: ``lo``/``hi`` bounds (None = unbounded), each closed
    or open. The docs' tables of ranges are generated from RANGES (``ranges_markdown``)."""

    lo: float | None = None
    hi: float | None = None
    lo_closed: bool = True
    hi_closed: bool = False

    def __contains__(self, v: float) -> bool:
        if self.lo is not None and (v < self.lo or (v == self.lo and not self.lo_closed)):
            return False
        return not (self.hi is not None and (v > self.hi or (v == self.hi and not self.hi_closed)))

    def __str__(self) -> str:
        if self.hi is None:
            return f"{'>=' if self.lo_closed else '>'} {_num(self.lo)}"
        return (f"{'[' if self.lo_closed else '('}{_num(self.lo)}, {_num(self.hi)}"
                f"{']' if self.hi_closed else ')'}")


def _num(x: float | None) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


POSITIVE, NON_NEGATIVE = Range(0, lo_closed=False), Range(0)
FRACTION = Range(0, 1)  # [0, 1)

# Every numeric key of the schema and the values it accepts, checked before anything runs.
RANGES: dict[str, Range] = {
    "model.n_layers": POSITIVE, "model.d_model": POSITIVE, "model.n_heads": POSITIVE,
    "model.n_kv_heads": POSITIVE, "model.d_ff": POSITIVE, "model.vocab_size": POSITIVE,
    "model.max_seq_len": POSITIVE, "model.dropout": FRACTION, "model.rope_theta": POSITIVE,
    "model.init_std": POSITIVE,
    "model.loss_chunk": NON_NEGATIVE,
    "parallelism.n_devices": NON_NEGATIVE, "parallelism.vocab_align": NON_NEGATIVE,
    "parallelism.search_top": POSITIVE,
    "data.batch_size": POSITIVE, "data.per_device_batch_size": POSITIVE,
    "data.seq_len": POSITIVE, "data.vocab_size": POSITIVE,
    "data.val_fraction": FRACTION, "data.workers": NON_NEGATIVE, "data.order": POSITIVE,
    "data.symbols": NON_NEGATIVE, "data.branching": POSITIVE,
    "optimizer.lr": POSITIVE, "optimizer.weight_decay": NON_NEGATIVE,
    "optimizer.b1": FRACTION, "optimizer.b2": FRACTION, "optimizer.eps": POSITIVE,
    "optimizer.momentum": FRACTION, "optimizer.warmup_steps": NON_NEGATIVE,
    "optimizer.min_lr_ratio": Range(0, 1, hi_closed=True),
    "optimizer.decay_frac": Range(0, 1, lo_closed=False, hi_closed=True),
    "optimizer.clip_norm": NON_NEGATIVE, "optimizer.base_batch_size": POSITIVE,
    "train.steps": POSITIVE, "train.log_every": POSITIVE, "train.grad_accum": POSITIVE,
    "train.eval_every": NON_NEGATIVE,
    "train.profile.start": NON_NEGATIVE, "train.profile.steps": POSITIVE,  # 0 = no trace
    "eval.batches": POSITIVE, "runtime.cpu_devices": POSITIVE,
    "train.inject_nan_at_step": NON_NEGATIVE,  # test-only; 0 = off
    "train.hold_at_step": NON_NEGATIVE,  # test-only; 0 = off
    "train.inject_error_at_step": NON_NEGATIVE,  # test-only; 0 = off
    "checkpoint.every": NON_NEGATIVE,  # 0 = only on a signal
    "checkpoint.every_minutes": NON_NEGATIVE,  # 0 = off
    "plan.write_gb_per_s": POSITIVE,
    "checkpoint.keep": Range(1),
    "distributed.init_timeout_s": POSITIVE, "distributed.heartbeat_timeout_s": POSITIVE,
    "data.seed": NON_NEGATIVE, "train.seed": NON_NEGATIVE,  # PRNG seeds
    "distributed.num_processes": POSITIVE, "distributed.process_id": NON_NEGATIVE,
}
# Keys whose null means "not given" (a range applies only to a value).
NULLABLE = ("distributed.num_processes", "distributed.process_id", "data.seq_len",
            "checkpoint.every", "model.loss_chunk")

# The integer and float keys of the schema that RANGES leaves out, and why: every numeric key is
# in one of the two (a test walks the schema).
UNRANGED = {
    "parallelism.dp": "-1 (inferred) or a size >= 1: plan._resolve_axes",
    "parallelism.fsdp": "-1 (inferred) or a size >= 1: plan._resolve_axes",
    "parallelism.tp": "-1 (inferred) or a size >= 1: plan._resolve_axes",
    "runtime.memory_gb": "positive or null: its own check in validate",
}


def ranges_markdown() -> str:
    """The table of accepted ranges (docs/guide/bad-input.md, the Reference), generated so it
    is never written twice."""
    by_range: dict[str, list[str]] = {}
    for key, r in RANGES.items():
        by_range.setdefault(str(r), []).append(f"`{key}`")
    rows = ["| accepted | keys |", "|---|---|"]
    rows += [f"| {r} | {', '.join(keys)} |" for r, keys in by_range.items()]
    return "\n".join(rows)


def _range_fix(key: str, r: Range) -> str:
    if r.hi is None:
        return f"set {key} {'>=' if r.lo_closed else '>'} {_num(r.lo)}"
    return f"set {key} in {r}"


def _valid_keys(path: str) -> list[str]:
    from omegaconf import OmegaConf

    node = OmegaConf.structured(RunConfig)
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


# The data keys only some sources read. Any other source refuses them: data.path given without
# data=tokens would otherwise train on markov data without a word.
DATA_SOURCE_KEYS: dict[str, tuple[str, ...]] = {
    "path": ("text", "tokens"), "tokenizer": ("text",), "val_fraction": ("text",),
    "workers": ("text", "tokens"), "dtype": ("tokens",),
    "order": ("markov",), "symbols": ("markov",), "branching": ("markov",),
}


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


def _get(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


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
    """Check values the schema's types cannot; raise ConfigError naming key, value and fix."""
    validate_checkpoint(cfg)
    for key, allowed in _CHOICES.items():
        value = _get(cfg, key)
        if value is None and key == "data.dtype" and cfg.data.name != "tokens":
            continue  # a key only data=tokens reads
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}; pick one of them")
    _check_source_keys(cfg.data)
    check_batch_keys(cfg.data)
    for key, r in RANGES.items():
        value = _get(cfg, key)
        group, _, name = key.partition(".")
        if value is None and key in (GLOBAL, PER_DEVICE):
            continue  # the one of the two not given (check_batch_keys)
        if value is None and key in NULLABLE:
            continue
        if value is None and group == "data" and cfg.data.name not in DATA_SOURCE_KEYS[name]:
            continue  # a key this source does not read
        if value is None or value not in r:
            raise ConfigError(f"{key}={value} is outside its range {r}; {_range_fix(key, r)}")
    peak = cfg.runtime.peak_tflops
    if peak is not None and peak != "measure" and (
            isinstance(peak, bool) or not isinstance(peak, (int, float)) or peak <= 0):
        raise ConfigError(f"runtime.peak_tflops={peak!r} must be a positive number, 'measure' "
                          "or null (the built-in table)")
    mem = cfg.runtime.memory_gb
    if mem is not None and not mem > 0:
        raise ConfigError(f"runtime.memory_gb={mem} must be positive, or null (what the host "
                          "or device reports)")
    from dxrun.plan_mode import TARGETS  # no JAX import there at module level

    if cfg.plan.target is not None and cfg.plan.target not in TARGETS:
        raise ConfigError(f"plan.target={cfg.plan.target} is not a known target; choose one of "
                          f"{', '.join(TARGETS)} (or leave it null for the visible devices)")
    if cfg.logger.mode not in (None, "offline", "online", "disabled"):
        raise ConfigError(f"logger.mode={cfg.logger.mode!r} is not one of offline, online, "
                          "disabled; or leave it null to follow $WANDB_MODE")
    objective = cfg.train.objective
    if objective and objective.startswith("eval/") and cfg.train.eval_every == 0:
        raise ConfigError(f"train.objective={objective} needs evaluation but train.eval_every=0; "
                          "set train.eval_every > 0 (the run evaluates at its end too)")
    m, d = cfg.model, cfg.data
    if d.name in ("text", "tokens") and not d.path:
        raise ConfigError(f"data={d.name} needs data.path; e.g. data.path=corpus.txt"
                          if d.name == "text" else
                          f"data={d.name} needs data.path, the folder with train.bin/val.bin")
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
    if d.seq_len is not None and d.seq_len > m.max_seq_len:
        raise ConfigError(
            f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}; "
            f"lower data.seq_len or raise model.max_seq_len"
        )
    if m.loss_chunk is not None and d.seq_len is not None:
        from dxrun.chunked_loss import resolve_loss_chunk

        resolve_loss_chunk(m.loss_chunk, 1, d.seq_len, 1)  # refuses a chunk that does not divide
    if d.name != "markov":
        return
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


def validate_checkpoint(cfg: Any) -> None:
    """The ``checkpoint`` section beyond its ranges."""
    c = cfg.checkpoint
    if not c.resume:
        raise ConfigError("checkpoint.resume is empty; use auto, none or the path of a "
                          "checkpoints dir")
