"""Masked diffusion (``model.objective=mdlm``, dxrun/model/objectives.py): the bound against a hand
computation and its schedules' weights against their derivatives; the forward process; a trained
markov run's held-out bound above the window's entropy and near it, the same on every mesh; the
reverse-process sampler on markov and text runs; plan mode's FLOPs; the refusals. (Its mesh
equivalence is tests/test_sharding.py's, its bitwise resume test_resume.py's dropout test's.)"""

from __future__ import annotations

import json
import logging
import math
import re

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_cfg, write_corpus

from dxrun.checks import validation
from dxrun.config.errors import ConfigError
from dxrun.cost import attention_flops, flops_per_token, is_causal, step_flops
from dxrun.evaluate import evaluate_checkpoint
from dxrun.model.objectives import SCHEDULES, MaskedDiffusion, elbo, mask_rate, weight
from dxrun.sample import OPTIONS, sample
from dxrun.train import train


def _log_softmax(x: np.ndarray) -> np.ndarray:
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_elbo_matches_a_hand_computation():
    """A vocabulary of 3, two rows of 3 tokens: only the masked positions count, each weighted
    by its row's w(t) (loglinear 1/t, cosine (pi/2) / tan(pi t / 4), linear 7 / (e^{7t} - 1)),
    and the sum is divided by all 6 tokens."""
    logits = np.array([[[2.0, 0.5, -1.0], [0.1, 0.2, 0.3], [1.0, 1.0, 3.0]],
                       [[-2.0, 0.0, 2.0], [0.5, 0.5, 0.5], [3.0, -1.0, 0.0]]], np.float32)
    x0 = np.array([[0, 2, 1], [2, 1, 0]], np.int32)
    masked = np.array([[True, False, True], [False, True, True]])
    t = np.array([0.25, 0.5], np.float32)
    hand_w = {"loglinear": [4.0, 2.0],
              "cosine": [(math.pi / 2) / math.tan(math.pi / 16), (math.pi / 2) / math.tan(math.pi / 8)],
              "linear": [7 / math.expm1(1.75), 7 / math.expm1(3.5)]}
    logp = _log_softmax(logits.astype(np.float64))
    # row 0: positions 0 and 2 masked (targets 0, 1); row 1: positions 1 and 2 (targets 1, 0)
    nll = [-(logp[0, 0, 0] + logp[0, 2, 1]), -(logp[1, 1, 1] + logp[1, 2, 0])]
    for schedule in SCHEDULES:
        w = np.asarray(weight(schedule, jnp.asarray(t)))
        np.testing.assert_allclose(w, hand_w[schedule], rtol=1e-6, err_msg=schedule)
        loss, accuracy = elbo(jnp.asarray(logits), jnp.asarray(x0), jnp.asarray(masked),
                              jnp.asarray(w))
        hand = (hand_w[schedule][0] * nll[0] + hand_w[schedule][1] * nll[1]) / 6
        np.testing.assert_allclose(float(loss), hand, rtol=1e-6, err_msg=schedule)
        # argmax right at (0,0) and (1,2); wrong at (0,2) (argmax 2) and (1,1) (a tie: id 0)
        assert float(accuracy) == 0.5


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_weight_is_its_schedules_rate(schedule):
    """w(t) = -alpha'(t) / (1 - alpha(t)) = m'(t) / m(t) for the masking probability m = 1 -
    alpha, by central differences; m runs from 0 at t = 0 to 1 at t = 1."""
    t, h = np.array([0.05, 0.3, 0.5, 0.9]), 1e-3

    def m(x: np.ndarray) -> np.ndarray:
        return np.asarray(mask_rate(schedule, jnp.asarray(x, jnp.float32)), np.float64)

    rate = (m(t + h) - m(t - h)) / (2 * h) / m(t)
    np.testing.assert_allclose(np.asarray(weight(schedule, jnp.asarray(t))), rate, rtol=2e-3)
    assert m(np.array([0.0, 1.0])).tolist() == pytest.approx([0.0, 1.0], abs=1e-6)


def test_forward_process_masks_at_the_schedules_rate():
    """t low-discrepancy over the rows (one per 1/B stratum of [T_MIN, 1]); each row masked at
    m(t); the window is the AR inputs; [MASK] is the vocabulary's size; the draw depends only
    on the key."""
    obj = MaskedDiffusion(mask_id=16, schedule="cosine")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 16, (64, 513)), jnp.int32)
    batch = obj.train_batch(jnp.int32(7), tokens)
    np.testing.assert_array_equal(batch.x0_BxL, tokens[:, :-1])
    masked = np.asarray(batch.xt_BxL == 16)
    assert (np.asarray(batch.xt_BxL)[~masked] == np.asarray(tokens[:, :-1])[~masked]).all()
    # t recovered from w (cosine: w = (pi/2) / tan(pi t / 4)): one per stratum of the batch
    t = np.sort(4 / np.pi * np.arctan((np.pi / 2) / np.asarray(batch.w_B)))
    assert np.all(np.diff(t) == pytest.approx(1 / 64 * (1 - 1e-3), abs=1e-5))
    share = masked.mean(1)[np.argsort(4 / np.pi * np.arctan((np.pi / 2) / np.asarray(batch.w_B)))]
    np.testing.assert_allclose(share, 1 - np.cos(np.pi / 2 * t), atol=0.08)  # 512 draws a row
    again = obj.train_batch(jnp.int32(7), tokens)
    np.testing.assert_array_equal(again.xt_BxL, batch.xt_BxL)
    assert float(obj.masked_share(batch)) == pytest.approx(masked.mean())


@pytest.mark.parametrize("overrides, line", [
    (["model._target_=flax.nnx.Linear"], "model.objective=mdlm trains dxrun's own model "
     "(attention both ways, a [MASK] row), not model._target_=flax.nnx.Linear; drop one of them"),
    (["model.noise_schedule=sqrt"], "model.noise_schedule='sqrt' is not one of loglinear, "
                                    "cosine, linear"),
], ids=["user_model", "schedule"])
def test_what_mdlm_cannot_do_is_refused_in_one_line(overrides, line):
    with pytest.raises(ConfigError) as err:
        validation.validate(make_cfg("model.objective=mdlm", *overrides))
    assert str(err.value).startswith(line), str(err.value)


def test_plan_flops_are_the_backbone_without_the_causal_half():
    """Masked diffusion's step counts AR's matmuls and AR's full attention square (MFU's
    numerator is the same), but no kernel skips a causal half: its "causal" attention is the
    full square, and a fused kernel computes twice AR's."""
    ar, mdlm = make_cfg("model=tiny").model, make_cfg("model=tiny", "model.objective=mdlm").model
    assert is_causal(ar) and not is_causal(mdlm)
    assert flops_per_token(mdlm, 110_336, 64) == flops_per_token(ar, 110_336, 64)
    for fused in (False, True):
        a = step_flops(ar, 2048, 64, 64, fused_attention=fused)
        m = step_flops(mdlm, 2048, 64, 64, fused_attention=fused)
        same = ("block_matmuls", "attention_full", "output_layer", "model", "recompute")
        assert {k: m[k] for k in same} == {k: a[k] for k in same}
        assert m["attention_causal"] == a["attention_full"] == 2 * a["attention_causal"]
        assert m["model_causal"] == a["model"]
        # the fused kernel's 3.5 forwards (FlashAttention-2's count) of the half AR skips
        half = 2 * attention_flops(ar, 64, causal=True) * 2048  # 2 layers
        assert m["hardware"] - a["hardware"] == (3.5 * half if fused else 0.0)


# A markov run of the tiny Llama-style model (rotary positions: with learned ones the tiny model
# learns the chain far slower both ways) on a first-order chain, 16 tokens a window: its held-out
# bound after STEPS steps lies above the window's entropy and within MARGIN of it (the guide's
# numbers; the uniform guess is log 16 = 2.77 nats).
STEPS, MARGIN = 200, 0.5
MDLM_RUN = ["model=tiny_llama", "model.objective=mdlm", "model.noise_schedule=cosine",
            "data.order=1", "data.seq_len=16", "data.batch_size=16", "parallelism=dp2",
            f"train.steps={STEPS}", "train.log_every=50", f"train.eval_every={STEPS}",
            f"checkpoint.every={STEPS}", "logger=none", "eval.draws=4"]


@pytest.fixture(scope="module")
def markov_mdlm(tmp_path_factory):
    run = tmp_path_factory.mktemp("mdlm") / "run"
    train(make_cfg(*MDLM_RUN), run)
    return run


@pytest.mark.e2e  # a trained run: whole training, tools on it
def test_markov_bound_lies_above_the_windows_entropy_and_near_it(markov_mdlm):
    summary = json.loads((markov_mdlm / "summary.json").read_text())
    floor = summary["entropy_floor"]  # the window's entropy per token (MarkovSource)
    chain = make_cfg(*MDLM_RUN)
    from dxrun.data import Data

    source = Data(chain).markov
    assert floor == pytest.approx(source.window_entropy()) and floor > source.entropy_floor
    print(f"mdlm markov: eval/loss {summary['eval/loss']:.4f}, floor {floor:.4f} after {STEPS} "
          f"steps")
    assert floor < summary["eval/loss"] < floor + MARGIN, summary
    rows = [json.loads(x) for x in (markov_mdlm / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["train/loss"] > summary["train/loss"] + 0.5  # it learned
    # cosine: 1 - cos(pi t / 2) averages 1 - 2/pi over t
    assert all(abs(r["train/mask_rate"] - (1 - 2 / math.pi)) < 0.1 for r in rows), rows


@pytest.mark.e2e  # a trained run: whole training, tools on it
def test_evaluation_is_the_same_on_every_mesh(markov_mdlm):
    """The held-out bound (eval.draws draws per batch, seeded by the batch's index): on the
    run's own mesh bitwise the run's last evaluation, on two others equal to float rounding."""
    summary = json.loads((markov_mdlm / "summary.json").read_text())
    same = evaluate_checkpoint(markov_mdlm, ["parallelism=dp2"])
    assert same["eval/loss"] == summary["eval/loss"]
    assert same["eval/accuracy"] == summary["eval/accuracy"]
    other = evaluate_checkpoint(markov_mdlm, ["parallelism=tp2"])
    assert other["eval/loss"] == pytest.approx(summary["eval/loss"], rel=1e-5)
    assert other["eval/accuracy"] == pytest.approx(summary["eval/accuracy"], rel=1e-5)


@pytest.mark.e2e  # a trained run: whole training, tools on it
def test_reverse_process_samples_follow_the_chain_on_any_mesh(markov_mdlm):
    """Greedy tokens unmasked in a random order (MDLM's ancestral sampler) or the most confident
    first: most transitions are ones the chain allows; the prompt stays; a tensor-parallel mesh
    samples the same tokens."""
    opts = {**OPTIONS, "n": 4, "max_new_tokens": 15, "steps": 8}  # 16 positions with the prompt
    one = sample(markov_mdlm, opts, [])
    tp = sample(markov_mdlm, opts, ["parallelism=tp2"])
    np.testing.assert_array_equal(one["tokens"], tp["tokens"])
    confident = sample(markov_mdlm, {**opts, "unmask": "confidence"}, [])
    for out in (one, confident):
        ok, total = out["allowed"]
        print(f"allowed transitions {ok}/{total}")
        assert total == 4 * 15 and ok / total >= 0.8, out["texts"]
        assert (out["tokens"] < 16).all()  # no [MASK] left, only the chain's symbols
    assert one["prompt_len"] == 1  # data.order tokens of held-out sequences, kept as they were
    np.testing.assert_array_equal(confident["tokens"][:, :1], one["tokens"][:, :1])


@pytest.mark.e2e  # a trained run: whole training, tools on it
def test_a_text_run_samples_text(tmp_path):
    """A short bytes-level run on a small corpus, sampled by the reverse process (the most
    confident first, drawn from the 8 likeliest bytes): the prompt kept, then letters, spaces and full
    stops, the corpus's (an untrained model's bytes are any of 256)."""
    corpus = write_corpus(tmp_path / "corpus.txt")
    train(make_cfg("model=tiny_llama", "model.objective=mdlm", "model.noise_schedule=cosine",
                   "data=text", f"data.path={corpus}", "data.seq_len=16", "data.batch_size=16",
                   "parallelism=dp2", "train.steps=60", "train.log_every=60",
                   "train.eval_every=0", "checkpoint.every=60", "logger=none"), tmp_path / "run")
    opts = {"prompt": "the cat ", "max_new_tokens": 8, "n": 4, "steps": 4, "temperature": 1.0,
            "top_k": 8, "unmask": "confidence"}
    out = sample(tmp_path / "run", {**OPTIONS, **opts}, [])
    for text in out["texts"]:
        print(repr(text))
        assert re.fullmatch(r"the cat [a-z. ]{8}", text), out["texts"]
        assert re.search(r"[a-z]", text[len("the cat "):]), out["texts"]


@pytest.mark.e2e  # a trained run: whole training, the tool on it
def test_export_refuses_a_masked_diffusion_run_before_reading_it(markov_mdlm, tmp_path, caplog):
    """``python -m dxrun.export`` of an mdlm run: one line saying Hugging Face's classes are
    causal, from the checkpoint's config, before its parameters are restored (no "checkpoint
    ... on mesh" line) and with no --to dir made."""
    from dxrun.export import export

    with caplog.at_level(logging.INFO), pytest.raises(
            ConfigError, match="^model.objective=mdlm: Hugging Face's GPT-2 and Llama attend "
                               "causally, so a masked-diffusion model has no architecture"):
        export([str(markov_mdlm), "--to", str(tmp_path / "hf")])
    assert not [r for r in caplog.records if r.getMessage().startswith("checkpoint ")]
    assert not (tmp_path / "hf").exists()
