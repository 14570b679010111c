"""model.loss_chunk: the loss and accuracy over chunks of the sequence equal the whole-logits
ones (values and gradients), the compiled step communicates what the unchunked one does, and
its temporaries shrink."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_cfg

from dxrun.autotune import collective_traffic
from dxrun.config.errors import ConfigError
from dxrun.estimates import head_bytes, shapes
from dxrun.experiment import Experiment, loss_and_metrics
from dxrun.fit import NoData
from dxrun.model.objectives import objective_of
from dxrun.model.sharding import in_mesh_context
from dxrun.plan import AUTO_ON_BYTES, resolve_loss_chunk

CHUNK = 8  # of data.seq_len=32: four chunks


@pytest.mark.parametrize("overrides, dtype, tol", [
    (["parallelism=dp2", "model.tie_embeddings=true"], jnp.float32, 1e-6),
    # vocab 65 padded to 66 under tp2: the padding column masked in every chunk
    (["parallelism=dp4_tp2", "data.vocab_size=65"], jnp.float32, 1e-6),
    # the batch over data and fsdp: the output weight's gradient kept per replica (4 of them)
    pytest.param(["parallelism=dp2_fsdp2_tp2", "model.tie_embeddings=true"], jnp.float32, 1e-6,
                 marks=pytest.mark.e2e),  # the full suite's, not the inner loop's
    # bf16 compute: the gradients agree up to a bf16 rounding of a logit's gradient (a
    # different order of fp32 operations may round one the other way)
    pytest.param(["parallelism=dp2_fsdp2_tp2", "model.tie_embeddings=true"], jnp.bfloat16, 1e-3,
                 marks=pytest.mark.e2e),  # the full suite's, not the inner loop's
    # masked diffusion (model/objectives.py): each position weighted by its row's w(t) where masked,
    # the accuracy over the masked ones; its [MASK] row padded to 18 under tp2
    pytest.param(["parallelism=dp4_tp2", "model.objective=mdlm"], jnp.float32, 1e-6,
                 marks=pytest.mark.e2e),  # the full suite's, not the inner loop's
    # the vocabulary on one shard (the gradients made in the forward), padded (65 + [MASK] to
    # 72) and weighted
    (["parallelism=dp2", "parallelism.vocab_align=8", "data.vocab_size=65",
      "model.objective=mdlm"], jnp.float32, 1e-6),
    # soft-capped logits (Gemma 2's model.logit_softcap), a cap low enough to bite, padded
    (["parallelism=dp4_tp2", "data.vocab_size=65", "model.logit_softcap=0.5"], jnp.float32,
     1e-6),
], ids=["dp2_tied", "dp4_tp2_padded", "dp2_fsdp2_tp2_tied", "dp2_fsdp2_tp2_tied_bf16",
        "dp4_tp2_mdlm", "dp2_padded_mdlm", "dp4_tp2_softcap"])
def test_chunked_equals_whole(overrides, dtype, tol):
    cfg = make_cfg("model=tiny", "logger=none", "train.precision=fp32", "data.seq_len=32",
                   *overrides)
    exp = Experiment.build(cfg)
    params, tokens = exp.seeded.params(), exp.batch(0)
    objective = objective_of(cfg.model, seed=0)  # None: the next token

    def both(p):
        batch = tokens if objective is None else objective.train_batch(jnp.int32(3), tokens)

        def grad(chunk):
            return jax.value_and_grad(
                lambda q: loss_and_metrics(exp.graphdef, q, batch, dtype, loss_chunk=chunk,
                                           objective=objective),
                has_aux=True)(p)
        return grad(0), grad(CHUNK)

    with in_mesh_context(exp.mesh, exp.plan.rules):
        whole, chunked = jax.device_get(jax.jit(both)(params))
    (loss0, m0), g0 = whole
    (loss1, m1), g1 = chunked
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    assert m1["train/accuracy"] == m0["train/accuracy"]
    # Relative to the largest gradient: some are 0 up to rounding (the key bias's: softmax
    # ignores a shift of every score), and rounding noise is all either computes there.
    scale = max(np.abs(b).max() for b in jax.tree.leaves(g0))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * scale)


def _analysed(chunk: int, *overrides: str) -> Experiment:
    """A tiny model's step (16 x 32 tokens) with ``model.loss_chunk=chunk``, compiled for its
    analyses (never run, unless a test runs it) and kept as the one that runs."""
    exp = Experiment.build(make_cfg("model=tiny", "logger=none", "data.seq_len=32",
                                    "data.batch_size=16", f"model.loss_chunk={chunk}",
                                    *overrides))
    exp.step.compiled = exp.analyse_step()
    return exp


def test_chunked_step_reduces_the_output_gradient_once():
    """On dp8 the chunked step's collectives are the unchunked step's, kind by kind, count and
    bytes per step, whatever the chunk count (4 and 8 chunks), with tied embeddings (the
    embedding's and the head's gradient of one table). Before, the output weight's gradient
    was all-reduced over the replicas inside the chunk loop, once per chunk."""
    def traffic(chunk: int) -> dict:
        exp = _analysed(chunk, "parallelism=dp8", "model.tie_embeddings=true")
        return collective_traffic(exp.step.compiled.as_text(), 8)

    whole = traffic(0)
    assert whole["all-reduce"]["count"] > 0  # the gradients' reduction is there to compare
    assert traffic(8) == whole  # 4 chunks
    assert traffic(4) == whole  # 8 chunks


def test_chunked_step_under_tp_reduces_once():
    """On dp4_tp2, the vocabulary padded (65 to 66): the chunked step's collectives are the
    unchunked step's, kind by kind, count and bytes per step, for 4 and 8 chunks. Each chunk's
    logits are split over ``tensor``: before, each chunk's softmax statistics and input
    gradient were all-reduced over it once per chunk (39 all-reduces against 22)."""
    def traffic(chunk: int) -> dict:
        exp = _analysed(chunk, "parallelism=dp4_tp2", "data.vocab_size=65")
        return collective_traffic(exp.step.compiled.as_text(), 8)

    whole = traffic(0)
    assert whole["all-reduce"]["count"] > 0 and whole["all-gather"]["count"] > 0
    assert traffic(8) == whole  # 4 chunks
    assert traffic(4) == whole  # 8 chunks


@pytest.mark.e2e  # two trainings, chunked and unchunked
def test_chunked_step_trains_as_the_unchunked_under_accumulation():
    """dp2_fsdp2_tp2 with train.grad_accum=2 (the chunks' replicas over fsdp inside the
    micro-batches' own vmap over data, their shards over tensor), tied embeddings, SGD (the
    update is the gradient): two steps chunked give the unchunked step's losses and
    parameters, with the unchunked step's collectives (kind, count and bytes per step)."""
    def run(chunk: int) -> tuple[list[float], dict, dict]:
        exp = _analysed(chunk, "parallelism=dp2_fsdp2_tp2", "model.tie_embeddings=true",
                        "train.grad_accum=2", "optimizer=sgd", "train.precision=fp32")
        state, losses = exp.init_state(), []
        for i in range(2):
            state, m = exp.step(state, exp.batch(i))
            losses.append(m["train/loss"])
        traffic = collective_traffic(exp.step.compiled.as_text(), 8)
        return [float(x) for x in jax.device_get(losses)], jax.device_get(state.params), traffic

    (loss0, p0, traffic0), (loss1, p1, traffic1) = run(0), run(8)
    assert traffic1 == traffic0
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    assert loss0[1] != loss0[0]  # the first update changed the parameters
    for (path, a), b in zip(jax.tree.leaves_with_path(p1), jax.tree.leaves(p0), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def _temp_bytes(chunk: int) -> float:
    cfg = make_cfg("model=tiny", "logger=none", "parallelism=dp1", "data.seq_len=64",
                   "data.batch_size=8", "model.vocab_size=4096", "data.symbols=64",
                   f"model.loss_chunk={chunk}")
    return Experiment.build(cfg, data=NoData()).compile_step().memory_analysis().temp_size_in_bytes


def test_temporaries_shrink_with_chunking():
    """Compile-only: the whole batch's fp32 logits (8 x 64 x 4096 x 4 = 8 MiB) and their
    gradient are gone from the temporaries; one chunk's (1 MiB) remains."""
    logits = 8 * 64 * 4096 * 4
    whole, chunked = _temp_bytes(0), _temp_bytes(8)
    assert chunked < whole - logits, (whole, chunked)


def test_auto_chunks_only_large_logits():
    # model=small, seq 1024, vocab 50304, 8 rows per device: 1.6 GB of fp32 logits
    assert resolve_loss_chunk(None, 8, 1024, 50304) == 128  # 8 x 128 x 50304 x 4 = 206 MB
    assert resolve_loss_chunk(None, 1, 64, 64) == 0  # tiny: whole
    rows = AUTO_ON_BYTES // (1024 * 50304 * 4)
    assert resolve_loss_chunk(None, rows, 1024, 50304) == 0  # at the threshold: whole
    assert resolve_loss_chunk(0, 8, 1024, 50304) == 0  # off
    assert resolve_loss_chunk(256, 1, 1024, 64) == 256  # as given
    assert resolve_loss_chunk(1024, 1, 1024, 64) == 0  # the whole sequence: unchunked
    cfg = make_cfg("model=small", "logger=none", "parallelism=dp8", "data.seq_len=1024",
                   "data.batch_size=64")
    from dxrun.plan import make_plan
    assert make_plan(cfg, 8).loss_chunk == 128


def test_a_chunk_that_does_not_divide_is_refused():
    with pytest.raises(ConfigError, match=r"model.loss_chunk=48 does not divide "
                                          r"data.seq_len=64; pick a divisor \(e.g. 32\)"):
        from dxrun.checks import validate

        validate(make_cfg("model=tiny", "logger=none", "model.loss_chunk=48"))


def test_memory_model_counts_one_chunk():
    cfg = make_cfg("model=small", "logger=none", "parallelism=dp8", "data.seq_len=1024",
                   "data.batch_size=64")
    from dxrun.plan import make_plan
    plan = make_plan(cfg, 8)
    chunked = shapes(cfg.model, plan, "xla")
    cfg.model.loss_chunk = 0
    whole = shapes(cfg.model, make_plan(cfg, 8), "xla")  # the plan decides it
    V = whole.vocab
    assert chunked.loss_chunk == 128 and whole.loss_chunk == 0
    drop = head_bytes(whole) - head_bytes(chunked)
    assert drop == 2 * 4 * 8 * (1024 - 128) * V
