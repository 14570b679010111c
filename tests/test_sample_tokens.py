"""``dxrun.sample`` on a ``data=tokens`` run: text in and text out when the token dir's
``meta.json`` names its tokenizer (what ``dxrun.data.prepare`` writes), token ids when it names
none (issue 25: the README's path for real corpora had lost text sampling)."""

from __future__ import annotations

import json

import pytest
from conftest import make_cfg, write_corpus

from dxrun.config.errors import ConfigError
from dxrun.data.prepare import prepare
from dxrun.sample import OPTIONS, sample


@pytest.mark.e2e
def test_a_prepared_tokens_run_samples_text_and_ids_without_a_recorded_tokenizer(tmp_path):
    from dxrun.train import train

    tokens = tmp_path / "tokens"
    prepare(str(write_corpus(tmp_path / "corpus.txt", n_sentences=200)), str(tokens))
    assert json.loads((tokens / "meta.json").read_text())["tokenizer"] == "bytes"
    run = tmp_path / "run"
    train(make_cfg("data=tokens", f"data.path={tokens}", "data.seq_len=16", "data.batch_size=8",
                   "model.n_layers=1", "train.steps=2", "train.eval_every=0", "checkpoint.every=2",
                   "logger=none"), run)

    opts = {**OPTIONS, "prompt": "the cat ", "max_new_tokens": 12}
    out = sample(run, opts, [])
    text = out["texts"][0]
    assert isinstance(text, str) and text.startswith("the cat ")
    # The continuation is the decoded ids (bytes): 12 of them, cut at the first end-of-text (0).
    new = [int(t) for t in out["tokens"][0][out["prompt_len"]:]]
    assert out["prompt_len"] == len(b"the cat ")
    cut = new[:new.index(0)] if 0 in new else new
    assert text == "the cat " + bytes(cut).decode("utf-8", errors="replace")

    # A token dir that names no tokenizer (written by another tool): ids in, ids out.
    meta = json.loads((tokens / "meta.json").read_text())
    del meta["tokenizer"]
    (tokens / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"prompt='the cat ': data=tokens prompts are token ids"):
        sample(run, opts, [])  # (decoding ids is test_sample's markov path)


@pytest.mark.e2e
def test_a_token_dir_that_names_bytes_for_wider_ids_samples_ids(tmp_path):
    """A ``meta.json`` that names the bytes tokenizer over ids no byte holds (GPT-2's 50257, or
    here 512, as benchmarks/tpu.sh's random ids once said): the samples are ids, and a sample
    without a prompt is one line asking for ids, not a ValueError after decoding."""
    import numpy as np

    from dxrun.train import train

    tokens = tmp_path / "tokens"
    tokens.mkdir()
    rng = np.random.default_rng(0)
    for name, n in (("train.bin", 20_000), ("val.bin", 2_000)):
        rng.integers(0, 512, n, dtype=np.uint16).tofile(tokens / name)
    (tokens / "meta.json").write_text(json.dumps({"vocab_size": 512, "dtype": "uint16",
                                                  "eot": 511, "tokenizer": "bytes"}))
    run = tmp_path / "run"
    train(make_cfg("data=tokens", f"data.path={tokens}", "data.seq_len=16", "data.batch_size=8",
                   "model.n_layers=1", "train.steps=2", "train.eval_every=0", "checkpoint.every=2",
                   "logger=none"), run)
    with pytest.raises(ConfigError, match=rf"^prompt is empty; data.path={tokens} records no "
                       r"tokenizer of its ids \(meta.json\), so this run takes token ids"):
        sample(run, {**OPTIONS, "max_new_tokens": 4}, [])
    out = sample(run, {**OPTIONS, "prompt": "300 7", "max_new_tokens": 4}, [])
    new = [int(t) for t in out["tokens"][0][2:]]
    assert out["texts"] == ["300 7 | " + " ".join(map(str, new))]
