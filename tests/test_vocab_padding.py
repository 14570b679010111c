"""Checkpoints restored where the vocabulary is padded differently
(``dxrun/checkpointing/store.py``): vocab 65 saved with 65 rows (tp1) read onto tp2 (66
rows), a tp2 checkpoint onto one device, and a GPU's 128-row padding
(``parallelism.vocab_align=128``) onto one device, by ``dxrun.evaluate``, ``dxrun.sample`` and a
resume: the same numbers as on the saved layout."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import make_cfg, write_tokens

from dxrun.checkpointing import padding_differs
from dxrun.evaluate import evaluate_checkpoint
from dxrun.sample import OPTIONS, sample
from dxrun.tools.checkpoint import load

RUN = ["data=tokens", "data.seq_len=8", "data.batch_size=8", "train.eval_every=0",
       "checkpoint.every=2", "logger=none", "eval.batches=4", "train.log_every=1"]
LAYOUTS = {  # name: (the overrides it trains with, its rows)
    "tp1": (["parallelism=dp1"], 65),
    "tp2": (["parallelism=tp2"], 66),
    "gpu": (["parallelism=dp1", "parallelism.vocab_align=128"], 128),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from dxrun.train import train

    root = tmp_path_factory.mktemp("padding")
    corpus = write_tokens(root / "corpus", val_batches=4)
    out = {"corpus": corpus}
    for name, (overrides, _) in LAYOUTS.items():
        train(make_cfg(*RUN, f"data.path={corpus}", "train.steps=2", *overrides), root / name)
        out[name] = root / name
    return out


def test_only_one_padding_difference_is_repadded():
    a = {("params", "wte"): (65, 64), ("params", "wpe"): (128, 64), ("mu", "wte"): (65, 64)}
    assert not padding_differs(a, a)
    assert padding_differs(a, {**a, ("params", "wte"): (66, 64), ("mu", "wte"): (66, 64)})
    # Two different paddings, a change in two axes, another tree: read strictly (refused).
    assert not padding_differs(a, {**a, ("params", "wte"): (66, 64), ("mu", "wte"): (128, 64)})
    assert not padding_differs(a, {**a, ("params", "wte"): (66, 32)})
    assert not padding_differs(a, {("params", "wte"): (66, 64)})


def _loss(loaded) -> float:
    """Held-out loss of the first 4 batches, by training's evaluation."""
    from dxrun.data import EVAL
    from dxrun.train import evaluate

    exp = loaded.exp
    return evaluate(exp, loaded.params, [exp.batch(k, EVAL) for k in range(4)])["eval/loss"]


def _greedy(loaded, prompt: np.ndarray, new: int) -> np.ndarray:
    from dxrun.tools.decode import Sampling, make_generate

    exp, m = loaded.exp, loaded.cfg.model
    gen = make_generate(exp.graphdef, exp.mesh, exp.plan.rules, exp.param_shardings,
                        prompt.shape[1], new, Sampling(), m.n_layers, m.n_kv_heads,
                        m.d_model // m.n_heads)
    return np.asarray(gen(loaded.params, prompt))


@pytest.mark.e2e
@pytest.mark.parametrize("saved, read_on", [
    ("tp1", ["parallelism=tp2", "parallelism.n_devices=2"]),  # 65 -> 66
    ("tp2", ["parallelism=dp1"]),  # 66 -> 65
    ("gpu", ["parallelism=dp1"]),  # 128 -> 65: a GPU run on a laptop
])
def test_restore_onto_another_padding(runs, saved, read_on):
    own, rows = LAYOUTS[saved]
    mine, other = load(runs[saved], own, key="path"), load(runs[saved], read_on, key="path")
    now = other.exp.padded_vocab
    assert (mine.params["wte"].shape[0], now) == (rows, 66 if "tp2" in read_on[0] else 65)
    for name, axis in (("wte", 0), ("lm_head", 1)):
        have, got = np.asarray(mine.params[name]), np.asarray(other.params[name])
        # The real rows are the checkpoint's; padding rows are zero.
        np.testing.assert_array_equal(np.take(got, range(65), axis),
                                      np.take(have, range(65), axis))
        assert got.shape[axis] == now and not np.take(got, range(65, now), axis).any()
    want_loss = _loss(mine)
    assert abs(_loss(other) - want_loss) <= 1e-5 * want_loss
    if saved == "gpu":  # the tools themselves: a GPU run evaluated and sampled on one device
        rec = evaluate_checkpoint(runs[saved], read_on)
        assert rec["step"] == 2 and rec["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1}
        assert abs(rec["eval/loss"] - want_loss) <= 1e-5 * want_loss
        assert json.loads((runs[saved] / "eval.json").read_text())[-1] == rec
        options = {**OPTIONS, "prompt": "3 7 11", "max_new_tokens": 12}
        tokens = sample(runs[saved], options, [])["tokens"]  # one device: 65 rows
        # Greedy: the ids the 128-row model picks, never a padding id.
        np.testing.assert_array_equal(tokens, _greedy(mine, np.array([[3, 7, 11]]), 12))
        assert tokens.shape == (1, 15) and tokens.max() < 65


@pytest.mark.e2e
def test_resume_onto_another_padding(runs, tmp_path):
    from dxrun.train import train

    def resume(name: str, *overrides: str) -> list[dict]:
        train(make_cfg(*RUN, f"data.path={runs['corpus']}", "train.steps=4",
                       f"checkpoint.resume={runs['gpu']}", *overrides), tmp_path / name)
        return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text()
                .splitlines()]

    # The 128-row checkpoint continued on its own layout and on one device's 65 rows.
    same = resume("same", "parallelism=dp1", "parallelism.vocab_align=128")
    other = resume("other", "parallelism=dp1")
    assert [r["step"] for r in other] == [r["step"] for r in same] == [3, 4]
    for a, b in zip(same, other, strict=True):
        assert abs(a["train/loss"] - b["train/loss"]) <= 1e-5 * a["train/loss"]
    plan = json.loads((tmp_path / "other" / "plan.json").read_text())
    assert (plan["vocab_size"], plan["padded_vocab"]) == (65, 65)
