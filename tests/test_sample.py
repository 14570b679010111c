"""``python -m dxrun.sample`` and ``dxrun.tools.decode``: greedy markov samples that follow the chain
(an untrained model's do not), text decoded with the run's tokenizer, the same seed giving the
same text, the key/value cache equal to recomputing the whole sequence, tensor-parallel
decoding equal to one device, and each bad input refused in one line."""

from __future__ import annotations

import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import MARKOV_STEPS, cli_in_process, make_cfg, subprocess_env, write_corpus
from flax import nnx

from dxrun.config.errors import ConfigError
from dxrun.model.sharding import in_mesh_context
from dxrun.sample import OPTIONS, allowed_transitions, sample
from dxrun.tools.checkpoint import load
from dxrun.tools.decode import Sampling, make_generate


def _sample_cli(*args: str) -> subprocess.CompletedProcess:
    env = subprocess_env()
    return subprocess.run([sys.executable, "-m", "dxrun.sample", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)


def _generate(loaded, prompt: np.ndarray, new: int, sampling: Sampling | None = None,
              params=None, with_logits: bool = False):
    exp, m = loaded.exp, loaded.cfg.model
    gen = make_generate(exp.graphdef, exp.mesh, exp.plan.rules, exp.param_shardings,
                        prompt.shape[1], new, sampling or Sampling(), m.n_layers, m.n_kv_heads,
                        m.d_model // m.n_heads, with_logits=with_logits)
    return gen(loaded.params if params is None else params, prompt)


@pytest.mark.e2e  # trains a run, then the tool on it: end to end
def test_greedy_markov_samples_follow_the_chain(markov_run):
    out = _sample_cli(markov_run, "n=8", "max_new_tokens=30")
    assert out.returncode == 0, out.stderr[-3000:]
    ok, total = map(int, re.search(r"allowed transitions: (\d+)/(\d+)", out.stdout).groups())
    assert total == 8 * 30 and ok / total >= 0.95, out.stdout
    assert len(re.findall(r"^\[\d\] (\d+ ){2}\|( \d+){30}$", out.stdout, re.M)) == 8

    # The same prompts through an untrained model of the same shape: far fewer allowed.
    loaded = load(markov_run, ["parallelism=dp1", "data.batch_size=8"], "path")
    chain = loaded.exp.data.markov
    prompt = sample(markov_run, {**OPTIONS, "n": 8, "max_new_tokens": 30}, [])["tokens"][:, :2]
    fresh = loaded.exp.init_state().params
    untrained = np.asarray(_generate(loaded, prompt, 30, params=fresh))
    bad, _ = allowed_transitions(untrained, chain.succ, chain.S, chain.k, 2)
    assert bad / total < 0.5 * ok / total, (bad, ok)

    # Greedy is deterministic, and a tensor-parallel mesh decodes the same tokens.
    trained = np.asarray(_generate(loaded, prompt, 30))
    np.testing.assert_array_equal(trained, np.asarray(_generate(loaded, prompt, 30)))
    tp = sample(markov_run, {**OPTIONS, "n": 8, "max_new_tokens": 30}, ["parallelism=tp2"])
    np.testing.assert_array_equal(tp["tokens"], trained)
    assert allowed_transitions(trained, chain.succ, chain.S, chain.k, 2) == (ok, total)


@pytest.mark.e2e  # trains a run, then the tool on it: end to end
def test_text_samples_decode_and_kv_cache_equals_recompute(text_run):
    corpus_chars = set((text_run.parent / "corpus.txt").read_text())
    opts = {**OPTIONS, "prompt": "the cat ", "max_new_tokens": 24, "n": 2,
            "temperature": 0.8, "top_k": 20, "top_p": 0.95}
    one = sample(text_run, {**opts, "seed": 1}, [])
    again = sample(text_run, {**opts, "seed": 1}, [])
    other = sample(text_run, {**opts, "seed": 2}, [])
    assert one["texts"] == again["texts"] and one["texts"] != other["texts"]
    greedy = sample(text_run, {**OPTIONS, "prompt": "the cat ", "max_new_tokens": 24}, [])
    for text in one["texts"] + greedy["texts"]:
        assert text.startswith("the cat ") and len(text) > len("the cat ")
        assert set(text) <= corpus_chars, text  # the corpus's characters: valid text
    assert re.fullmatch(r"the cat [a-z. ]+", greedy["texts"][0]), greedy["texts"]

    # The logits each token was picked from (cache) against the whole sequence recomputed,
    # with the model split over 2 devices (tensor parallel).
    loaded = load(text_run, ["parallelism=tp2", "data.batch_size=2"], "path", with_data=False)
    prompt = one["tokens"][:, :one["prompt_len"]]
    tokens, cached = _generate(loaded, prompt, 24, Sampling(0.8, 20, 0.95, 1), with_logits=True)
    _assert_cache_equals_recompute(loaded.exp, loaded.params, tokens, cached, prompt.shape[1])


def _assert_cache_equals_recompute(exp, params, tokens_BxT, cached_BxNxV, prompt_len: int):
    """The logits decoding picked each new token from (with the cache) against the whole
    sequence's logits recomputed at once, element by element (not the masked padding)."""

    @jax.jit
    def full(params, tokens_BxT):
        return nnx.merge(exp.graphdef, params)(tokens_BxT)

    with in_mesh_context(exp.mesh, exp.plan.rules):
        whole = np.asarray(full(params, tokens_BxT[:, :-1]))
    real = whole[:, prompt_len - 1:, :exp.cfg.model.vocab_size]
    cached = np.asarray(cached_BxNxV)[..., :exp.cfg.model.vocab_size]
    np.testing.assert_allclose(cached, real, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pieces", [(), ("model.sliding_window=4", "model.head_dim=8",
                                            "model.qk_norm=head", "model.qkv_bias=true"),
                                     ("model.n_layers=4", "model.sliding_window=4",
                                      "model.global_every=2", "model.rope_local_theta=100",
                                      "model.attn_softcap=2", "model.logit_softcap=3",
                                      "model.attn_scalar=12", "model.norm_position=sandwich",
                                      "model.mlp=geglu", "model.norm_plus_one=true",
                                      "model.embed_scale=true")], ids=["llama", "qwen", "gemma2"])
def test_kv_cache_of_a_llama_style_block_equals_recompute(pieces):
    """RoPE at the cache's positions, grouped-query heads, SwiGLU, a padded vocabulary (65 on
    tp2): an untrained model with large weights, so every position matters; and with issue
    81's pieces (a 4-position window over 17, a head_dim of its own, q/k norms, q/k/v biases;
    Gemma 2's: windowed and full layers alternating, on two rope bases, soft caps, a score
    scale, sandwich norms, GeGLU, 1 + w norms, scaled embeddings)."""
    from dxrun.config import head_dim_of
    from dxrun.experiment import Experiment

    exp = Experiment.build(make_cfg("model=tiny_llama", "parallelism=tp2", "data.batch_size=2",
                                    "data.vocab_size=65", "model.init_std=0.3", "logger=none",
                                    *pieces))
    params = exp.seeded.params()
    prompt = np.random.default_rng(0).integers(0, 16, (2, 5))
    m = exp.cfg.model
    gen = make_generate(exp.graphdef, exp.mesh, exp.plan.rules, exp.param_shardings, 5, 12,
                        Sampling(temperature=1.0, seed=3), m.n_layers, m.n_kv_heads,
                        head_dim_of(m), with_logits=True)
    tokens, cached = gen(params, prompt)
    assert np.asarray(cached).shape == (2, 12, 66) and int(np.asarray(tokens).max()) < 65
    _assert_cache_equals_recompute(exp, params, tokens, cached, 5)


@pytest.mark.e2e  # trains a run, then the tool on it: end to end
def test_bad_input_is_one_line(tmp_path, text_run, caplog):
    """Exit 2 and one line, no traceback: one case through ``python -m dxrun.sample`` (a
    checkpoint restored in its own process, whose libraries' log lines are on its stderr), the
    others through the same entry point (``main``) in this process (``cli_in_process``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from dxrun.sample import run
    from dxrun.tools.checkpoint import main
    from dxrun.train import train

    # A run with a word-level tokenizer.json, which has no way to write "é" or "✓".
    corpus = write_corpus(tmp_path / "corpus.txt", n_sentences=200)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(corpus)], trainers.WordLevelTrainer(special_tokens=["[UNK]",
                                                                       "<|endoftext|>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    words = tmp_path / "words"
    train(make_cfg("data=text", f"data.path={corpus}", f"data.tokenizer={tmp_path}/tokenizer.json",
                   "data.seq_len=16", "data.batch_size=8", "parallelism=dp2", "train.steps=2",
                   "train.eval_every=0", "checkpoint.every=2", "logger=none"), words)
    out = _sample_cli(text_run, "prompt=the", "temperature=1", "top_k=300")
    errors = [x for x in out.stderr.splitlines() if "error" in x.lower()]
    assert out.returncode == 2 and len(errors) == 1, out.stderr[-3000:]
    assert errors[0] == ("dxrun.sample: error: top_k=300 is larger than the vocabulary "
                         "(model.vocab_size=256); use top_k<=256, or top_k=0 for no cut"), errors
    assert "Traceback" not in out.stderr
    cases = [
        ((tmp_path, "prompt=hi"), f"path={tmp_path} holds no committed checkpoint"),
        ((words, "prompt=the cat é ✓"), "cannot encode 'é✓'"),
        ((text_run, "prompt=the", "max_new_tokens=1000"),
         "max_new_tokens=1000 after a 3-token prompt needs 1003 positions, beyond "
         "model.max_seq_len=128; use max_new_tokens<=125"),
        # cp is said first, not the n=1 sample's split over dp2_cp4's 2 replicas
        ((text_run, "prompt=the", "parallelism=dp2_cp4"),
         "does not split it over parallelism.cp=4; sample on a mesh with cp=1"),
    ]
    for args, message in cases:
        caplog.clear()
        out = cli_in_process(*map(str, args), cwd=tmp_path, entry=lambda: main("sample", run),
                             prog="dxrun.sample")
        # (this process's log records are caplog's, not stderr's: read with it)
        lines = out.stderr.splitlines() + [r.getMessage() for r in caplog.records]
        errors = [x for x in lines if "error" in x.lower()]
        assert out.returncode == 2 and len(errors) == 1, out.stderr[-3000:]
        assert errors[0].startswith("dxrun.sample: error: ") and message in errors[0], errors
        assert "Traceback" not in out.stderr


@pytest.mark.e2e  # trains a run, then the tool on it: end to end
def test_sampling_refusals(markov_run):
    """Options out of range, n samples that do not split over the data-parallel replicas, and
    a markov prompt that is not the chain's ids: one ConfigError each (the CLI's one line and
    exit 2), before anything is decoded."""
    for options, overrides, says in [
        ({"temperature": -0.5}, [], r"^temperature=-0.5 must be >= 0 and finite \(0 = greedy\)$"),
        ({"temperature": float("inf")}, [], r"^temperature=inf must be >= 0 and finite "),
        ({"temperature": float("nan")}, [], r"^temperature=nan must be >= 0 and finite "),
        ({"seed": 2**32}, [], r"^seed=4294967296 must be in \[0, 2\^32\)$"),
        ({"top_k": -1}, [], r"^top_k=-1 must be >= 0 \(0 = no cut\)$"),
        ({"top_p": 0.0}, [], r"^top_p=0.0 must be in \(0, 1\] \(1 = no cut\)$"),
        ({"top_p": 1.5}, [], r"^top_p=1.5 must be in \(0, 1\]"),
        ({"max_new_tokens": 0}, [], "^max_new_tokens=0 must be >= 1$"),
        ({"n": 0}, [], "^n=0 must be >= 1$"),
        ({"temperature": 1.0, "top_k": 17}, [], "^top_k=17 is larger than the vocabulary "
                                                r"\(model.vocab_size=16\); use top_k<=16"),
        ({"n": 3}, ["parallelism=dp2"], r"^n=3 samples do not split over this mesh's "
                                        r"data-parallel replicas \(2\); ask for a multiple"),
        ({"prompt": "the cat"}, [], "^prompt='the cat': markov prompts are token ids 0-15 "
                                    "separated by spaces, e.g. prompt='3 7'$"),
        ({"prompt": "3 16"}, [], "^prompt='3 16': markov prompts are token ids 0-15 "),
    ]:
        with pytest.raises(ConfigError, match=says):
            sample(markov_run, {**OPTIONS, **options}, overrides)


@pytest.mark.e2e  # trains a run, then the tool on it: end to end
def test_sampled_tokens_are_the_same_on_tp2(markov_run):
    """temperature > 0 with top-k and top-p: the same seed draws the same tokens on one device
    and split over 2 (tensor parallel). (That another seed draws other text is the text test's.)"""
    opts = {**OPTIONS, "n": 4, "max_new_tokens": 20, "temperature": 0.8, "top_k": 10,
            "top_p": 0.95, "seed": 5}
    one = sample(markov_run, opts, [])
    tp = sample(markov_run, opts, ["parallelism=tp2"])
    np.testing.assert_array_equal(tp["tokens"], one["tokens"])


@pytest.mark.e2e  # trains a run, then the tool on it: end to end
def test_a_bf16_run_decodes_in_bf16(markov_run):
    """Decoding takes the run's compute dtype (``train.precision``; here an override of the
    fp32 run's): with bf16 every matmul of the program reads bf16 weights (cast once, before the
    token loop) and the logits stay fp32; an fp32 run's program has no bf16 at all. The bf16
    greedy samples still follow the chain."""
    from dxrun.sample import make_decoder

    opts = {**OPTIONS, "n": 4, "max_new_tokens": 20}
    out = sample(markov_run, opts, ["train.precision=bf16"])
    ok, total = out["allowed"]
    assert total == 4 * 20 and ok / total >= 0.9, out["texts"]

    prompt = out["tokens"][:, :out["prompt_len"]]
    texts = {}
    for precision in ("bf16", "fp32"):  # fp32: what an fp32 run's config says
        loaded = load(markov_run, ["parallelism=dp1", "data.batch_size=4",
                                   f"train.precision={precision}"], "path", with_data=False)
        gen = make_decoder(loaded, prompt.shape[1], 20, Sampling())
        texts[precision] = gen.lower(loaded.params, prompt).as_text()
    dots = re.findall(r"stablehlo\.dot_general .*?: \((.*?)\) -> (\S+)", texts["bf16"])
    assert dots and all(ins.count("bf16") == 2 for ins, _ in dots), dots
    assert re.search(r"-> tensor<4x\d+xf32>", texts["bf16"])  # fp32 logits (prefill's)
    assert "bf16" not in texts["fp32"]


def _tool(tool: str, *args: str, cwd) -> tuple[int, str, str]:
    """``python -m dxrun.<tool> <args>`` through its entry point in this process: (exit code,
    stdout, its one ``error:`` line or '')."""
    from importlib import import_module

    from dxrun.tools.checkpoint import main

    run = import_module(f"dxrun.{tool}").run
    proc = cli_in_process(*args, cwd=cwd, entry=lambda: main(tool, run), prog=f"dxrun.{tool}")
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith(f"dxrun.{tool}: error: ")]
    assert len(errors) <= 1, errors
    return proc.returncode, proc.stdout, errors[0] if errors else ""


@pytest.mark.e2e  # reads the session's trained markov run
def test_logits_reads_token_ids_as_sample_does(markov_run, tmp_path):
    """``tokens="1 2"`` is two ids, as sample's ``prompt="1 2"`` is (it was the one id 12), and
    gives what ``tokens=1,2`` gives; ``step=`` names the checkpoint read. Arguments longer than
    a file name (129 ids, a 300-character prompt) reach the tools' own refusals: one line,
    exit 2 (they were an OSError from looking for a file of that name)."""
    run = str(markov_run)
    for given, out in (("tokens=1 2", "out=spaced.npy"), ("tokens=[1, 2]", "out=commas.npy")):
        code, stdout, error = _tool("logits", run, given, out, cwd=tmp_path)
        assert code == 0 and not error, error
    spaced, commas = np.load(tmp_path / "spaced.npy"), np.load(tmp_path / "commas.npy")
    assert spaced.shape == (1, 2, 16)
    np.testing.assert_array_equal(spaced, commas)
    code, stdout, _ = _tool("logits", run, "tokens=1 2", f"step={MARKOV_STEPS}", cwd=tmp_path)
    assert code == 0 and stdout.startswith(f"step {MARKOV_STEPS}  last position's top 5: ")
    ckpts = markov_run / "checkpoints"
    for args, says in (
            (("step=100",), f"step 100: {ckpts} has no committed step 100 (it has "
                            f"{MARKOV_STEPS})"),
            (("step=100", "--best"), "step=100 and --best name two checkpoints; give one"),
            (("best=true",), "best=true is no option; ask for checkpoint.keep_best's "
                             "checkpoint with --best"),
            ((f"tokens={' '.join(['1'] * 129)}",),
             "tokens: ids must lie in [0, 16) and be at most model.max_seq_len=128 long (got "
             "ids 1..1, length 129)")):
        tokens = [] if args[0].startswith("tokens=") else ["tokens=1 2"]
        assert _tool("logits", run, *tokens, *args, cwd=tmp_path) == (
            2, "", f"dxrun.logits: error: {says}")
    prompt = " ".join(["1", "2"] * 75)  # 299 characters
    assert _tool("sample", run, f"prompt={prompt}", cwd=tmp_path) == (
        2, "", "dxrun.sample: error: prompt: 150 tokens leave no room for a new one in "
               "model.max_seq_len=128; give a prompt of at most 127 tokens")


@pytest.mark.e2e  # reads the session's trained markov run
def test_load_model_after_jax_started_says_what_works(markov_run):
    """``load_model`` in a process where JAX has started (this one: 8 CPU devices), as the HF
    guide's order has it (the reference built first): a layout wider than the devices says so
    and what works there, not ``runtime.cpu_devices``, which cannot act once JAX started."""
    from dxrun.logits import load_model

    with pytest.raises(ConfigError) as e:
        load_model(markov_run, "parallelism=tp2", "parallelism.n_devices=16",
                   "parallelism.dp=8")
    assert str(e.value) == (
        "parallelism=tp2 needs 16 devices but JAX had started in this process with 8 cpu "
        "devices, a count fixed once it starts (runtime.cpu_devices acts only before); load the "
        "model before anything else starts JAX, or start Python with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=16")
