"""model._target_ and data._target_: the example package's own model and data
(examples/custom_block) train on dp4_tp2 as on one device, resume as the uninterrupted run,
plan, evaluate and sample; a module with a parameter without logical axes is refused in one
line naming it, a batch of the wrong shape too."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import make_cfg
from flax import nnx
from omegaconf import OmegaConf

from dxrun.autotune import planned, run_plan
from dxrun.checkpointing import DATA_SOURCE, MODEL_SHAPE, changed
from dxrun.config.errors import ConfigError
from dxrun.data import TRAIN, checked_batch
from dxrun.experiment import Experiment
from dxrun.sample import OPTIONS, sample
from dxrun.tools.checkpoint import load
from dxrun.train import train

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RUN = ["model=tiny", "model._target_=custom_block.CustomLM", "+model.kwargs.d_model=32",
       "+model.kwargs.n_layers=2", "+model.kwargs.d_ff=64",
       "data._target_=custom_block.CountingData", "data.seq_len=16",
       "data.batch_size=8", "train.steps=4", "train.log_every=1", "train.eval_every=4",
       "eval.batches=1", "checkpoint.every=2", "logger=none"]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The example trained 4 steps on dp1 and on dp4_tp2, and on dp4_tp2 again killed after
    step 3 (checkpoint 2 committed) and resumed in place."""
    root = tmp_path_factory.mktemp("custom")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLES))  # the example package, not installed
        train(make_cfg(*RUN, "parallelism=dp1"), root / "dp1")
        train(make_cfg(*RUN, "parallelism=dp4_tp2"), root / "tp")
        with mp.context() as killed:
            killed.setenv("DXRUN_TEST_ERROR_AT_STEP", "3")
            with pytest.raises(RuntimeError, match="injected failure after step 3"):
                train(make_cfg(*RUN, "parallelism=dp4_tp2"), root / "resumed")
        train(make_cfg(*RUN, "parallelism=dp4_tp2"), root / "resumed")
        yield root


@pytest.mark.e2e  # the example's trainings (module fixture)
def test_the_example_trains_on_dp4_tp2_as_on_one_device(runs):
    dp1, tp = _rows(runs / "dp1"), _rows(runs / "tp")
    assert [r["step"] for r in tp] == [1, 2, 3, 4]
    for key in ("train/loss", "eval/loss"):
        a = [r[key] for r in dp1 if key in r]
        b = [r[key] for r in tp if key in r]
        assert len(a) == len(b) > 0
        np.testing.assert_allclose(b, a, rtol=1e-5)
    assert dp1[-1]["train/loss"] < dp1[0]["train/loss"]  # it learns
    plan = json.loads((runs / "tp" / "plan.json").read_text())
    assert (plan["dp"], plan["tp"]) == (4, 2)


@pytest.mark.e2e  # the example's trainings (module fixture)
def test_the_example_resumes_as_the_uninterrupted_run(runs):
    whole, resumed = _rows(runs / "tp"), _rows(runs / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # rows 3 on replayed from checkpoint 2
    for key in ("train/loss", "train/grad_norm", "eval/loss"):
        assert [r.get(key) for r in resumed] == [r.get(key) for r in whole]


def test_the_example_shards_by_its_logical_axes_and_plans(tmp_path):
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLES))
        cfg = make_cfg(*RUN, "parallelism=dp4_tp2", "run.mode=plan")
        exp = Experiment.build(cfg, data=None, with_data=False)
        # dxrun's rules: heads, mlp and vocab over `tensor`, embed over `fsdp` (of size 1 here)
        spec = {jax.tree_util.keystr(k): tuple(s.spec) for k, s in
                jax.tree_util.tree_leaves_with_path(exp.param_shardings)}
        assert spec["['blocks'][0]['wqkv']"] == ("fsdp", None, "tensor", None)
        assert spec["['blocks'][1]['w_down']"] == ("tensor", "fsdp")
        assert spec["['lm_head']"] == ("fsdp", "tensor")
        assert dict(exp.mesh.shape) == {"data": 4, "fsdp": 1, "expert": 1, "context": 1,
                                         "tensor": 2}
        report = run_plan(cfg, tmp_path, planned(cfg))
    n = report["n_params"]
    V, D, F = 16, 32, 64  # the vocabulary: the markov preset's data.vocab_size, which tiny follows
    assert n == 2 * V * D + 128 * D + D + 2 * (D + D * 3 * D + D * D + 2 * D * F)
    assert report["model_flops_per_step"] == 6 * n * 8 * 16  # from the parameter count
    assert report["model"].startswith("model._target_=custom_block.CustomLM: 21,600 parameters; "
                                      "FLOPs counted as 6 per parameter per token")
    assert report["loss_chunk"] == 0
    saved = json.loads((tmp_path / "plan.json").read_text())["plan_mode"]
    assert saved["n_params"] == n and saved["per_device"]["params_bytes"] > 0


@pytest.mark.e2e  # the example's trainings (module fixture)
def test_the_example_samples_greedily_by_recomputing_the_sequence(runs):
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLES))
        out = sample(runs / "dp1", {**OPTIONS, "n": 2, "max_new_tokens": 5}, [])
        loaded = load(runs / "dp1", ["parallelism=dp1"], key="path", with_data=False)
    tokens = out["tokens"]
    P = out["prompt_len"]
    assert out["step"] == 4 and tokens.shape == (2, P + 5)
    # greedy: each new token is the argmax of the model's logits at the position before it
    logits = nnx.merge(loaded.exp.graphdef, loaded.params)(jax.numpy.asarray(tokens))
    assert (np.asarray(logits).argmax(-1)[:, P - 1:-1] == tokens[:, P:]).all()


class Bare(nnx.Module):
    """A module whose second parameter has no logical axes (``head_axes``), ``short`` logits
    short of its vocabulary."""

    head_axes: tuple | None = None
    short = 0

    def __init__(self, vocab_size: int, rngs: nnx.Rngs):
        self.wte = nnx.Param(jax.numpy.zeros((vocab_size, 8)), axes=("vocab", "embed"))
        axes = {"axes": self.head_axes} if self.head_axes else {}
        self.head = nnx.Param(jax.numpy.zeros((8, vocab_size - self.short)), **axes)

    def __call__(self, tokens):
        return self.wte[...][tokens] @ self.head[...]


@pytest.mark.parametrize("module, says", [
    ("Bare", "parameter head has no logical axes; give it nnx.Param(..., axes=(one name per "
             "dimension)), names from batch, seq, stream_seq, layers, embed, expert, act_embed, heads, "
             "kv_heads, head_dim, mlp, vocab, norm, pos or None"),
    # Narrow used to train to ``loss nan`` and then advise a lower optimizer.lr.
    ("Narrow", "module(tokens) gives logits of shape [2, 8, 13] for tokens [2, 8], not [2, 8, "
               "model.vocab_size=16]; make its output layer vocab_size wide (the vocab_size it "
               "is built with)")])
def test_a_module_dxrun_cannot_lay_out_or_read_is_refused_in_one_line(module, says):
    """A parameter without logical axes, or logits not model.vocab_size wide: one line when the
    model is built (an abstract evaluation, nothing computed)."""
    cfg = make_cfg("model=tiny", f"model._target_={__name__}.{module}", "parallelism=dp1",
                   "data.seq_len=16", "data.batch_size=8")
    with pytest.raises(ConfigError) as e:
        Experiment.build(cfg, with_data=False)
    assert str(e.value) == f"model._target_={__name__}.{module}: {says}"


def test_a_model_target_that_cannot_be_imported_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^model._target_=nope.Model cannot be imported \(no "
                       r"module named nope\); give a dotted path on the PYTHONPATH"):
        Experiment.build(make_cfg("model._target_=nope.Model", "parallelism=dp1"),
                         with_data=False)


def test_a_batch_source_that_gives_no_global_batch_of_ids_is_refused_in_one_line():
    class Source:
        def __init__(self, rows):
            self.rows = rows

        def batch(self, step, split):
            return self.rows

    with pytest.raises(ConfigError) as e:
        checked_batch("mypkg.Data", Source(np.zeros((8, 16), np.int64)), 3, TRAIN, 8, 16, 64)
    assert str(e.value) == ("data._target_=mypkg.Data: batch(3, 'train') gave a int64 array of "
                            "shape (8, 16), not integers of shape (8, 17) (batch_size, "
                            "seq_len + 1)")
    with pytest.raises(ConfigError, match=r"has ids in \[0, 64\], outside model.vocab_size=64$"):
        checked_batch("mypkg.Data", Source(np.arange(8 * 17).reshape(8, 17) % 65), 0, TRAIN, 8, 16, 64)
    ok = checked_batch("mypkg.Data", Source(np.ones((8, 17), np.int64)), 0, TRAIN, 8, 16, 64)
    assert ok.dtype == np.int32 and ok.sum() == 8 * 17


def test_a_checkpoint_from_before_the_target_keys_is_one_of_dxruns_own_model_and_data():
    now = make_cfg("model=tiny")
    saved = OmegaConf.to_container(now, resolve=True)
    for section in ("model", "data"):
        del saved[section]["_target_"], saved[section]["kwargs"]
    assert changed(now, saved, MODEL_SHAPE + DATA_SOURCE) is None
    mine = make_cfg("model=tiny", "model._target_=mypkg.Model")
    assert changed(mine, saved, MODEL_SHAPE) == ("model._target_", "mypkg.Model", None)


class Narrow(Bare):
    """A module whose head is 3 logits short of its vocabulary."""

    head_axes = ("embed", None)
    short = 3
