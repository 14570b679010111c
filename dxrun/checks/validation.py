"""The value checks Hydra cannot express, one function per section of the composed config.

``validate`` checks what the schema's fields say (``check_section``: choices, ranges, read from
dxrun/config/schema.py) and what no single key can say (``check_model``'s head counts,
``check_data``'s sequence length against the model...); each refusal is a ConfigError naming
the key, the value and the fix. Each check receives its section (and the data's, the model it
feeds).

No JAX import: the device count is decided from the composed config before JAX starts.
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dxrun.config import (
    BACKENDS,
    DATA_SOURCE_KEYS,
    FIELDS,
    GLOBAL,
    HF_TYPES,
    PER_DEVICE,
    RANGES,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    DistributedConfig,
    EvalConfig,
    LoggerConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    PlanConfig,
    RunConfig,
    RunSection,
    RuntimeConfig,
    TrainConfig,
    check_rope_scaling,
    head_dim_of,
    hf_dir,
    null_is_a_value,
)
from dxrun.config.metric_names import METRICS, NOT_IN_ROWS, ONLY_WITH
from dxrun.cost import TARGETS
from dxrun.data import MAX_TABLE_BYTES, table_bytes
from dxrun.plan import check_batch_keys, default_seq_len, resolve_loss_chunk
from dxrun.run import unread_logger_keys


def validate(cfg: RunConfig) -> None:
    """Check values the schema's types cannot; raise ConfigError naming key, value and fix.
    The model comes before the data: the data's checks read the model's (checked) sizes."""
    check_checkpoint(cfg.checkpoint)
    check_model(cfg.model)
    check_parallelism(cfg.parallelism)
    check_data(cfg.data, cfg.model)
    check_optimizer(cfg.optimizer)
    check_logger(cfg.logger)
    check_train(cfg.train)
    check_eval(cfg.eval)
    check_runtime(cfg.runtime)
    check_run(cfg.run)
    check_plan(cfg.plan)
    check_distributed(cfg.distributed)
    check_monitors(cfg)


def logged_metrics(cfg: RunConfig) -> list[str]:
    """The metric names a training run of ``cfg`` logs in its rows (``metrics.jsonl``), in the
    reference list's order: what checkpoint.keep_best and train.early_stop.monitor can watch."""
    return [name for name in METRICS if name not in NOT_IN_ROWS
            and not (name.startswith("eval/") and cfg.train.eval_every == 0)
            and _logged_with(cfg, name) is None]


def _logged_with(cfg: RunConfig, name: str) -> tuple[str, str, Any] | None:
    """(key, value, the run's value) of the setting ``name`` is logged only with, where the
    run has another; None when the run logs it as far as that goes."""
    if name.startswith("moe/"):  # a mixture of experts' rows: any expert count
        has = OmegaConf.select(cfg, "model.moe.n_experts")
        return None if has else ("model.moe.n_experts", "N", has)
    if name not in ONLY_WITH or (name == "data/entropy_floor" and cfg.data._target_):
        return None
    key, value = ONLY_WITH[name]
    has = OmegaConf.select(cfg, key)
    return None if has == value else (key, value, has)


def check_monitors(cfg: RunConfig) -> None:
    """checkpoint.keep_best and train.early_stop.monitor watch a metric the run logs: a name
    it never logs (a typo, a metric of another setting or of no training row) is refused,
    naming the ones it does; an eval/* one needs evaluation."""
    for key, metric in (("checkpoint.keep_best", cfg.checkpoint.keep_best),
                        ("train.early_stop.monitor", cfg.train.early_stop.monitor)):
        if not metric:
            continue
        names = logged_metrics(cfg)
        if metric not in METRICS:
            near = _nearest(metric, names)
            raise ConfigError(f"{key}={metric} names no metric this run logs; "
                              + (f"did you mean {near}? It logs " if near else "it logs ")
                              + ", ".join(names))
        if where := NOT_IN_ROWS.get(metric):
            raise ConfigError(f"{key}={metric} is {where} metric, in no training run's rows; "
                              f"watch a metric this run logs: {', '.join(names)}")
        if metric.startswith("eval/") and cfg.train.eval_every == 0:
            raise ConfigError(f"{key}={metric} needs evaluation but train.eval_every=0; set "
                              "train.eval_every > 0 or monitor a train/* metric")
        if (setting := _logged_with(cfg, metric)) is not None:
            k, value, has = setting
            raise ConfigError(f"{key}={metric} is logged only with {k}={value} (this run has "
                              f"{k}={has}); set {k}={value}, or watch another metric")


def _nearest(metric: str, names: list[str]) -> str | None:
    """The logged name ``metric`` most likely meant: the closest spelling, else the first
    with its last part (``loss``: train/loss)."""
    if close := difflib.get_close_matches(metric, names, n=1):
        return close[0]
    tail = metric.rsplit("/", 1)[-1]
    return next((n for n in names if n.rsplit("/", 1)[-1] == tail), None)


def config_warnings(cfg: RunConfig) -> list[str]:
    """Settings that run but probably not as meant; the launcher logs each once."""
    out = []
    steps = cfg.train.steps
    # make_schedule cuts the warmup to the run. Plan mode trains nothing: the schedule against
    # train.steps is no part of its answer.
    if cfg.run.mode != "plan" and cfg.optimizer.warmup_steps >= steps:
        out.append(f"optimizer.warmup_steps={cfg.optimizer.warmup_steps} >= train.steps="
                   f"{steps}: the warmup is cut to the run's {steps} steps, so the learning "
                   f"rate climbs for the whole run and its last step uses {steps - 1}/{steps} "
                   "of optimizer.lr; lower optimizer.warmup_steps for a run that holds it")
    return out + unread_logger_keys(cfg.logger)


def _keys_of(section: str) -> list[str]:
    return [k for k in FIELDS if k.startswith(f"{section}.")]


def _get(node: Any, key: str) -> Any:
    """``key`` (``section.name``, or ``train.profile.start``) read from its section's node."""
    for part in key.split(".")[1:]:
        node = node[part]
    return node


def check_choices(node: Any, section: str) -> None:
    """Each key of ``section`` (``node``) with choices holds one of them (null where null is a
    setting)."""
    for key in _keys_of(section):
        allowed = FIELDS[key].metadata["choices"]
        if not isinstance(allowed, tuple) or (value := _get(node, key)) in allowed:
            continue  # plan.target's list is cost.TARGETS: check_plan
        if value is None and (null_is_a_value(key) or FIELDS[key].metadata["sources"]):
            continue  # a source's key left null: not read, or check_data's (data.dtype)
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}; "
                          f"{FIELDS[key].metadata['fix']}")


def check_ranges(node: Any, section: str) -> None:
    """Each numeric key of ``section`` (``node``) with a range holds a value in it."""
    for key in _keys_of(section):
        if (r := RANGES.get(key)) is None:
            continue
        value = _get(node, key)
        if value is None and (key in (GLOBAL, PER_DEVICE) or null_is_a_value(key)
                              or not _source_reads(node, key)):
            continue  # the batch key not given (check_batch_keys), auto, a key not read
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} is not a finite number; {r.fix(key)}")
        if value is None or value not in r:
            raise ConfigError(f"{key}={value} is outside its range {r}; {r.fix(key)}")


def _source_reads(node: Any, key: str) -> bool:
    """Whether the data source reads ``key`` (only data keys name sources; ``node``: data)."""
    sources = FIELDS[key].metadata["sources"]
    return not sources or node.name in sources


def check_section(node: Any, section: str) -> None:
    """What the schema's fields say of ``section`` (``node``): its choices, then its ranges."""
    check_choices(node, section)
    check_ranges(node, section)


def check_parallelism(p: ParallelismConfig) -> None:
    check_section(p, "parallelism")  # the axes against the devices: plan.make_plan


def check_optimizer(o: OptimizerConfig) -> None:
    check_section(o, "optimizer")


def check_logger(lg: LoggerConfig) -> None:
    check_section(lg, "logger")
    for b in lg.backends:
        if b not in BACKENDS:
            raise ConfigError(f"logger.backends has {b!r}; pick from {', '.join(BACKENDS)}")


def check_eval(e: EvalConfig) -> None:
    check_section(e, "eval")


def check_run(r: RunSection) -> None:
    check_section(r, "run")
    wait = r.wait_for_lock
    if not isinstance(wait, bool) and (not isinstance(wait, (int, float)) or not wait >= 0):
        raise ConfigError(f"run.wait_for_lock={wait!r} must be true, false or a number of "
                          "seconds >= 0")


def check_distributed(d: DistributedConfig) -> None:
    check_section(d, "distributed")  # against the environment: distributed.join


def check_model(m: ModelConfig) -> None:
    check_section(m, "model")
    if m.head_dim is None and m.d_model % m.n_heads:
        raise ConfigError(
            f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; "
            "pick n_heads that divides d_model, or set model.head_dim"
        )
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}; "
            "pick n_kv_heads that divides n_heads"
        )
    check_rope_scaling(m.rope_scaling)
    hf_dir(m.init_from)  # refuses a value that names no hf:<dir>
    if m.init_from and m._target_:
        raise ConfigError(f"model.init_from={m.init_from} imports into dxrun's own model, not "
                          f"model._target_={m._target_}; drop one of them")
    if m.pos == "rope" and head_dim_of(m) % 2:
        raise ConfigError(f"model.pos=rope needs an even head dim, got {head_dim_of(m)} "
                          "(model.head_dim, or d_model/n_heads when null); make it even")
    _check_attention_pieces(m)
    if m.objective == "mdlm" and m._target_:
        raise ConfigError(f"model.objective=mdlm trains dxrun's own model (attention both ways, "
                          f"a [MASK] row), not model._target_={m._target_}; drop one of them")
    check_moe(m)


def check_moe(m: ModelConfig) -> None:
    """Raise ConfigError (key, value, fix) for ``model.moe`` keys that do not fit together or
    with the model (``m``, the model section)."""
    moe = m.moe
    if not moe.n_experts:
        return
    if moe.top_k > moe.n_experts:
        raise ConfigError(f"model.moe.top_k={moe.top_k} is more than model.moe.n_experts="
                          f"{moe.n_experts}; set model.moe.top_k<={moe.n_experts}")
    if moe.first_dense >= m.n_layers:
        raise ConfigError(f"model.moe.first_dense={moe.first_dense} leaves no MoE layer of "
                          f"model.n_layers={m.n_layers}; set model.moe.first_dense<{m.n_layers}")
    if (m.n_layers - moe.first_dense) % moe.every:
        raise ConfigError(
            f"model.moe.every={moe.every} does not divide the {m.n_layers - moe.first_dense} "
            f"layers after model.moe.first_dense={moe.first_dense} (the layers scan in groups "
            f"of every); pick model.moe.every dividing {m.n_layers - moe.first_dense}")
    if moe.shared_gate and not moe.shared_d_ff:
        raise ConfigError("model.moe.shared_gate=true gates a shared expert, but "
                          "model.moe.shared_d_ff=0 has none; set model.moe.shared_d_ff")
    if moe.bias_rate and moe.router != "sigmoid":
        raise ConfigError(f"model.moe.bias_rate={moe.bias_rate} moves the sigmoid router's "
                          f"balancing bias, but model.moe.router={moe.router}; set "
                          "model.moe.router=sigmoid or model.moe.bias_rate=0")
    if m.get("_target_"):
        raise ConfigError(f"model.moe.n_experts={moe.n_experts} builds dxrun's own model, not "
                          f"model._target_={m._target_}; drop one of them")


def _check_attention_pieces(m: ModelConfig) -> None:
    """model.qkv_bias, model.sliding_window and the keys beside them: the combinations that
    mean nothing."""
    if m.qkv_bias and m.bias:
        raise ConfigError("model.qkv_bias=true with model.bias=true: bias already puts biases "
                          "on q, k and v; set model.qkv_bias=false")
    if m.sliding_window is not None and m.objective == "mdlm":
        raise ConfigError(f"model.sliding_window={m.sliding_window} windows causal attention, "
                          "and model.objective=mdlm attends both ways; set "
                          "model.sliding_window=null")
    for name, needs, fix in (("global_every", "sliding_window", "set model.sliding_window"),
                             ("rope_local_theta", "global_every", "set model.global_every")):
        if getattr(m, name) is not None and getattr(m, needs) is None:
            raise ConfigError(f"model.{name}={getattr(m, name)} needs model.{needs}; {fix} or "
                              f"model.{name}=null")
    if m.hf_type is not None and m.hf_type not in HF_TYPES:
        raise ConfigError(f"model.hf_type={m.hf_type} is not a model_type dxrun writes; pick "
                          f"one of {', '.join(HF_TYPES)}, or null")
    if m.global_every == 1:
        raise ConfigError("model.global_every=1 makes every layer full, the window unused; set "
                          "model.global_every >= 2, or model.sliding_window=null")
    if m.norm_plus_one and m.norm != "rmsnorm":
        raise ConfigError(f"model.norm_plus_one=true scales RMSNorms, and model.norm={m.norm}; "
                          "set model.norm=rmsnorm or model.norm_plus_one=false")


def check_data(d: DataConfig, m: ModelConfig) -> None:
    """The ``data`` section, against the model it feeds (checked first)."""
    if d.name in ("text", "tokens") and not d.path:
        raise ConfigError(f"data={d.name} needs data.path; e.g. data.path=corpus.txt"
                          if d.name == "text" else
                          f"data={d.name} needs data.path, the folder with train.bin/val.bin")
    check_choices(d, "data")
    _check_source_keys(d)
    if d.name == "tokens" and d.dtype is None:
        raise no_token_dtype(d.path)
    check_batch_keys(d)
    check_ranges(d, "data")
    if d.seq_len is not None and d.seq_len > m.max_seq_len:
        raise ConfigError(
            f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}; "
            f"lower data.seq_len or raise model.max_seq_len"
        )
    if m.loss_chunk is not None and d.seq_len is not None:
        resolve_loss_chunk(m.loss_chunk, 1, d.seq_len, 1)  # refuses a chunk that does not divide
    if d.name == "markov":
        check_markov(d, m)


def _check_source_keys(d: DataConfig) -> None:
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


def check_markov(d: DataConfig, m: ModelConfig) -> None:
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


def check_train(t: TrainConfig) -> None:
    check_section(t, "train")
    if t.objective and t.objective.startswith("eval/") and t.eval_every == 0:
        raise ConfigError(f"train.objective={t.objective} needs evaluation but "
                          "train.eval_every=0; set train.eval_every > 0 (the run evaluates at "
                          "its end too)")


def check_runtime(r: RuntimeConfig) -> None:
    check_section(r, "runtime")
    peak = r.peak_tflops
    if peak is not None and peak != "measure" and (
            isinstance(peak, bool) or not isinstance(peak, (int, float))
            or not 0 < peak < math.inf):  # NaN fails both comparisons
        raise ConfigError(f"runtime.peak_tflops={peak!r} must be a finite positive number, "
                          "'measure' or null (the built-in table)")
    mem = r.memory_gb
    if mem is not None and not 0 < mem < math.inf:  # NaN fails both comparisons
        raise ConfigError(f"runtime.memory_gb={mem} must be a finite positive number, or null "
                          "(what the host or device reports)")


def check_plan(p: PlanConfig) -> None:
    check_section(p, "plan")
    targets = tuple(TARGETS)
    if p.target is not None and p.target not in targets:
        raise ConfigError(f"plan.target={p.target} is not a known target; choose one of "
                          f"{', '.join(targets)} (or leave it null for the visible devices)")


def check_checkpoint(c: CheckpointConfig) -> None:
    if not c.resume:
        raise ConfigError("checkpoint.resume is empty; use auto, none or the path of a "
                          "checkpoints dir")
    check_section(c, "checkpoint")
