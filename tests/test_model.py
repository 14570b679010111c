"""The model: vocabulary padding computes exactly what the unpadded model does; the layer scan,
remat and fused attention compute what their references do."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from omegaconf import OmegaConf

from dxrun.config.schema import ModelConfig
from dxrun.experiment import Experiment, loss_and_metrics
from dxrun.model.sharding import param_axes
from dxrun.model.transformer import Transformer, count_params, resize_vocab

V, VP = 65, 72  # vocab 65 padded for tp=8


def _model(tied: bool, padded: int | None):
    cfg = OmegaConf.structured(ModelConfig(vocab_size=V, tie_embeddings=tied))
    return nnx.split(Transformer(cfg, rngs=nnx.Rngs(3), padded_vocab=padded))


@pytest.mark.parametrize("tied", [False, True])
def test_padded_vocab_gets_no_probability_and_the_same_loss(tied):
    ref_def, ref_state = _model(tied, None)
    pad_def, pad_state = _model(tied, VP)
    ref, pad = nnx.to_pure_dict(ref_state), nnx.to_pure_dict(pad_state)
    # The real rows are initialised exactly as without padding; the padding rows are zero.
    np.testing.assert_array_equal(pad["wte"][:V], ref["wte"])
    np.testing.assert_array_equal(pad["wte"][V:], 0)
    if not tied:
        np.testing.assert_array_equal(pad["lm_head"][:, :V], ref["lm_head"])
        np.testing.assert_array_equal(pad["lm_head"][:, V:], 0)
    tokens = jax.random.randint(jax.random.key(0), (4, 17), 0, V)
    logits = nnx.merge(pad_def, pad_state)(tokens[:, :-1])
    assert logits.shape[-1] == VP
    np.testing.assert_array_equal(jax.nn.softmax(logits)[..., V:], 0)
    np.testing.assert_allclose(logits[..., :V], nnx.merge(ref_def, ref_state)(tokens[:, :-1]),
                               rtol=1e-6, atol=1e-6)
    grad_fn = jax.value_and_grad(loss_and_metrics, argnums=1, has_aux=True)
    (ref_loss, ref_m), _ = grad_fn(ref_def, ref, tokens, jnp.float32)
    (loss, m), grads = grad_fn(pad_def, pad, tokens, jnp.float32)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert m["train/accuracy"] == ref_m["train/accuracy"]
    # Padding rows get no gradient, so every optimizer leaves them at zero.
    np.testing.assert_array_equal(grads["wte"][V:], 0)
    if not tied:
        np.testing.assert_array_equal(grads["lm_head"][:, V:], 0)


def test_params_counted_and_resized_for_the_real_vocabulary():
    _, ref_state = _model(False, None)
    _, pad_state = _model(False, VP)
    axes = param_axes(pad_state)
    ref, pad = nnx.to_pure_dict(ref_state), nnx.to_pure_dict(pad_state)
    n_ref = count_params(ref)
    assert count_params(pad) == n_ref + 2 * (VP - V) * 64  # wte rows + lm_head columns
    assert count_params(pad, axes, V) == n_ref
    # tp=8's padding to tp=2's and back to none: the real rows survive, padding is zero.
    to66 = resize_vocab(jax.device_get(pad), axes, V, 66)
    assert to66["wte"].shape == (66, 64) and to66["lm_head"].shape == (64, 66)
    np.testing.assert_array_equal(to66["wte"][V:], 0)
    back = resize_vocab(to66, axes, V, V)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(a, b)


def _cheap_step(exp: Experiment) -> Experiment:
    """The step compiled with LLVM's optimisation off (``Experiment.analyse_step``'s options)
    and kept as the one that runs: the same HLO passes and buffer assignment (so the same
    memory analysis), only the CPU code generation is cheaper (about half of each compile).
    Every side of each comparison below compiles this way."""
    exp.step.compiled = exp.analyse_step()
    return exp


def _losses(cfg_factory, *overrides: str, steps: int = 3) -> list[float]:
    exp = _cheap_step(Experiment.build(cfg_factory(
        "model=tiny_llama", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=3",
        "parallelism=dp4_tp2", "logger=none", *overrides)))
    state, out = exp.init_state(), []
    for i in range(steps):
        state, m = exp.step(state, exp.batch(i))
        out.append(m["train/loss"])
    return [float(x) for x in jax.device_get(out)]


@pytest.mark.e2e  # five trainings whose losses are compared
def test_scan_remat_and_fused_attention_equal_the_reference(cfg_factory):
    """Same parameters (the stacked layout is shared), same losses, one change at a time from
    the reference (a Python loop over the layers, einsum attention): the layer scan alone,
    jax.nn.dot_product_attention alone (native GQA: 4 heads over 2 kv heads), and each remat
    policy (full on the defaults, which scan and fuse; dots on the loop)."""
    ref = _losses(cfg_factory, "model.scan_layers=false", "model.attention=reference")
    assert ref[-1] < ref[0]
    for variant in (["model.scan_layers=true", "model.attention=reference"],
                    ["model.scan_layers=false", "model.attention=dot_product"],
                    ["model.remat=full"], ["model.remat=dots", "model.scan_layers=false"]):
        got = _losses(cfg_factory, *variant)
        np.testing.assert_allclose(got, ref, rtol=1e-5, err_msg=" ".join(variant))


def _step_text_and_memory(cfg_factory, *overrides: str) -> tuple[str, Any]:
    exp = Experiment.build(cfg_factory("model=tiny", "parallelism=dp8", "logger=none",
                                       "data.seq_len=128", *overrides))
    compiled = exp.analyse_step()  # never run: its HLO and memory analysis only
    return compiled.as_text(), compiled.memory_analysis()


def test_scan_compiles_one_layer_whatever_the_depth(cfg_factory):
    shallow, _ = _step_text_and_memory(cfg_factory, "model.n_layers=2")
    deep, _ = _step_text_and_memory(cfg_factory, "model.n_layers=12")
    loop, _ = _step_text_and_memory(cfg_factory, "model.n_layers=12", "model.scan_layers=false")
    # The layers' scan is the while loop of 12 iterations (XLA:CPU may expand a scatter, the
    # embedding's gradient, into a loop of its own: one iteration per token).
    layer_loop = '"known_trip_count":{"n":"12"}'
    assert layer_loop in deep and layer_loop not in loop
    assert len(deep) < 1.2 * len(shallow)  # the program does not grow with depth...
    assert len(loop) > 3 * len(shallow)  # ...as the unrolled loop's does


def test_remat_trades_memory_for_recompute(cfg_factory):
    _, none = _step_text_and_memory(cfg_factory, "model.n_layers=8")
    _, full = _step_text_and_memory(cfg_factory, "model.n_layers=8", "model.remat=full")
    # Full remat keeps only each layer's input for the backward pass.
    assert full.temp_size_in_bytes < 0.7 * none.temp_size_in_bytes


def test_grad_accumulation_equals_the_whole_batch(cfg_factory):
    """train.grad_accum=4 (micro-batches under lax.scan) gives the update of the whole batch
    at once, on a mesh that shards the batch, and holds fewer activations."""
    def run(accum: int) -> tuple[list[float], dict, float]:
        exp = _cheap_step(Experiment.build(cfg_factory(
            "model=tiny", "parallelism=dp2_fsdp2_tp2", "model.n_heads=8", "model.n_kv_heads=8",
            "logger=none", f"train.grad_accum={accum}")))
        state, losses = exp.init_state(), []
        for i in range(3):
            state, m = exp.step(state, exp.batch(i))
            losses.append(float(m["train/loss"]))
        temp = exp.step.compiled.memory_analysis().temp_size_in_bytes
        return losses, jax.device_get(state.params), temp

    whole, p1, temp1 = run(1)
    micro, p4, temp4 = run(4)
    np.testing.assert_allclose(micro, whole, rtol=1e-6)
    # The key bias's exact gradient is zero (softmax ignores a shift shared by all keys), so its
    # value is Adam's normalised rounding noise, which depends on the summation order: it is
    # held to stay noise, every other parameter to be the same update.
    for (path, a), b in zip(jax.tree.leaves_with_path(p4), jax.tree.leaves(p1), strict=True):
        name = jax.tree_util.keystr(path)
        if name.endswith("['bk']"):
            assert np.abs(a).max() < 1e-6 and np.abs(b).max() < 1e-6, name
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-7, err_msg=name)
    assert temp4 < temp1


@pytest.mark.e2e  # three trainings whose losses are compared
def test_fp32_residual_stream_under_bf16(cfg_factory):
    """model.residual_dtype=fp32 under bf16 compute: closer to the fp32 run than plain bf16."""
    fp32 = _losses(cfg_factory, "train.precision=fp32")
    bf16 = _losses(cfg_factory, "train.precision=bf16")
    wide = _losses(cfg_factory, "train.precision=bf16", "model.residual_dtype=fp32")
    assert wide != bf16 and wide != fp32
    np.testing.assert_allclose(wide, fp32, rtol=2e-2)
    # The claim itself: over the steps, nearer fp32 than plain bf16 (here 1.6e-4 against 2.1e-4
    # summed; one step alone may go either way).
    def distance(losses: list[float]) -> float:
        return float(np.abs(np.subtract(losses, fp32)).sum())

    assert distance(wide) < distance(bf16), (wide, bf16, fp32)


PIECES = {"head_dim": ["model.head_dim=24"], "qkv_bias": ["model.qkv_bias=true"],
          "qk_norm_head": ["model.qk_norm=head", "model.head_dim=8"],
          "qk_norm_proj": ["model.qk_norm=proj"], "window": ["model.sliding_window=5"],
          "post_norm": ["model.norm_position=post"],
          # Gemma's: GeGLU, 1 + w norms, embeddings times sqrt(d); exact GELU
          "gemma": ["model=tiny_llama", "model.mlp=geglu", "model.norm_plus_one=true",
                    "model.embed_scale=true"],
          "gelu_exact": ["model=tiny_llama", "model.mlp=geglu", "model.gelu=exact"],
          # Gemma 2's: four norms a block, soft caps that bite, a score scale of its own
          "sandwich_softcaps": ["model=tiny_llama", "model.norm_position=sandwich",
                                "model.attn_softcap=1", "model.logit_softcap=2",
                                "model.attn_scalar=24"],
          # windowed and full layers alternating, the windowed on their own rope base
          "alternating": ["model=tiny_llama", "model.n_layers=4", "model.sliding_window=5",
                          "model.global_every=2", "model.rope_local_theta=100"]}


@pytest.mark.e2e  # a training on each of three meshes per piece: the whole suite's, not the inner loop's
@pytest.mark.parametrize("piece", PIECES)
def test_the_attention_pieces_train_alike_on_every_mesh(cfg_factory, piece):
    """Each of model.head_dim (24 with 4 heads of d_model 64), qkv_bias, qk_norm (per head
    and across heads), sliding_window, norm_position=post and Gemma's pieces (GeGLU, 1 + w
    norms, scaled embeddings, sandwich norms, soft caps, a score scale, alternating layers):
    three steps on dp4_tp2 (the plan's kernel, heads split) and on dp2_fsdp2_tp2 give the
    losses of one device's written-out reference attention.
    (Each piece against transformers' own model: tests/test_hf_families.py.)"""
    ref = _losses(cfg_factory, *PIECES[piece], "parallelism=dp1", "model.attention=reference")
    assert ref[-1] < ref[0]
    for mesh in (["parallelism=dp4_tp2"], ["parallelism=dp2_fsdp2_tp2"]):
        got = _losses(cfg_factory, *PIECES[piece], *mesh)
        np.testing.assert_allclose(got, ref, rtol=2e-5, err_msg=f"{piece} {mesh}")


def test_qk_norm_is_rmsnorm_over_a_head_or_all_heads():
    """QKNorm against the formula written in numpy: per head (Qwen3) and over all heads
    together (OLMo 2), the scale applied after."""
    from dxrun.model.attention import QKNorm

    x = np.random.default_rng(0).standard_normal((2, 3, 4, 8)).astype(np.float32)
    for kind, over, shape in (("head", (-1,), (8,)), ("proj", (-2, -1), (4, 8))):
        norm = QKNorm(kind, 4, "heads", 8, 1e-6)
        scale = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        norm.scale[...] = jnp.asarray(scale)
        want = x / np.sqrt((x * x).mean(over, keepdims=True) + 1e-6) * scale
        np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), want, rtol=1e-5, atol=1e-6)
