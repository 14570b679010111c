"""The run config's schema: every key of every section, each written once.

A key is one field, ``name: type = key(default, meaning, range=..., choices=...)``
(dxrun/config/key.py): the default, the one-line meaning the Reference shows, the values it
accepts, and the data sources that read it all sit in the field's metadata (OmegaConf's
structured configs and Hydra's ConfigStore read the dataclasses and ignore the metadata). A
default is written here and nowhere else (conf/config.yaml holds only the defaults list).
``RANGES``, ``_CHOICES``, ``UNRANGED``, ``NULLABLE`` and ``DATA_SOURCE_KEYS`` are read from the
fields; ``dxrun.checks.validation`` checks a composed config against them and the docs' generator
(docs/reference/) turns them into tables.

No JAX import: the device count is decided from the composed config before JAX starts.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from dxrun.config.key import (  # noqa: F401 - Range and the bounds, importable from here too
    BATCH,
    FRACTION,
    INT32,
    NON_NEGATIVE,
    POSITIVE,
    Range,
    key,
    ranges_table,
    section,
    walk,
)
from dxrun.config.schema_parallel import DistributedConfig, ParallelismConfig

# The two keys that give the batch (dxrun/plan/run_plan.py tells which one a run set).
GLOBAL, PER_DEVICE = "data.batch_size", "data.per_device_batch_size"


# The model section's mixture of experts (dxrun/model/moe.py builds it; docs/guide/moe.md).
@dataclass
class MoEConfig:
    n_experts: int = key(0, "routed experts per MoE layer; 0 = a dense model (no MoE layer)",
                         range=NON_NEGATIVE)
    top_k: int = key(2, "experts each token is routed to", range=POSITIVE)
    d_ff: int | None = key(None, "each expert's hidden width; null = model.d_ff",
                           range=POSITIVE)
    every: int = key(1, "every this many layers (after first_dense) is an MoE layer, the last "
                     "of each group (Qwen-MoE's decoder_sparse_step)", range=POSITIVE)
    first_dense: int = key(0, "dense layers before the first group (DeepSeek's "
                           "first_k_dense_replace)", range=NON_NEGATIVE)
    shared_d_ff: int = key(0, "hidden width of the shared expert every token passes through "
                           "(Qwen-MoE; DeepSeek: n_shared_experts x its d_ff); 0 = none",
                           range=NON_NEGATIVE)
    shared_gate: bool = key(False, "a sigmoid gate of the token on the shared expert's output "
                            "(Qwen2-MoE)")
    router: str = key("softmax", "softmax over the experts, then the top k (Mixtral, Qwen) | "
                      "sigmoid per expert, top k chosen with a balancing bias (DeepSeek-V3)",
                      choices=("softmax", "sigmoid"))
    renormalize: bool = key(True, "the top k weights divided by their sum (Mixtral, Qwen3, "
                            "DeepSeek-V3: true; Qwen2-MoE: false)")
    routed_scale: float = key(1.0, "the routed experts' output multiplied by this "
                              "(DeepSeek-V3's routed_scaling_factor)", range=POSITIVE)
    bias_rate: float = key(0.0, "router=sigmoid: the balancing bias moves by this per step "
                           "towards the mean load (DeepSeek-V3's gamma, 0.001); 0 = fixed",
                           range=NON_NEGATIVE)
    aux_loss: float = key(0.01, "the load-balancing loss's coefficient (n_experts x sum of "
                          "each expert's share of the routed tokens x its mean router "
                          "probability; 1 when balanced)", range=NON_NEGATIVE)
    z_loss: float = key(0.001, "the router z-loss's coefficient (mean squared logsumexp of "
                        "the router logits)", range=NON_NEGATIVE)
    capacity_factor: float | None = key(
        None, "null = dropless (every routed token computed); c = each expert takes at most "
        "c x tokens x top_k / n_experts of a batch's tokens, the rest dropped (counted: "
        "moe/dropped)", range=POSITIVE)


@dataclass
class ModelConfig:
    name: str = key("tiny", "the preset's name: W&B run name and tags; set it to name a model "
                    "made of overrides")
    n_layers: int = key(2, "transformer blocks", range=POSITIVE)
    d_model: int = key(64, "width of the residual stream", range=POSITIVE)
    n_heads: int = key(4, "attention (query) heads; divisible by parallelism.tp", range=POSITIVE)
    n_kv_heads: int = key(4, "key/value heads (grouped-query attention when fewer than n_heads)",
                          range=POSITIVE)
    head_dim: int | None = key(None, "each head's width (Gemma, Qwen3: not d_model / n_heads); "
                               "null = d_model / n_heads", range=POSITIVE)
    d_ff: int = key(256, "hidden width of the MLP", range=POSITIVE)
    vocab_size: int = key(64, "the model's vocabulary (the small presets follow data.vocab_size)",
                          range=POSITIVE)
    max_seq_len: int = key(128, "the context: positions the model has", range=POSITIVE)
    bias: bool = key(True, "biases in the linear layers and norms (GPT-2 style)")
    qkv_bias: bool = key(False, "biases on the q, k and v projections only (Qwen2); "
                         "model.bias=true has them already")
    qk_norm: str = key("none", "RMSNorm of the queries and keys before rotary positions: none, "
                       "head (each head's own E-wide norm: Qwen3) or proj (across all heads, "
                       "one H*E-wide norm: OLMo 2)", choices=("none", "head", "proj"))
    sliding_window: int | None = key(
        None, "Each query sees only the last this many positions, itself included (Mistral's "
        "sliding window); null = the whole causal prefix.", range=POSITIVE)
    global_every: int | None = key(
        None, "With model.sliding_window: every this-many-th layer (the last of each run of "
        "layers) attends to the whole prefix, the others to the window (Gemma 2: 2, Gemma 3: "
        "6); null = every layer windowed.", range=POSITIVE)
    rope_local_theta: float | None = key(
        None, "With model.global_every: the windowed layers' RoPE base (Gemma 3's "
        "rope_local_base_freq); null = model.rope_theta.", range=POSITIVE)
    attn_softcap: float | None = key(
        None, "Attention scores soft-capped to (-c, c) as c tanh(s / c) (Gemma 2's "
        "attn_logit_softcapping); null = none.", range=POSITIVE)
    logit_softcap: float | None = key(
        None, "The output logits soft-capped likewise (Gemma 2's final_logit_softcapping); "
        "null = none.", range=POSITIVE)
    attn_scalar: float | None = key(
        None, "Attention scores scaled by this^-1/2 (Gemma 2/3's query_pre_attn_scalar); "
        "null = the head dim.", range=POSITIVE)
    norm: str = key("layernorm", "the blocks' normalisation (GPT-2: layernorm; Llama: rmsnorm)",
                    choices=("layernorm", "rmsnorm"))
    norm_position: str = key("pre", "where the blocks' norms sit: pre (on the inputs of "
                             "attention and the MLP: GPT-2, Llama), post (on their outputs, "
                             "before the residual add: OLMo 2) or sandwich (both: Gemma 2/3)",
                             choices=("pre", "post", "sandwich"))
    norm_plus_one: bool = key(False, "RMSNorms scale by 1 + their weight, which starts at 0 "
                              "(Gemma)")
    norm_eps: float = key(1e-5, "the norms' epsilon (a Hugging Face checkpoint's "
                          "layer_norm_epsilon or rms_norm_eps)", range=POSITIVE)
    mlp: str = key("gelu", "the MLP (GPT-2: gelu; Llama: swiglu, gated; Gemma: geglu, "
                   "gated)", choices=("gelu", "swiglu", "geglu"))
    gelu: str = key("tanh", "GELU's form in the gelu and geglu MLPs: tanh (GPT-2's gelu_new, "
                    "gelu_pytorch_tanh) or exact (erf: gelu)", choices=("tanh", "exact"))
    pos: str = key("learned", "positions: learned embeddings (GPT-2) or rotary (Llama)",
                   choices=("learned", "rope"))
    dropout: float = key(0.0, "dropout rate (keys derived from seed and step)", range=FRACTION)
    tie_embeddings: bool = key(False, "the LM head reuses the token embedding")
    embed_scale: bool = key(False, "the token embeddings multiplied by sqrt(d_model) (Gemma)")
    rope_theta: float = key(10000.0, "RoPE base frequency (model.pos=rope)", range=POSITIVE)
    rope_scaling: Any = key(None, "RoPE frequency scaling (Llama 3.1's: factor, low/high_freq_factor, "
                            "original_max_position_embeddings); null = none")
    init_from: str | None = key(None, "hf:<dir>: start from a Hugging Face checkpoint (GPT-2, Llama): "
                                "its config.json sets the model's shape (docs/guide/huggingface.md)")
    hf_type: str | None = key(None, "the Hugging Face model_type dxrun.export writes, one "
                              "dxrun reads (set by model.init_from from its config.json, or by "
                              "a preset); null = the first family that computes the model")
    init_std: float = key(0.02, "standard deviation of the weights' normal initialisation",
                          range=POSITIVE)
    scan_layers: bool = key(True, "lax.scan over stacked layers (compile once); false = a loop")
    remat: str = key("none", "recompute activations in the backward pass: none, all of them "
                     "(full), all but the attention kernel's output and statistics "
                     "(keep_attention: splash), or all but the matmul outputs (dots)",
                     choices=("none", "full", "keep_attention", "dots"))
    attention: str = key("dot_product", "dot_product: the fastest kernel that runs here (splash "
                         "on a TPU, cuDNN's on an NVIDIA GPU, else XLA's); a kernel's name "
                         "forces it: splash, cudnn, xla, or reference (the plain einsum and "
                         "softmax)", choices=("dot_product", "reference", "splash", "cudnn",
                                              "xla"))
    objective: str = key("ar", "what the model learns: ar = the next token (causal attention) | "
                         "mdlm = masked diffusion (bidirectional; docs/guide/objectives.md)",
                         choices=("ar", "mdlm"))
    noise_schedule: str = key("loglinear", "model.objective=mdlm: the share of tokens kept at "
                              "time t, alpha(t) (docs/guide/objectives.md)",
                              choices=("loglinear", "cosine", "linear"))
    residual_dtype: str = key("compute", "the residual stream's dtype: compute (the "
                              "train.precision dtype) or fp32", choices=("compute", "fp32"))
    loss_chunk: int | None = key(
        None, "Cross-entropy and accuracy over chunks of this many positions of each sequence "
        "(the logits of one chunk alive at a time); 0 = off; null = auto: on when one "
        "micro-batch's fp32 logits would exceed 512 MiB per device (dxrun.model.losses).",
        range=NON_NEGATIVE)
    _target_: str | None = key(None, "Your own Flax NNX module (dxrun/model/user_model.py's protocol: "
                               "logical axes, __call__(tokens) -> logits); null = dxrun's")
    kwargs: dict[str, Any] = key(meaning="model._target_'s other arguments", factory=dict)
    moe: MoEConfig = section(MoEConfig, "mixture of experts in place of the dense MLP "
                             "(dxrun/model/moe.py); n_experts=0: none")


@dataclass
class DataConfig:
    name: str = key("markov", "the data source (the data=NAME option)",
                    choices=("markov", "text", "tokens"))
    batch_size: int | None = key(
        "${default_batch:${data.per_device_batch_size}}",
        "Global (all devices, one optimizer update); its default is 32, or null when a "
        "per-device batch is given (dxrun/plan/run_plan.py: how a set value is told from the default).",
        range=BATCH)
    per_device_batch_size: int | None = key(
        None, "Per data replica and micro-batch: global = this x dp x fsdp x train.grad_accum.",
        range=BATCH)
    seq_len: int | None = key(
        64, "null = the platform's default: model.max_seq_len on an accelerator, 64 on CPU "
        "(batch.default_seq_len); data=text and data=tokens default to it.", range=POSITIVE)
    # Grain's shuffle seed is data.seed + the stream (0 training, 1 held-out), below 2^32.
    seed: int = key(0, "the data's seed: the batch of step k depends only on (data.seed, k)",
                    range=Range(0, 2**32 - 1))
    vocab_size: int = key(64, "The vocabulary this data suggests; the small model presets follow "
                          "it (${data.vocab_size}).", range=POSITIVE)
    # The keys only some sources read default to null and get their values from the source's
    # preset, so a key set for another source stands out and is refused: data.path given without
    # data=tokens would otherwise train on markov data without a word.
    path: str | None = key(None, "text: file, dir or glob; tokens: dir with train.bin/val.bin",
                           sources=("text", "tokens"))
    tokenizer: str | None = key(None, "text: a local tokenizer.json; None = bytes (vocab 256)",
                                sources=("text",))
    dtype: str | None = key(None, "tokens: the token files' dtype (default: meta.json's)",
                            choices=("uint16", "uint32"), sources=("tokens",))
    val_fraction: float | None = key(None, "text: the tail of the corpus held out for eval",
                                     range=FRACTION, sources=("text",))
    workers: int | None = key(None, "text/tokens: Grain worker processes (0 = prefetch threads)",
                              range=NON_NEGATIVE, sources=("text", "tokens"))
    order: int | None = key(None, "markov: the next token depends on this many previous tokens",
                            range=POSITIVE, sources=("markov",))
    symbols: int | None = key(None, "markov: alphabet size; 0 = model.vocab_size",
                              range=NON_NEGATIVE, sources=("markov",))
    branching: int | None = key(None, "markov: successors per context (the chain is sparse)",
                                range=POSITIVE, sources=("markov",))
    _target_: str | None = key(None, "Your own batch source (dxrun/data/__init__.py's protocol: "
                               "batch(step, split)); null = data.name's")
    kwargs: dict[str, Any] = key(meaning="data._target_'s other arguments", factory=dict)


@dataclass
class OptimizerConfig:
    name: str = key("adamw", "the optimizer (the optimizer=NAME option)",
                    choices=("adamw", "sgd", "lion"))
    lr: float = key(1e-2, "peak learning rate (the model size's preset sets it for adamw)",
                    range=POSITIVE)
    weight_decay: float = key(0.1, "decoupled weight decay (skips norms, biases, embeddings "
                              "unless decay_all)", range=NON_NEGATIVE)
    decay_all: bool = key(False, "True also decays norms, biases and embeddings")
    b1: float = key(0.9, "first-moment decay (adamw, lion)", range=FRACTION)
    b2: float = key(0.95, "second-moment decay (adamw, lion)", range=FRACTION)
    eps: float = key(1e-8, "adamw's epsilon", range=POSITIVE)
    momentum: float = key(0.9, "SGD's momentum", range=FRACTION)
    schedule: str = key("warmup_cosine", "the lr schedule: constant, linear warmup then cosine, "
                        "or warmup-stable-decay", choices=("constant", "warmup_cosine", "wsd"))
    warmup_steps: int = key(20, "linear warmup steps to the peak lr", range=NON_NEGATIVE)
    min_lr_ratio: float = key(0.1, "final lr / peak lr for cosine and wsd",
                              range=Range(0, 1, hi_closed=True))
    decay_frac: float = key(0.2, "wsd: fraction of steps spent decaying",
                            range=Range(0, 1, lo_closed=False, hi_closed=True))
    clip_norm: float = key(1.0, "0 disables clipping", range=NON_NEGATIVE)
    lr_scaling: str = key("none", "scale optimizer.lr by global batch / base_batch_size (linear) "
                          "or its square root", choices=("none", "linear", "sqrt"))
    base_batch_size: int = key(32, "the batch size at which optimizer.lr is the lr",
                               range=POSITIVE)
    _target_: str | None = key(None, "Your own optimizer: an optax GradientTransformation factory "
                               "(e.g. optax.nadamw), called with learning_rate=<the schedule> "
                               "and optimizer.kwargs, clipped by clip_norm; null = name's")
    kwargs: dict[str, Any] = key(meaning="optimizer._target_'s other arguments", factory=dict)


@dataclass
class ProfileConfig:
    start: int = key(
        0, "Trace steps start..start+steps-1 with jax.profiler into <run dir>/profile/ (0 = off; "
        "the attempt's first step compiles, so a start on it moves to the next step).",
        range=NON_NEGATIVE)
    steps: int = key(3, "how many steps to trace", range=POSITIVE)


# What a run reports and watches: the logger section (where the reduced rows, the config, the
# plan and the summary go beside metrics.jsonl) and train.early_stop (a monitored metric
# that ends the run once it stops improving). BACKENDS: every backend ``logger.name`` (or
# ``logger.backends`` under ``logger=many``) can name.
BACKENDS = ("wandb", "tensorboard", "csv", "mlflow")


@dataclass
class LoggerConfig:
    name: str = key("wandb", "where metrics go beside metrics.jsonl (the logger=NAME option): "
                    "one backend, none, or many (logger.backends)",
                    choices=(*BACKENDS, "many", "none"))
    backends: list[str] = key(meaning="logger=many: the backends written at once, any of "
                              + ", ".join(BACKENDS), factory=lambda: ["csv", "tensorboard",
                                                                     "mlflow"])
    project: str = key("dxrun", "the W&B project; MLflow's experiment name")
    entity: str | None = key(None, "the W&B entity (user or team); null = W&B's default")
    mode: str | None = key(None, "W&B's mode; null = $WANDB_MODE, else offline",
                           choices=("offline", "online", "disabled"),
                           fix="or leave it null to follow $WANDB_MODE")
    group: str | None = key(None, "the W&B group; null = the sweep's (sweep-<date>_<time>) in a "
                            "multirun")
    job_type: str | None = key(None, "None: \"train\" for a single run, \"sweep\" for a "
                               "multirun job")
    tags: list[str] = key(meaning="extra W&B tags beside the model/parallelism/data/optimizer "
                          "choices", factory=list)
    mlflow_uri: str | None = key(None, "MLflow's tracking URI (a dir or file: URI, a file "
                                 "store; sqlite:///...; a server); null = the run dir's own file "
                                 "store, <run dir>/mlruns")


@dataclass
class EarlyStopConfig:
    monitor: str | None = key(None, "End the run once this logged metric (e.g. eval/loss) has "
                              "not improved for train.early_stop.patience of its rows; null = "
                              "off. The run ends with status ok and the reason in status.json.")
    mode: str = key("min", "min: lower is better; max: higher is better", choices=("min", "max"))
    patience: int = key(3, "rows of the monitored metric without improvement before the stop",
                        range=Range(1))
    min_delta: float = key(0.0, "an improvement is a change by more than this",
                           range=NON_NEGATIVE)


@dataclass
class TrainConfig:
    # 600: long enough for the default markov run to come close to its entropy floor.
    steps: int = key(600, "optimizer steps of the run", range=Range(0, INT32, lo_closed=False))
    log_every: int = key(50, "a metrics row every this many steps", range=POSITIVE)
    eval_every: int = key(100, "0 = no evaluation", range=NON_NEGATIVE)
    # jax.random.key keeps a seed's low 32 bits (no x64): 2^32 would be seed 0 again, and from
    # 2^63 it overflows a C long.
    seed: int = key(0, "the model's seed (initialisation, dropout)", range=Range(0, 2**32))
    precision: str = key(
        "auto", "Compute dtype: bf16 computes in bf16 with fp32 master weights; auto = bf16 on "
        "an accelerator (TPU, GPU), fp32 on CPU, decided in the run plan (plan.json).",
        choices=("auto", "fp32", "bf16"))
    grad_accum: int = key(
        1, "Micro-batches per optimizer step: data.batch_size is still the batch of one update, "
        "computed in grad_accum sequential pieces (less activation memory, same result).",
        range=POSITIVE)
    grad_reduce_dtype: str = key(
        "auto", "The dtype weight gradients are summed over the batch and all-reduced in under "
        "bf16 compute: fp32 (the fp32 master weights are cast at each use; Megatron's default) "
        "| bf16 (the whole tree cast first: half the gradient traffic, bf16-rounded gradients) "
        "| auto = bf16 on a TPU (faster there: BENCHMARKS.md, the defaults on the chip), else fp32.",
        choices=("auto", "fp32", "bf16"))
    objective: str | None = key(
        None, "The summary metric the run returns to a sweeper that minimises one number "
        "(Optuna), e.g. \"eval/loss\"; None returns the whole summary.")
    nan_policy: str = key("halt", "what a non-finite loss or gradient does",
                          choices=("halt", "skip"))
    profile: ProfileConfig = section(ProfileConfig, "tracing a few steps with jax.profiler")
    early_stop: EarlyStopConfig = section(EarlyStopConfig, "ending the run on a plateau")
    overfit_batches: int = key(0, "train on the first this many batches, over and over (debug="
                               "overfit: the loss must fall); 0 = off", range=NON_NEGATIVE)
    debug_nans: bool = key(False, "run the steps under jax.debug_nans: a NaN raises at once")


@dataclass
class CheckpointConfig:
    every: int | None = key(
        None, "Save every this many steps (and at the last step); 0 = never; null (the default) "
        "= by platform: 100 on CPU, on an accelerator a wall-clock cadence whose saves cost < 2% "
        "of the run (``checkpointing.cadence.save_cadence``).", range=NON_NEGATIVE)
    every_minutes: float = key(
        0.0, "Also save when this many minutes have passed since the last save (0 = off): "
        "bounds the work lost and, for a large state at fast steps, the time spent saving (plan "
        "mode shows it).", range=NON_NEGATIVE)
    keep: int = key(3, "the newest this many are kept", range=Range(1))
    dir: str | None = key(None, "None = <run dir>/checkpoints")
    resume: str = key("auto", "auto | none | <path to a checkpoints dir or one step dir>")
    allow_batch_change: bool = key(False, "resume with another data.batch_size")
    keep_best: str | None = key(None, "Also keep the checkpoint of the best value of this logged "
                                "metric (e.g. eval/loss), never rotated out; null = off")
    keep_best_mode: str = key("min", "keep_best's better: min or max", choices=("min", "max"))


@dataclass
class EvalConfig:
    batches: int = key(4, "held-out batches per evaluation (the same ones every time; "
                       "a corpus's at most its split's full batches, with one warning)",
                       range=POSITIVE)
    draws: int = key(2, "model.objective=mdlm: Monte-Carlo masking draws (t and mask) per held-out "
                     "batch, seeded by the batch's index: the same every evaluation",
                     range=POSITIVE)


@dataclass
class RunSection:
    mode: str = key("train", "plan: compile for the mesh, estimate, train nothing",
                    choices=("train", "plan"))
    wait_for_lock: Any = key(
        False, "A launch into a run dir a live run holds (its .hydra/lock): false = refuse "
        "(exit 2, naming the holder), true = wait until it ends, a number = wait at most this "
        "many seconds, then refuse.")


@dataclass
class PlanConfig:
    target: str | None = key(
        None, "The accelerator plan mode estimates for (dxrun/cost/targets.py: TARGETS); null = "
        "the devices this process sees.")
    write_gb_per_s: float = key(
        1.0, "The checkpoint write bandwidth (GB/s, all processes together) plan mode assumes "
        "when it costs a save (1: a shared filesystem from one client; local NVMe does "
        "several).", range=POSITIVE)
    devices: int = key(
        8, "The device count plan mode plans for: the GPUs (or TPU chips) of the run it "
        "estimates, simulated on CPU. In plan mode it takes the place of runtime.cpu_devices, "
        "which still sets the count when this is left at 8. Preset names are 8-device layouts: "
        "on another count the inferred axis grows (dp4_tp2 on 96: data 48 x tensor 2).",
        range=POSITIVE)


@dataclass
class RuntimeConfig:
    cpu_devices: int = key(8, "simulated CPU devices when no accelerator is present",
                           range=POSITIVE)
    skip_memory_check: bool = key(
        False, "The memory preflight: refuse a run whose compiled step will not fit (skip = run "
        "anyway); memory_gb overrides the memory the preflight believes this host/device has.")
    memory_gb: float | None = key(
        None, "the memory (GiB) the preflight believes this host/device has; null = what it "
        "reports", unranged="positive or null: check_runtime")
    reuse_freed_memory: str = key(
        "auto", "glibc's malloc on a CPU-only host (set before JAX starts): \"always\" = one "
        "arena, no mmap, freed blocks kept for the next step (no page faults for big "
        "temporaries, one lock for every thread); \"never\" = glibc's defaults; \"auto\" = "
        "always where a step's buffers per device are big enough to pay for the lock "
        "(dxrun/run/process.py: REUSE_FROM_BYTES).", choices=("auto", "always", "never"))
    compile_cache: str | None = key(
        "auto", "JAX's persistent compilation cache: \"auto\" = <user cache dir>/dxrun/jax, a "
        "path, or null.")
    peak_tflops: Any = key(
        None, "Peak TFLOP/s per device for perf/mfu: null = the built-in table by device kind, "
        "a number, or \"measure\" (a one-off matmul probe; meant for CPUs).")
    allow_cpu: bool = key(
        False, "Train on CPU on a host with an NVIDIA GPU (a JAX without its CUDA plugin): "
        "refused unless true (or JAX_PLATFORMS=cpu), since it is almost always a missing "
        "pip install -e '.[gpu]'.")


@dataclass
class RunConfig:
    model: ModelConfig = section(ModelConfig, "the transformer's shape and blocks")
    parallelism: ParallelismConfig = section(ParallelismConfig, "the device mesh")
    data: DataConfig = section(DataConfig, "the training and held-out batches")
    optimizer: OptimizerConfig = section(OptimizerConfig, "the update rule and lr schedule")
    logger: LoggerConfig = section(LoggerConfig, "where metrics go beside metrics.jsonl")
    train: TrainConfig = section(TrainConfig, "the loop: steps, cadences, precision, seeds")
    eval: EvalConfig = section(EvalConfig, "the held-out evaluation")
    runtime: RuntimeConfig = section(RuntimeConfig, "this host: devices, memory, caches")
    run: RunSection = section(RunSection, "what the command does")
    plan: PlanConfig = section(PlanConfig, "plan mode's estimate")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "saving and resuming")
    distributed: DistributedConfig = section(DistributedConfig, "joining a multi-process run")


# Every key of the schema and its field: the metadata ``key()`` put there is all a key's facts.
FIELDS: dict[str, dataclasses.Field] = {k: f for k, f, _ in walk(RunConfig)}
_TAKES_NULL = {k for k, _, hint in walk(RunConfig) if type(None) in typing.get_args(hint)}
# Every numeric key and the values it accepts, checked before anything runs.
RANGES: dict[str, Range] = {k: f.metadata["range"] for k, f in FIELDS.items()
                            if f.metadata["range"]}
# The numeric keys without a range: what they accept and where that is checked.
UNRANGED: dict[str, str] = {k: f.metadata["unranged"] for k, f in FIELDS.items()
                            if f.metadata["unranged"]}
# The string keys with a fixed list of values (plan.target's: dxrun/cost/targets.py).
_CHOICES: dict[str, tuple[str, ...]] = {k: f.metadata["choices"] for k, f in FIELDS.items()
                                        if isinstance(f.metadata["choices"], tuple)}
# The data keys only some sources read; any other source refuses them.
DATA_SOURCE_KEYS: dict[str, tuple[str, ...]] = {
    k.partition(".")[2]: f.metadata["sources"] for k, f in FIELDS.items() if f.metadata["sources"]}


def null_is_a_value(key: str) -> bool:
    """Whether null is a setting of its own for ``key`` (auto, the default, not given), rather
    than "the source does not read it" (DATA_SOURCE_KEYS) or "the other batch key decides"."""
    return (key in _TAKES_NULL and not FIELDS[key].metadata["sources"]
            and key not in (GLOBAL, PER_DEVICE))


# The ranged keys whose null means "not given" (a range applies only to a value).
NULLABLE = tuple(k for k in RANGES if null_is_a_value(k))


def head_dim_of(m: Any) -> int:
    """A model section's head width: ``model.head_dim``, or d_model / n_heads when null."""
    return getattr(m, "head_dim", None) or m.d_model // m.n_heads


def moe_layers(n_layers: int, moe: Any) -> tuple[bool, ...]:
    """Which layers are MoE layers: after ``first_dense``, the last of each ``every``."""
    if not moe.n_experts:
        return (False,) * n_layers
    return tuple(i >= moe.first_dense and (i - moe.first_dense + 1) % moe.every == 0
                 for i in range(n_layers))


def expert_d_ff(m: Any) -> int:
    """An expert's hidden width: ``model.moe.d_ff``, else ``model.d_ff``."""
    return m.moe.d_ff or m.d_ff


def choices_of(key: str) -> tuple[str, ...]:
    """The values a string key accepts (empty: any)."""
    choices = FIELDS[key].metadata["choices"] or ()
    return choices() if callable(choices) else choices


def ranges_markdown() -> str:
    """The table of accepted ranges (docs/guide/bad-input.md, the Reference)."""
    return ranges_table(RANGES)
