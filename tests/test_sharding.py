"""Every mesh trains the same model to the same numbers; TP moves no weights; shards are 1/k."""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_cfg
from flax import nnx

from dxrun.autotune import collective_lines, collectives
from dxrun.experiment import Experiment
from dxrun.model import sharding
from dxrun.model.transformer import Block
from dxrun.plan import make_plan

MESHES = ["dp1", "dp8", "tp2", "tp8", "dp4_tp2", "dp2_tp4", "fsdp8", "dp2_fsdp2_tp2",
          "dp2_cp4", "cp2_tp4", "fsdp2_cp2_tp2"]
# The presets with an expert axis split an MoE model's experts (a dense model refuses them):
# tests/test_moe.py runs them.
PRESETS = sorted(p.stem for p in (Path(__file__).parents[1] / "conf" / "parallelism").glob("*.yaml")
                 if not re.search(r"(^|_)ep[0-9]", p.stem))
# n_heads=8 so tp8 splits whole heads; Llama-style gets biases too so both are tested non-zero,
# and grouped-query heads (16 over 8: tp8 still splits whole kv heads).
MODELS = {
    "gpt2": ["model=tiny", "model.n_heads=8", "model.n_kv_heads=8"],
    "llama": ["model=tiny_llama", "model.n_heads=16", "model.n_kv_heads=8", "model.bias=true"],
    # An odd vocabulary: padded to 66 on tp2 and 72 on tp8, masked out of the loss.
    "gpt2_vocab65": ["model=tiny", "model.n_heads=8", "model.n_kv_heads=8",
                     "data.vocab_size=65"],
    # Masked diffusion (dxrun/model/objectives.py): attention both ways, each step's masks drawn for the
    # global batch, then split into micro-batches (2: the noised batch goes through the
    # accumulation scan); the [MASK] row makes the table 65 rows, padded to 66 on tp2.
    "mdlm": ["model=tiny", "model.n_heads=8", "model.n_kv_heads=8", "model.objective=mdlm",
             "train.grad_accum=2"],
}
# The odd vocabulary only changes the meshes that split the vocab axis: two different paddings.
# Masked diffusion: data and tensor parallel alone (the 65-row table padded to 72 on tp8), and
# meshes mixing the axes (the batch over data x fsdp, the weights over fsdp x tensor); at most 4
# replicas, so that each holds the 2 micro-batches of 8 examples.
MESHES_OF = {"gpt2_vocab65": ["dp1", "tp2", "tp8"],
             "mdlm": ["dp1", "dp4", "tp8", "dp4_tp2", "dp2_fsdp2_tp2"]}
STEPS = 12  # the 12th step's loss is the loss after 11 updates (2 of warmup, 9 at the peak lr)
# 8 x 16 tokens a step (not 32 x 64): the step's cost is in the compile, which the batch barely
# changes; every mesh's axes (8 ways at most) still divide the batch and the sequence.
# 64 output classes for the markov data's 16 symbols: 5 updates visibly lower the loss (the
# unused ids pushed down), so "it trains" below is a real check, and the vocab axis splits 8 ways.
BASE = ["logger=none", "train.precision=fp32", "optimizer.warmup_steps=2", "data.batch_size=8",
        "data.seq_len=16", "data.vocab_size=64"]


def _host_params(exp: Experiment, seed: int) -> dict:
    """The seeded init with every bias (and norm offset) replaced by non-zero values."""
    params = jax.device_get(exp.seeded.params())
    rng = np.random.default_rng(seed)

    def perturb(path, x):
        name = str(getattr(path[-1], "key", ""))
        if name.startswith("b") or name == "bias":
            return rng.normal(0.0, 0.5, x.shape).astype(x.dtype)
        return x
    return jax.tree_util.tree_map_with_path(perturb, params)


def _n_nonzero_biases(params: dict) -> int:
    return sum(1 for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
               if str(getattr(p[-1], "key", "")).startswith("b") and np.abs(x).min() > 0)


def _compile_cheaply(exp: Experiment) -> str:
    """The step compiled with LLVM's optimisation off (``Experiment.analyse_step``'s options)
    and kept as the step that runs: XLA's partitioner and HLO passes, which decide what each
    mesh computes and what it communicates, run as ever; only CPU code generation is cheaper
    (about half of each compile). Its HLO text."""
    exp.step.compiled = exp.analyse_step()
    return exp.step.compiled.as_text()


def _losses(exp: Experiment, params) -> list[float]:
    state = exp.init_state(params)
    out = []
    for i in range(STEPS):
        state, m = exp.step(state, exp.batch(i))
        out.append(m["train/loss"])
    return [float(x) for x in jax.device_get(out)]


@contextlib.contextmanager
def _real_compiles():
    """The session's persistent compilation cache off (conftest.py): a program it handed back
    would skip XLA's partitioner, and with it the warning a test looks for."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    cc.reset_cache()  # JAX reads jax_enable_compilation_cache once per reset
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        cc.reset_cache()


@contextlib.contextmanager
def _stderr_into(path: Path):
    """File descriptor 2 (where XLA's C++ warnings go) written to ``path`` meanwhile: a module
    fixture cannot use capfd."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "wb") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


@pytest.fixture(scope="module")
def preset_runs(tmp_path_factory) -> dict:
    """Every parallelism preset's step for GPT-2's and Llama's block, each compiled once (really:
    cache off) and cheaply (``_compile_cheaply``); on the MESHES the same program then trains
    STEPS steps from one shared dp1 init. Shared by the mesh-equivalence and the no-preset-
    replicates tests, which used to compile every one of these programs each."""
    stderr = tmp_path_factory.mktemp("xla_stderr") / "stderr.txt"
    out: dict = {"compiled": {}, "losses": {}, "n_bias": {}}
    with _real_compiles(), _stderr_into(stderr):
        for block, overrides in MODELS.items():
            if block in MESHES_OF:
                continue  # the odd vocabulary: its own test (three meshes, no presets)
            ref_cfg = make_cfg(*overrides, *BASE, "parallelism=dp1")
            params = _host_params(Experiment.build(ref_cfg), seed=1)
            out["n_bias"][block] = _n_nonzero_biases(params)
            # The reference first, then the other MESHES (each is run: a preset with the same
            # mesh, parallelism=auto and dp as dp8 here, is one program and compiles no more).
            for preset in [*MESHES, *(p for p in PRESETS if p not in MESHES)]:
                exp = Experiment.build(make_cfg(*overrides, *BASE, f"parallelism={preset}"))
                mesh = tuple(exp.mesh.shape.items())
                splits = exp.plan.fsdp > 1 or exp.plan.tp > 1 or exp.plan.cp > 1
                if (block, mesh) in out["compiled"]:  # parallelism=auto and dp are dp8 here
                    continue
                if preset not in MESHES and block == "llama" and not splits:
                    continue  # pure data parallelism: weights whole, activations split on batch only
                text = _compile_cheaply(exp)
                out["compiled"][block, mesh] = (preset, splits, collectives(text))
                if preset in MESHES:
                    out["losses"][block, preset] = _losses(exp, params)
    out["stderr"] = stderr.read_text(errors="replace")
    return out


@pytest.mark.e2e  # ~26 compiles and 25 six-step runs: minutes on 2 cores
@pytest.mark.parametrize("model", sorted(MODELS))
def test_loss_equal_on_every_mesh(cfg_factory, request, model):
    if model in MESHES_OF:
        base = [*MODELS[model], *BASE]
        ref_cfg = cfg_factory(*base, "parallelism=dp1")
        params = _host_params(Experiment.build(ref_cfg), seed=1)
        n_bias = _n_nonzero_biases(params)
        losses = {}
        for mesh in MESHES_OF[model]:
            exp = Experiment.build(cfg_factory(*base, f"parallelism={mesh}"))
            _compile_cheaply(exp)
            losses[mesh] = _losses(exp, params)
    else:
        runs = request.getfixturevalue("preset_runs")
        n_bias = runs["n_bias"][model]
        losses = {mesh: runs["losses"][model, mesh] for mesh in MESHES}
    assert n_bias >= 4  # the biases really are non-zero
    ref = losses["dp1"]
    assert ref[-1] < ref[0]  # it trains
    for mesh in MESHES_OF.get(model, MESHES)[1:]:
        np.testing.assert_allclose(losses[mesh], ref, rtol=1e-5, err_msg=f"{model} on {mesh}")


@pytest.mark.parametrize("mesh, k", [("tp8", 8), ("fsdp8", 8), ("tp2", 2)])
def test_param_bytes_per_device_are_total_over_k(cfg_factory, mesh, k):
    cfg = cfg_factory("model=tiny", "model.n_heads=8", "model.n_kv_heads=8", "logger=none",
                      f"parallelism={mesh}")
    exp = Experiment.build(cfg)
    params = exp.seeded.params()
    total = replicated = 0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        nbytes = x.size * x.dtype.itemsize
        total += nbytes
        n_shards = len({str(s.index) for s in x.addressable_shards})
        name = str(path[-1].key)  # blocks' params are stacked: [n_layers, ...]
        is_bias = x.ndim == 1 or name == "scale" or name.startswith("b")
        if is_bias or (mesh.startswith("tp") and path[0].key == "wpe"):
            # Replicated by design: norms and biases of d_model (the row-parallel ones are added
            # after the reduction); Megatron also keeps the position table whole.
            replicated += nbytes * (n_shards == 1)
        else:
            assert n_shards == k, f"{jax.tree_util.keystr(path)} split {n_shards} ways, not {k}"
    expected = (total - replicated) / k + replicated
    per_device = sharding.bytes_per_device(params)
    assert len(per_device) == k
    for dev, nbytes in per_device.items():
        assert nbytes == pytest.approx(expected, rel=1e-9), (dev, nbytes, expected)
    assert replicated < 0.1 * total


def _compiled_tp_layer(cfg_factory, tp: int) -> str:
    cfg = cfg_factory("model=tiny", "model.n_heads=8", "model.n_kv_heads=8",
                      f"parallelism=tp{tp}")
    plan = make_plan(cfg, 8)
    mesh = sharding.mesh_from_plan(plan)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Block(cfg.model, nnx.Rngs(0))))
    shardings = sharding.param_shardings(sharding.param_axes(state), mesh, plan.rules)

    def fwd_bwd(params, x_BxLxD):
        loss = lambda p, x: (nnx.merge(graphdef, p)(x) ** 2).mean()
        return jax.value_and_grad(loss, argnums=(0, 1))(params, x_BxLxD)

    x = jax.ShapeDtypeStruct((8, 16, cfg.model.d_model), jnp.float32)
    with sharding.in_mesh_context(mesh, plan.rules):
        lowered = jax.jit(fwd_bwd, in_shardings=(shardings, sharding.batch_sharding(mesh))).lower(
            nnx.to_pure_dict(state), x)
    return lowered.compile().as_text()


@pytest.mark.parametrize("tp", [2, 8])
def test_tp_layer_moves_no_weights(cfg_factory, tp):
    found = collectives(_compiled_tp_layer(cfg_factory, tp))
    print(f"collectives per TP layer (tp={tp}, forward+backward): {dict(found)}")
    # Megatron: one all-reduce after each row-parallel projection (attention out, MLP down)
    # forward, and one per column-parallel input gradient backward; nothing else.
    assert found == {"all-reduce": 4}


def test_sequence_parallel_layer_equals_tp_and_moves_no_weight(cfg_factory):
    """One GPT-2 layer's loss and gradients under tp4 with parallelism.sequence_parallel (the
    norms and the residual split along the sequence over `tensor`) and without: the same to
    1e-5 in fp32. Megatron's collectives: per pass, the norms' outputs all-gathered along the
    sequence (XLA:CPU writes the reduce-scatters as all-reduces and slices); no weight moves."""
    cfg = cfg_factory("model=tiny", "model.n_heads=8", "model.n_kv_heads=8", "parallelism=tp4",
                      "data.seq_len=16")
    model = Block(cfg.model, nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    x = jax.random.normal(jax.random.key(1), (8, 16, cfg.model.d_model))
    out, found = {}, {}
    for sp in (False, True):
        plan = make_plan(cfg_factory("model=tiny", "model.n_heads=8", "model.n_kv_heads=8",
                                     "parallelism=tp4", "data.seq_len=16",
                                     f"parallelism.sequence_parallel={str(sp).lower()}"), 8)
        assert plan.sequence_parallel == sp and plan.n_devices == 4
        mesh = sharding.mesh_from_plan(plan)
        shardings = sharding.param_shardings(sharding.param_axes(state), mesh, plan.rules)

        def fwd_bwd(params, x_BxLxD):
            loss = lambda p, x: (nnx.merge(graphdef, p)(x) ** 2).mean()
            return jax.value_and_grad(loss, argnums=(0, 1))(params, x_BxLxD)

        with sharding.in_mesh_context(mesh, plan.rules):
            jitted = jax.jit(fwd_bwd, in_shardings=(shardings, sharding.batch_sharding(mesh)))
            text = jitted.lower(params, x).compile().as_text()
            found[sp] = collectives(text)
            out[sp] = jax.device_get(jitted(params, x))
    for got, want in zip(jax.tree.leaves(out[True]), jax.tree.leaves(out[False]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert found[False] == {"all-reduce": 4}  # test_tp_layer_moves_no_weights
    # forward: ln1's and ln2's outputs; backward: the two blocks' output gradients
    assert found[True]["all-gather"] == 4 and not found[True]["collective-permute"]
    for line in collective_lines(text, "all-gather"):  # each the size of the activation x
        dims = line.split("[", 1)[1].split("]", 1)[0].split(",")
        assert math.prod(int(d) for d in dims) == x.size, line
    assert found[True]["all-reduce"] == 5  # Megatron's 4, and the norms' weights' gradients


@pytest.mark.e2e  # two trainings per model
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_sequence_parallel_trains_like_plain_tp(cfg_factory, model):
    """The whole model over STEPS steps from one init (biases non-zero), dp2_tp4 with
    parallelism.sequence_parallel=true and without: the same losses to 1e-5 in fp32."""
    base = [*MODELS[model], *BASE, "parallelism=dp2_tp4"]
    params = _host_params(Experiment.build(cfg_factory(*base)), seed=1)
    losses = {}
    for sp in ("false", "true"):
        exp = Experiment.build(cfg_factory(*base, f"parallelism.sequence_parallel={sp}"))
        assert exp.plan.sequence_parallel == (sp == "true")
        losses[sp] = _losses(exp, params)
    assert losses["false"][-1] < losses["false"][0]  # it trains
    np.testing.assert_allclose(losses["true"], losses["false"], rtol=1e-5)


def test_full_tp_step_gathers_no_weight(cfg_factory):
    """No all-gather in the compiled tp8 step is the size of a weight: neither a whole stacked
    weight ([n_layers, ...], before the layer scan) nor one layer's slice of it (inside the
    scan's body, where XLA gathers it as [1, D, H, E] or reshaped, so sizes, not shapes)."""
    # 24 x 40 tokens: every activation's size is a multiple of 15, every weight's a power of 2.
    cfg = cfg_factory("model=tiny", "model.n_heads=8", "model.n_kv_heads=8", "parallelism=tp8",
                      "logger=none", "data.batch_size=24", "data.seq_len=40")
    exp = Experiment.build(cfg)
    text = exp.analyse_step().as_text()  # shapes only: nothing is allocated
    assert " while(" in text  # the layers scan: their weights are used in the loop's body
    found = collectives(text)
    assert found["collective-permute"] == 0
    weight_sizes = set()
    for path, x in jax.tree_util.tree_flatten_with_path(exp.abstract_state().params)[0]:
        weight_sizes.add(x.size)
        if path[0].key == "blocks":  # stacked: [n_layers, ...]; the scan body sees x.shape[1:]
            weight_sizes.add(x.size // x.shape[0])
    assert {64 * 8 * 8, 256 * 64} <= weight_sizes  # one layer's wq, one layer's w_down
    gathers = collective_lines(text, "all-gather")
    assert gathers  # the argmax over the vocabulary's shards
    for line in gathers:
        dims = line.split("[", 1)[1].split("]", 1)[0].split(",")
        assert math.prod(int(d) for d in dims if d) not in weight_sizes, line


def test_low_level_api_on_the_same_rules():
    mesh = sharding.make_tp_mesh(2)
    assert dict(mesh.shape) == {"data": 4, "fsdp": 1, "expert": 1, "context": 1, "tensor": 2}
    assert sharding.num_devices() == 8
    batch = sharding.shard_batch(np.arange(16 * 3).reshape(16, 3), mesh)
    assert batch.sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp", "expert"))
    assert {s.data.shape for s in batch.addressable_shards} == {(4, 3)}
    rep = sharding.replicate(np.ones(5), mesh)
    assert all(s.data.shape == (5,) for s in rep.addressable_shards)

    from omegaconf import OmegaConf

    from dxrun.config.schema import ModelConfig
    from dxrun.model.transformer import Transformer

    model = Transformer(OmegaConf.structured(ModelConfig(n_heads=4)), rngs=nnx.Rngs(0))
    before = np.asarray(model.blocks.attn.wq[...])  # stacked: [n_layers, D, H, E]
    sharding.apply_tp_sharding(model, mesh)
    wq = model.blocks.attn.wq[...]
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    np.testing.assert_array_equal(np.asarray(wq), before)
    with sharding.in_mesh_context(mesh):
        logits = jax.jit(lambda m, t: m(t))(model, jnp.zeros((8, 4), jnp.int32))
    assert logits.shape == (8, 4, 64)
    with pytest.raises(ValueError):
        sharding.make_mesh(dp=3, tp=2)


@pytest.mark.e2e  # reads preset_runs (every preset compiled: minutes on 2 cores)
def test_no_preset_makes_xla_replicate_activations(preset_runs):
    """XLA warns (on stderr, from C++) when it cannot reshard efficiently and replicates a whole
    tensor instead; the token-embedding gather under FSDP+TP used to. No preset may: GPT-2's
    block on every one, Llama's (RoPE, grouped-query heads, SwiGLU, RMSNorm) on every one that
    splits weights (under pure data parallelism nothing is resharded). The programs are
    ``preset_runs``': compiled once for this test and the mesh-equivalence one."""
    assert len(PRESETS) >= 12
    compiled = preset_runs["compiled"]
    for (block, _), (preset, _, found) in compiled.items():
        assert found["collective-permute"] == 0, (preset, block)
    assert sum(1 for block, _ in compiled if block == "gpt2") == len(PRESETS) - 2
    assert sum(1 for (block, _), (_, splits, _) in compiled.items()
               if block == "llama" and splits) == 10  # Llama's on the 10 that split weights or
    # sequences (the context axis)
    assert "Involuntary full rematerialization" not in preset_runs["stderr"]


def test_the_seeded_init_is_the_same_bits_on_every_layout(cfg_factory):
    """``SeededInit.params`` draws every weight spread over the 8 devices, then lays it out: dp8's
    replicated weights, tp8's and dp2_fsdp2_tp2's split ones hold the same bits."""
    def init(mesh: str) -> tuple[dict, dict]:
        exp = Experiment.build(cfg_factory("model=tiny", "model.n_heads=8", "model.n_kv_heads=8",
                                           "logger=none", f"parallelism={mesh}"))
        params = exp.seeded.params()
        assert jax.tree.map(lambda x: x.sharding, params) == exp.param_shardings  # its layout
        return jax.device_get(params), sharding.spread_shardings(params, exp.mesh,
                                                            exp.param_shardings)
    ref, spread = init("dp8")
    # On dp8 every weight whose axis 8 divides was drawn split 8 ways, not whole on each device.
    n_split = sum(math.prod(s.shard_shape(x.shape)) * 8 == x.size
                  for x, s in zip(jax.tree.leaves(ref), jax.tree.leaves(spread), strict=True))
    assert n_split >= len(jax.tree.leaves(ref)) // 2
    for mesh in ("tp8", "dp2_fsdp2_tp2", "dp1"):
        params, _ = init(mesh)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=mesh)


def test_the_seeded_init_is_laid_out_without_replicating_it_first(tmp_path, cfg_factory):
    """``spread_shardings`` adds the mesh axes a weight is replicated over to its own split
    (the same bits on every layout, above): laying it out is a gather within groups, and XLA's
    partitioner never replicates a weight whole first. Spread along another axis, dp2_tp4
    printed nine "Involuntary full rematerialization" warnings for tiny's weights."""
    stderr = tmp_path / "stderr.txt"
    with _real_compiles(), _stderr_into(stderr):
        for mesh in ("dp2_tp4", "dp2_fsdp2_tp2", "dp4_tp2"):
            exp = Experiment.build(cfg_factory("model=tiny", "logger=none",
                                               f"parallelism={mesh}"))
            shapes = jax.eval_shape(exp.seeded.fn())
            spread = sharding.spread_shardings(shapes, exp.mesh, exp.param_shardings)
            for x, s in zip(jax.tree.leaves(shapes), jax.tree.leaves(spread), strict=True):
                # over every device where an axis of the weight takes all of them
                assert math.prod(s.shard_shape(x.shape)) * 8 == x.size or s in jax.tree.leaves(
                    exp.param_shardings), (mesh, x.shape, s)
            n_spread = sum(math.prod(s.shard_shape(x.shape)) * 8 == x.size
                           for x, s in zip(jax.tree.leaves(shapes), jax.tree.leaves(spread),
                                           strict=True))
            assert n_spread >= len(jax.tree.leaves(shapes)) // 2, mesh
            jax.block_until_ready(exp.seeded.params())
    text = stderr.read_text(errors="replace")
    assert "Involuntary full rematerialization" not in text, text[-2000:]

