"""The run config: a typed schema for every Hydra group, and value checks Hydra cannot express.

The schema is registered in Hydra's ConfigStore as ``dxrun_schema`` and is the first entry of
``conf/config.yaml``'s defaults, so every group file and every command-line override is merged into
typed, closed (struct) nodes: an unknown key or a value of the wrong type fails at composition.

This module must not import JAX: the device count is decided from the composed config before
JAX starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

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


@dataclass
class ParallelismConfig:
    name: str = "auto"
    n_devices: int = 0  # 0 = all visible, k = the first k
    dp: int = -1  # -1 = inferred from the device count (at most one axis)
    fsdp: int = 1
    tp: int = 1
    on_mismatch: str = "error"  # error | shrink


@dataclass
class DataConfig:
    name: str = "markov"  # markov | text | tokens
    batch_size: int = 32  # global: all devices together
    seq_len: int = 64
    seed: int = 0
    # The vocabulary this data suggests; the small model presets follow it (${data.vocab_size}).
    vocab_size: int = 64
    path: str | None = None  # text: file, dir or glob; tokens: dir with train.bin/val.bin
    tokenizer: str | None = None  # text: a local tokenizer.json; None = bytes (vocab 256)
    dtype: str = "uint16"  # tokens: uint16 | uint32
    val_fraction: float = 0.05  # text: the tail of the corpus held out for eval
    workers: int = 0  # Grain worker processes (0 = prefetch threads only)
    order: int = 2  # markov: the next token depends on this many previous tokens
    symbols: int = 16  # markov: alphabet size; 0 = model.vocab_size
    branching: int = 3  # markov: successors per context (the chain is sparse)


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
class TrainConfig:
    steps: int = 600
    log_every: int = 50
    eval_every: int = 100  # 0 = no evaluation
    seed: int = 0
    precision: str = "fp32"  # fp32 | bf16
    nan_policy: str = "halt"  # halt | skip: what a non-finite loss or gradient does
    # Test-only: make step k's loss NaN (0 = off), to exercise train.nan_policy.
    inject_nan_at_step: int = 0


@dataclass
class CheckpointConfig:
    every: int = 100  # save every this many steps (and at the last step); 0 = never
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
    job_type: str = "train"
    tags: list[str] = field(default_factory=list)


@dataclass
class RuntimeConfig:
    cpu_devices: int = 8  # simulated CPU devices when no accelerator is present
    # Peak TFLOP/s per device for perf/mfu: null = the built-in table by device kind,
    # a number, or "measure" (a one-off matmul probe; meant for CPUs).
    peak_tflops: Any = None


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
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def register() -> None:
    ConfigStore.instance().store(name="dxrun_schema", node=RunConfig)


_CHOICES = {
    "model.norm": ("layernorm", "rmsnorm"),
    "model.mlp": ("gelu", "swiglu"),
    "model.pos": ("learned", "rope"),
    "parallelism.on_mismatch": ("error", "shrink"),
    "data.name": ("markov", "text", "tokens"),
    "data.dtype": ("uint16", "uint32"),
    "optimizer.name": ("adamw", "sgd", "lion"),
    "optimizer.schedule": ("constant", "warmup_cosine", "wsd"),
    "optimizer.lr_scaling": ("none", "linear", "sqrt"),
    "train.precision": ("fp32", "bf16"),
    "train.nan_policy": ("halt", "skip"),
    "logger.name": ("wandb", "none"),
}

_POSITIVE = (
    "model.n_layers", "model.d_model", "model.n_heads", "model.n_kv_heads", "model.d_ff",
    "model.vocab_size", "model.max_seq_len", "data.batch_size", "data.seq_len", "data.order",
    "data.branching", "optimizer.lr", "optimizer.base_batch_size", "train.steps",
    "train.log_every", "runtime.cpu_devices", "eval.batches", "data.vocab_size",
)

_NON_NEGATIVE = (
    "optimizer.weight_decay", "optimizer.warmup_steps", "optimizer.clip_norm",
    "parallelism.n_devices", "data.symbols", "model.dropout", "train.eval_every", "data.workers",
)


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
        try:
            valid = ", ".join(_valid_keys(parent))
        except Exception:  # noqa: BLE001
            return None
        where = f"a key of {parent}" if parent else "a config key"
        return f"{cause.full_key} is not {where}; check the spelling (valid: {valid})"
    if isinstance(cause, ValidationError) and cause.full_key:
        first = str(cause.msg).splitlines()[0]
        return f"{cause.full_key}: {first}; give a value of the key's type"
    return None


def _get(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def validate(cfg: Any) -> None:
    """Check values the schema's types cannot; raise ConfigError naming key, value and fix."""
    validate_checkpoint(cfg)
    for key, allowed in _CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}; pick one of them")
    for key in _POSITIVE:
        value = _get(cfg, key)
        if not value > 0:
            raise ConfigError(f"{key}={value} must be positive; set {key} to a value > 0")
    for key in _NON_NEGATIVE:
        value = _get(cfg, key)
        if value < 0:
            raise ConfigError(f"{key}={value} must not be negative; set {key} >= 0")
    peak = cfg.runtime.peak_tflops
    if peak is not None and peak != "measure" and (
            isinstance(peak, bool) or not isinstance(peak, (int, float)) or peak <= 0):
        raise ConfigError(f"runtime.peak_tflops={peak!r} must be a positive number, 'measure' "
                          "or null (the built-in table)")
    if cfg.logger.mode not in (None, "offline", "online", "disabled"):
        raise ConfigError(f"logger.mode={cfg.logger.mode!r} is not one of offline, online, "
                          "disabled; or leave it null to follow $WANDB_MODE")
    m, d = cfg.model, cfg.data
    if d.name in ("text", "tokens") and not d.path:
        raise ConfigError(f"data={d.name} needs data.path; e.g. data.path=corpus.txt"
                          if d.name == "text" else
                          f"data={d.name} needs data.path, the folder with train.bin/val.bin")
    if not 0 <= d.val_fraction < 1:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be in [0, 1)")
    if m.dropout >= 1:
        raise ConfigError(f"model.dropout={m.dropout} must be below 1; use e.g. model.dropout=0.1")
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
    if d.seq_len > m.max_seq_len:
        raise ConfigError(
            f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}; "
            f"lower data.seq_len or raise model.max_seq_len"
        )
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
    if symbols**d.order > 2**22:
        raise ConfigError(
            f"data.order={d.order} with {symbols} symbols makes {symbols**d.order} contexts; "
            "lower data.order or data.symbols (at most 4M contexts)"
        )
    if d.seq_len <= d.order:
        raise ConfigError(f"data.seq_len={d.seq_len} must exceed data.order={d.order}")


def validate_checkpoint(cfg: Any) -> None:
    """The ``checkpoint`` section and ``train.inject_nan_at_step``."""
    c = cfg.checkpoint
    if c.every < 0:
        raise ConfigError(f"checkpoint.every={c.every} must not be negative; set a step "
                          "interval, or checkpoint.every=0 to never save")
    if c.keep < 1:
        raise ConfigError(f"checkpoint.keep={c.keep} must be at least 1; e.g. checkpoint.keep=3")
    if not c.resume:
        raise ConfigError("checkpoint.resume is empty; use auto, none or the path of a "
                          "checkpoints dir")
    if cfg.train.inject_nan_at_step < 0:
        raise ConfigError(f"train.inject_nan_at_step={cfg.train.inject_nan_at_step} must not "
                          "be negative; 0 turns it off")
