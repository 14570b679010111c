"""The accelerator memory model (dxrun/estimates/memory_model.py): held against XLA's memory analysis of
the compiled step in fp32, and what bf16, fused attention, remat, tp and accumulation change."""

from __future__ import annotations

import pytest

from dxrun.autotune import accelerator_memory, memory_rows, plan_report, plan_table
from dxrun.autotune.footprint import _shard_bytes
from dxrun.cost import TARGETS
from dxrun.estimates import (
    REMAT,
    MemoryEstimate,
    Shapes,
    estimate_memory,
    gather_bytes,
    layer_none,
    layer_saved,
    shapes,
    working_set,
)
from dxrun.experiment import Experiment, step_bytes
from dxrun.fit import NoData, first_that_fits
from dxrun.plan import make_plan

# Activations dominate: 4 layers of 256 tokens x 8 sequences at d_model 128 keep ~200 MB of
# activations without remat against 10 MB of parameters and optimizer state.
ACTIVATIONS = ["logger=none", "parallelism=dp1", "model=tiny", "model.d_model=128",
               "model.d_ff=512", "model.n_heads=4", "model.n_kv_heads=4", "model.n_layers=4",
               "model.max_seq_len=256", "data.seq_len=256", "data.batch_size=8",
               "data.vocab_size=64"]  # the shape the ratios below were measured at


def _model_bytes(exp: Experiment, kernel: str | None = None) -> MemoryEstimate:
    state = exp.abstract_state()
    x = shapes(exp.cfg.model, exp.plan, kernel or exp.attention_kernel)
    return estimate_memory(x, _shard_bytes(state.params),
                              _shard_bytes(state.opt_state),
                              _shard_bytes(exp.abstract_batch()), exp.plan.fsdp)


@pytest.mark.parametrize("remat", ["none", "dots", "full"])
def test_the_model_agrees_with_xla_in_fp32(cfg_factory, remat):
    """fp32 with the attention XLA runs on CPU: the model's per-device total within 10% of the
    compiled step's (arguments + outputs - donated + temporaries). Measured (model / XLA):
    none 0.92, dots 1.01, full 0.91. XLA:CPU's extra, read from its buffer assignment: a
    softmax row statistic broadcast to score size for a YNNPACK fusion, unfused elementwise
    temporaries, and gaps in its heap packing (dots: 26 MB of its 127 MB never live at once)."""
    exp = Experiment.build(cfg_factory(*ACTIVATIONS, f"model.remat={remat}"))
    assert exp.attention_kernel == "xla"
    xla = step_bytes(exp.analyse_step())  # never run: its memory analysis only
    model = _model_bytes(exp)
    assert model.activations_bytes + model.working_bytes > 0.6 * model.total_bytes
    assert model.total_bytes == pytest.approx(xla, rel=0.10), (remat, model, xla)


def _shapes(**kw) -> Shapes:
    """A GPT-2-small-like layer on one device: 8 x 1024 tokens, fp32, XLA attention."""
    base = dict(b=8, s=1024, h=768, f=3072, heads=12, kv_heads=12, head_dim=64, vocab=50304,
                n_layers=12, c=4, mlp="gelu", bias=True, remat="none", kernel="xla",
                residual=4)
    return Shapes(**base | kw)


def test_fused_attention_keeps_o_of_t_and_xla_keeps_the_scores():
    def scores(kernel: str, s: int) -> float:
        return layer_none(_shapes(c=2, kernel=kernel, s=s))["scores"]

    # XLA / reference: fp32 exponentials and bf16 probabilities, a*s^2*b each, and two fp32
    # row statistics, a*s*b each
    rows = 12 * 1024 * 8
    assert scores("xla", 1024) == (4 + 2) * 1024 * rows + 2 * 4 * rows == scores("reference", 1024)
    assert scores("xla", 2048) == (4 + 2) * 4 * 1024 * rows + 2 * 4 * 2 * rows
    # cuDNN: the fp32 log-sum-exp only, linear in s, and no dP / dS in the backward either
    assert scores("cudnn", 1024) == 4 * 12 * 1024 * 8
    assert scores("cudnn", 2048) == 2 * scores("cudnn", 1024)
    assert working_set(_shapes(c=2, kernel="cudnn")) < working_set(_shapes(c=2)) / 10


def test_the_target_decides_the_kernel(cfg_factory):
    """The memory model reads the run plan's kernel where the plan is for the target's
    platform, else the table's rule for that target (``autotune.footprint.kernel_on``)."""
    from dxrun.autotune import kernel_on
    from dxrun.plan import CAPABILITY, make_plan

    h100, a100, v5p = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "TPU v5"

    def kernel(device_kind, *overrides):
        cfg = cfg_factory("model=tiny", "logger=none", "parallelism=dp1", "data.seq_len=128",
                          *overrides)
        return kernel_on(cfg, make_plan(cfg, 1, "cpu"), device_kind)

    assert kernel(h100, "train.precision=bf16") == "cudnn"
    assert kernel(a100, "train.precision=bf16", "model.d_model=512", "model.n_heads=4") == "cudnn"
    assert kernel(a100, "train.precision=bf16", "model.d_model=1024",
                  "model.n_heads=4") == "xla"  # head dim 256 > 128 before Hopper
    assert kernel(h100, "train.precision=fp32") == "xla"  # cuDNN: half only
    assert kernel(v5p, "train.precision=bf16") == "splash"
    assert kernel(h100, "train.precision=bf16", "model.attention=reference") == "reference"
    assert kernel("cpu", "train.precision=bf16") == "xla"  # the plan's own
    assert set(CAPABILITY) == {t.device_kind for t in TARGETS.values()
                               if t.device_kind.startswith("NVIDIA")}


def test_remat_accumulation_and_tp_divide_what_they_divide():
    none, dots, full = (layer_saved(_shapes(remat=r)) for r in REMAT)
    assert none > dots > full == 4 * 8 * 1024 * 768  # full: the layer input only
    # bf16 with cuDNN: the weight matmuls' outputs (qkv, attention out, MLP up) beside the
    # layer input; the scores are the kernel's (test_bf16_dots_keeps_...: what JAX keeps)
    bf16_full = layer_saved(_shapes(c=2, remat="full", residual=2))
    assert layer_saved(_shapes(c=2, remat="dots", residual=2, kernel="cudnn")) == (
        bf16_full + 2 * 8 * 1024 * (3 * 768 + 768 + 3072))
    # grad_accum: one micro-batch of activations alive: a quarter of the batch, a quarter
    # (the qkv weight's join is not kept: layers.dense joins it again in the backward pass)
    assert layer_saved(_shapes(b=2)) == none / 4
    # tp: heads, d_ff and the scores split; the norms' and the stream's s*b*h do not
    tp2 = layer_none(_shapes(heads=6, kv_heads=6, f=1536))
    tp1 = layer_none(_shapes())
    assert tp2["scores"] == tp1["scores"] / 2 and tp2["mlp"] == tp1["mlp"] / 2
    assert tp2["norms"] == tp1["norms"]
    # FSDP gathers one layer's weights (in the compute dtype) twice; tp alone gathers nothing
    assert gather_bytes(_shapes(), 1) == 0
    assert gather_bytes(_shapes(c=2), 8) == 2 * 2 * 12 * 768**2


PRESETS = ["tiny", "tiny_llama", "small", "medium", "large", "xl"]


def test_bf16_needs_less_than_fp32_for_every_preset_and_target(cfg_factory):
    """Shapes only (no compile, nothing allocated): every preset at its context on fsdp8 with 8
    sequences per device. fp32 master weights, gradients and optimizer state are the same in
    both; the activations shrink (norm statistics and XLA's softmax stay fp32), and on NVIDIA
    targets cuDNN drops the scores."""
    accelerators = {k: t for k, t in TARGETS.items() if t.device_kind != "cpu"}
    for preset in PRESETS:
        seq = 128 if preset.startswith("tiny") else 1024
        need = {}
        for precision in ("fp32", "bf16"):
            cfg = cfg_factory(f"model={preset}", "parallelism=fsdp8", "logger=none",
                              f"data.seq_len={seq}", "data.batch_size=64",
                              f"train.precision={precision}")
            exp = Experiment.build(cfg, data=NoData())
            need[precision] = {k: accelerator_memory(exp, t)
                               for k, t in accelerators.items()}
        for k in accelerators:
            fp32, bf16 = need["fp32"][k], need["bf16"][k]
            assert bf16.total_bytes < fp32.total_bytes, (preset, k)
            assert bf16.params_bytes == fp32.params_bytes  # fp32 master weights either way
            assert bf16.opt_state_bytes == fp32.opt_state_bytes
            assert bf16.activations_bytes < fp32.activations_bytes, (preset, k)
            if "cudnn" in bf16.basis and seq == 1024:  # no 1024 x 1024 scores kept at all
                assert bf16.activations_bytes < fp32.activations_bytes / 2, (preset, k)


def test_plan_mode_on_an_accelerator_uses_the_model_and_keeps_xlas_figure(cfg_factory):
    # One device, one unscanned layer: a single compile serves the footprint and the cost.
    cfg = cfg_factory("model=tiny", "model.n_layers=1", "model.scan_layers=false",
                      "parallelism=dp1", "plan.target=h100", "logger=none",
                      "train.precision=bf16")
    exp = Experiment.build(cfg, data=NoData())
    report = plan_report(cfg, exp)
    m, t = report["memory_model"], report["target"]
    assert t["needs_from"] == "memory model"
    # plan.json: the H100 run's vocabulary rows (128-aligned) beside the CPU plan's own
    assert t["padded_vocab"] == m["padded_vocab"] == 128 > exp.plan.padded_vocab == 16
    assert t["needs_per_device_gb"] == pytest.approx(m["total_bytes"] / 1e9)
    assert m["xla_cpu_total_bytes"] == report["per_device"]["total_bytes"]  # kept beside it
    assert "attention cudnn" in m["basis"]  # bf16 on an H100: cuDNN's fused attention
    table = plan_table(report)
    assert "memory model: remat=none, attention cudnn, bf16 activations" in table
    assert "XLA:CPU" not in table  # bf16: the CPU program is not the GPU's; never compared
    # fp32 and more than 10% apart: the CPU compile's figure gets its own row
    fp32 = report | {"memory_model": m | {"precision": "fp32", "disagreement": 0.25}}
    rows = dict(memory_rows(fp32))
    assert rows["XLA:CPU"].endswith("(25% from the model)")
    assert "total" in rows["XLA:CPU"] and "memory model" in rows["per device"]
    close = report | {"memory_model": m | {"precision": "fp32", "disagreement": 0.05}}
    assert "XLA:CPU" not in dict(memory_rows(close))


def test_an_accelerator_plans_suggestion_is_sized_by_the_model(cfg_factory):
    """A plan that does not fit an H100 by the model's count: the candidates are sized by the
    model too (built from shapes, nothing compiled), and the first that fits is returned."""
    from omegaconf import OmegaConf

    h100 = TARGETS["h100"]

    def need(c) -> float:
        return accelerator_memory(Experiment.build(c, data=NoData()),
                                            h100).total_bytes

    cfg = cfg_factory("model=small", "parallelism=dp8", "data.seq_len=1024",
                      "data.batch_size=64", "logger=none")
    full = OmegaConf.merge(cfg, {"model": {"remat": "full"}})
    budget = (need(cfg) + need(full)) / 2
    fix = first_that_fits(cfg, budget, make_plan(cfg, 8, "cpu"),
                                    need=lambda e: accelerator_memory(e, h100).total_bytes)
    assert fix == ["model.remat=full"]
    assert need(cfg) > budget >= need(OmegaConf.merge(cfg, OmegaConf.from_dotlist(fix)))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dots_keeps_what_the_model_counts_in_either_precision(cfg_factory, capsys, precision):
    """JAX's own list of what a ``model.remat=dots`` layer keeps for its backward pass (beyond
    its arguments) is the memory model's count, bf16 included: its weight matmuls are
    ``dense``'s custom VJP, which ``checkpoint_dots`` cannot see, so they are kept by name
    (before that, a bf16 ``dots`` layer kept nothing and recomputed every matmul)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dxrun.model import transformer

    cfg = cfg_factory("model=tiny", "data.seq_len=16", f"train.precision={precision}")
    dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
    graphdef, params = nnx.split(transformer.Block(cfg.model, nnx.Rngs(0)))
    layer = jax.checkpoint(lambda p, x: nnx.merge(graphdef, p)(x, None, dtype),
                           policy=transformer.REMAT_POLICIES["dots"])
    x = jnp.ones((2, 16, cfg.model.d_model), dtype)
    jax.ad_checkpoint.print_saved_residuals(
        lambda p, x: layer(p, x).astype(jnp.float32).sum(), params, x)
    kept = [line for line in capsys.readouterr().out.splitlines() if "from the argument" not in line]
    if precision == "bf16":
        # q, k and v (three matmuls: no mesh splits the heads), attention out, MLP up
        assert sum("named 'dense'" in line for line in kept) == 5
    nbytes = _kept_bytes(kept)
    m = cfg.model
    x_shapes = _shapes(b=2, s=16, h=m.d_model, f=m.d_ff, heads=m.n_heads, kv_heads=m.n_kv_heads,
                       head_dim=m.d_model // m.n_heads, c=jnp.dtype(dtype).itemsize,
                       residual=jnp.dtype(dtype).itemsize, remat="dots")
    input_bytes = x_shapes.residual * x_shapes.tokens * x_shapes.h  # an argument here
    assert nbytes == layer_saved(x_shapes) - input_bytes


def _kept_bytes(kept: list[str]) -> int:
    """Bytes of JAX's saved-residual lines: "bf16[2,16,4,3,16] named 'dense' from ..."."""
    import numpy as np

    nbytes = 0
    for line in kept:
        kind, dims = line.split("[", 1)[0], line.split("[", 1)[1].split("]", 1)[0]
        nbytes += {"bf16": 2, "f32": 4}[kind] * int(np.prod([int(d) for d in dims.split(",")]))
    return nbytes


def test_keep_attention_keeps_splash_output_and_statistics_as_the_model_counts(cfg_factory,
                                                                               capsys):
    """``model.remat=keep_attention`` with splash (Pallas, interpreted here): what JAX says a
    layer keeps beyond its input is the kernel's output and fp32 log-sum-exp, which the memory
    model counts; under ``full`` the same layer keeps nothing but its input."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dxrun.model import transformer

    cfg = cfg_factory("model=tiny", "data.seq_len=128", "train.precision=bf16")
    graphdef, params = nnx.split(transformer.Block(cfg.model, nnx.Rngs(0), ("splash", True)))
    x = jnp.ones((2, 128, cfg.model.d_model), jnp.bfloat16)
    kept = {}
    for remat in ("keep_attention", "full"):
        layer = jax.checkpoint(lambda p, x: nnx.merge(graphdef, p)(x, None, jnp.bfloat16),
                               policy=transformer.REMAT_POLICIES[remat])
        jax.ad_checkpoint.print_saved_residuals(
            lambda p, x, layer=layer: layer(p, x).astype(jnp.float32).sum(), params, x)
        kept[remat] = [line for line in capsys.readouterr().out.splitlines()  # mask tables:
                       if "from the argument" not in line and "from a constant" not in line]
    assert kept["full"] == []
    assert len(kept["keep_attention"]) == 2
    assert all("'_splash_attention'" in line for line in kept["keep_attention"])  # its outputs
    m = cfg.model
    x_shapes = _shapes(b=2, s=128, h=m.d_model, f=m.d_ff, heads=m.n_heads, kv_heads=m.n_kv_heads,
                       head_dim=m.d_model // m.n_heads, c=2, residual=2, remat="keep_attention")
    input_bytes = x_shapes.residual * x_shapes.tokens * x_shapes.h  # an argument here
    assert _kept_bytes(kept["keep_attention"]) == layer_saved(x_shapes) - input_bytes


def test_a_gpu_target_counts_its_own_vocabulary_padding(cfg_factory):
    """The plan on this CPU keeps the 1000-row vocabulary (tp 1: no alignment); a run on an
    H100 pads it to 1024. The memory model counts the H100's rows (its tables' shards and the
    logits) and says which: 24 more rows of wte and lm_head (untied), 4 bytes each for the
    weights and for their gradient, 8 for AdamW's moments, on every device (dp8)."""
    cfg = cfg_factory("model=tiny", "parallelism=dp8", "data.vocab_size=1000",
                      "parallelism.shard_optimizer=false", "logger=none")
    exp = Experiment.build(cfg, data=NoData())
    assert exp.plan.padded_vocab == 1000
    h100 = accelerator_memory(exp, TARGETS["h100"])
    assert h100.padded_vocab == 1024
    rows = 24 * cfg.model.d_model * 2  # wte and lm_head
    cpu_state = exp.abstract_state()
    assert h100.params_bytes == _shard_bytes(cpu_state.params) + 4 * rows
    assert h100.opt_state_bytes == _shard_bytes(cpu_state.opt_state) + 8 * rows
    assert h100.head_bytes > _model_bytes(exp).head_bytes  # logits of 1024 columns, not 1000


def test_the_plan_says_where_dxruns_step_keeps_more_than_a_leaner_program(cfg_factory):
    """ZeRO-1 keeps the fp32 master weights whole, accumulation keeps two fp32 gradients, and
    remat=none keeps XLA's score tensors (not cuDNN's): each said in bytes (plan.json's
    memory_model.notes, the plan table's "memory note" rows). A GPT-2 or Llama block without
    remat on cuDNN keeps what a hand-written backward keeps, FSDP without accumulation and
    with remat says nothing."""
    h100 = TARGETS["h100"]

    def notes(*overrides: str, model: str = "tiny") -> list[str]:
        cfg = cfg_factory(f"model={model}", "logger=none", "data.batch_size=64", *overrides)
        return accelerator_memory(Experiment.build(cfg, data=NoData()), h100).notes

    zero, accum = notes("parallelism=dp8", "train.grad_accum=2", "model.remat=none",
                        "train.precision=bf16")
    assert zero.startswith("ZeRO-1 splits the optimizer state over 8 replicas")
    assert accum.startswith("train.grad_accum=2: the summed gradient and the micro-batch's")
    scores, = notes("parallelism=fsdp8", "model.remat=none", "train.precision=fp32")
    assert "x d_model bytes a token and layer, of them the attention's T x T" in scores
    assert "attention xla keeps the exponentials and probabilities" in scores
    assert notes("parallelism=fsdp8", "model.remat=none", "train.precision=bf16",
                 model="tiny_llama") == []
    assert notes("parallelism=fsdp8", "model.remat=dots") == []
    assert notes("parallelism=fsdp8", "model.remat=none", "train.precision=bf16") == []


def test_gemma_pieces_agree_with_xla_in_fp32(cfg_factory):
    """Gemma 2's block (four norms, a GeGLU MLP, rotary positions, its soft caps: the reference
    attention on CPU) counted as the model counts it, within 10% of XLA's compiled step."""
    exp = Experiment.build(cfg_factory(
        *ACTIVATIONS, "model.norm=rmsnorm", "model.bias=false", "model.pos=rope",
        "model.mlp=geglu", "model.norm_position=sandwich", "model.norm_plus_one=true",
        "model.attn_softcap=50", "model.logit_softcap=30"))
    assert exp.attention_kernel == "reference"
    xla = step_bytes(exp.analyse_step())
    model = _model_bytes(exp)
    print(f"gemma pieces: model / XLA {model.total_bytes / xla:.3f}")
    assert model.total_bytes == pytest.approx(xla, rel=0.10), (model, xla)
