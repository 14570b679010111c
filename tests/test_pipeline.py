"""Real data: text and token files through the Grain pipeline, process sharding, exact resume,
and every refusal before compile."""

from __future__ import annotations

import json
import logging
import pickle
import random

import jax
import numpy as np
import pytest

from dxrun.config.errors import ConfigError
from dxrun.data import EVAL, TRAIN, Data, TokenFile, Tokenizer, split
from dxrun.data.prepare import prepare
from dxrun.experiment import Experiment

WORDS = "the quick brown fox jumps over a lazy dog while cats sit on warm mats".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three small documents in a folder, and a word-level tokenizer.json trained on them."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    docs = root / "docs"
    docs.mkdir()
    for i in range(3):
        lines = [" ".join(rng.choice(WORDS) for _ in range(10)) + "." for _ in range(400)]
        (docs / f"doc{i}.txt").write_text("\n".join(lines))
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers, trainers

    tok = HF(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(p) for p in sorted(docs.iterdir())],
              trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"]))
    tok.save(str(root / "tokenizer.json"))
    return root


def _cfg(cfg_factory, corpus, *extra):
    return cfg_factory("data=text", f"data.path={corpus / 'docs'}", "logger=none", *extra)


def test_byte_tokenizer_text(cfg_factory, corpus):
    data = Data(_cfg(cfg_factory, corpus))
    assert data.vocab_size == 256
    batch = data.local_batch(0)
    assert batch.shape == (32, 65) and batch.dtype == np.int32
    text = Tokenizer(None).decode(batch[0])
    inner = text.replace("\x00", " ").replace("\n", " ").replace(".", "").split()[1:-1]
    assert inner and set(inner) <= set(WORDS)  # (the window's edges may cut a word)


def test_tokenizer_json_text(cfg_factory, corpus):
    tj = corpus / "tokenizer.json"
    data = Data(_cfg(cfg_factory, corpus, f"data.tokenizer={tj}", "data.vocab_size=64"))
    tok = Tokenizer(str(tj))
    assert data.vocab_size == tok.vocab_size == len(WORDS) + 3  # words, '.', [UNK], EOT
    words = tok.decode(data.local_batch(3)[0]).replace(" .", "").split()[1:-1]
    assert words and set(words) <= set(WORDS) | {"."}
    assert tok.eot == 1  # documents are joined with <|endoftext|>


def test_prepare_round_trips(tmp_path, corpus):
    meta = prepare(str(corpus / "docs" / "*.txt"), str(tmp_path), val_fraction=0.1)
    ids = np.concatenate([np.fromfile(tmp_path / "train.bin", np.uint16),
                          np.fromfile(tmp_path / "val.bin", np.uint16)])
    tok = Tokenizer(None)
    expected = []
    for f in sorted((corpus / "docs").iterdir()):
        expected += list(tok.encode(f.read_text())) + [tok.eot]
    np.testing.assert_array_equal(ids, expected)
    assert meta["train_tokens"] + meta["val_tokens"] == len(expected)
    assert json.loads((tmp_path / "meta.json").read_text())["dtype"] == "uint16"


def test_tokens_source_reads_prepared_bins(tmp_path, corpus, cfg_factory):
    tj = corpus / "tokenizer.json"
    prepare(str(corpus / "docs"), str(tmp_path), tokenizer=str(tj))
    cfg = cfg_factory("data=tokens", f"data.path={tmp_path}", "data.vocab_size=64", "logger=none")
    data = Data(cfg)
    train = np.fromfile(tmp_path / "train.bin", np.uint16)
    rows = data.local_batch(0)
    # Every row is a contiguous window of train.bin.
    for row in rows[:4]:
        starts = np.flatnonzero(train[: len(train) - 64] == row[0])
        assert any((train[s:s + 65] == row).all() for s in starts)


@pytest.mark.parametrize("source", ["markov", "text"])
def test_batch_independent_of_devices_and_processes(cfg_factory, corpus, source):
    extra = ["data=text", f"data.path={corpus / 'docs'}"] if source == "text" else []
    one = Experiment.build(cfg_factory(*extra, "logger=none", "parallelism=dp1"))
    eight = Experiment.build(cfg_factory(*extra, "logger=none", "parallelism=dp2_fsdp2_tp2"))
    for step in (0, 7):
        a, b = one.batch(step), eight.batch(step)
        np.testing.assert_array_equal(jax.device_get(a), jax.device_get(b))
        assert len(b.sharding.device_set) == 8
    cfg = cfg_factory(*extra, "logger=none")
    whole = Data(cfg, 0, 1)
    halves = [Data(cfg, p, 2) for p in range(2)]
    for step in (0, 5, 123):
        for stream in (TRAIN, EVAL):
            joined = np.concatenate([h.local_batch(step, stream) for h in halves])
            np.testing.assert_array_equal(joined, whole.local_batch(step, stream))


@pytest.mark.parametrize("workers", [0, 1])
def test_iterator_state_resumes_exactly(cfg_factory, corpus, workers):
    cfg = _cfg(cfg_factory, corpus, f"data.workers={workers}", "data.batch_size=64")
    data = Data(cfg)
    it = data.train_iterator()
    seen = [next(it) for _ in range(5)]  # mid-epoch: an epoch here is ~70 batches
    state = it.get_state()
    json.dumps(state)  # JSON-able, for the checkpoint
    expected = [next(it) for _ in range(4)]
    resumed = Data(cfg).train_iterator()
    resumed.set_state(state)
    for a, b in zip(expected, [next(resumed) for _ in range(4)], strict=True):
        np.testing.assert_array_equal(a, b)
    for k, batch in enumerate(seen + expected):
        np.testing.assert_array_equal(batch, data.local_batch(k))


def test_epochs_are_reshuffled_and_cover_every_window():
    from dxrun.data import local_batches

    L = 4
    tokens = np.arange(10 * L + 1)  # 10 windows; a window's first token names it
    batches = local_batches(tokens, L, batch_size=5, seed=0)
    epoch = lambda e: [int(r[0]) // L for k in (2 * e, 2 * e + 1) for r in batches[k]]
    first, second = epoch(0), epoch(1)
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second and first != list(range(10))


@pytest.mark.parametrize("make, needle", [
    (lambda d, c: ["data=text", f"data.path={d}/nope.txt"], "no such file"),
    (lambda d, c: ["data=text"], "data=text needs data.path"),
    (lambda d, c: ["data=text", f"data.path={c['empty']}"], "is empty"),
    (lambda d, c: ["data=text", f"data.path={c['short']}"], "shorter than one window"),
    (lambda d, c: ["data=tokens", f"data.path={c['bigid']}", "data.vocab_size=256",
                   "data.dtype=uint16"], "train.bin holds token id 300 >= model.vocab_size=256"),
    (lambda d, c: ["data=tokens", f"data.path={c['u32']}", "data.dtype=uint16"],
     "data.dtype=uint16 but"),
    (lambda d, c: ["data=text", f"data.path={c['short']}", f"data.tokenizer={c['badtok']}"],
     "cannot read it as a tokenizer.json"),
    (lambda d, c: ["data=text", f"data.path={c['short']}", "model.vocab_size=100",
                   "data.seq_len=4"], "model.vocab_size=100"),
])
def test_bad_data_inputs_fail_before_compile(cfg_factory, tmp_path, make, needle):
    cases = {"empty": tmp_path / "empty.txt", "short": tmp_path / "short.txt",
             "bigid": tmp_path / "bigid", "u32": tmp_path / "u32",
             "badtok": tmp_path / "tokenizer.json"}
    cases["empty"].write_text("")
    cases["short"].write_text("only a few words")
    cases["badtok"].write_text("{not json")
    for name, ids, dtype in (("bigid", [1, 2, 300] * 50, "uint16"), ("u32", [1, 2, 3] * 50, "uint32")):
        cases[name].mkdir()
        np.asarray(ids, dtype).tofile(cases[name] / "train.bin")
        if name == "u32":
            (cases[name] / "meta.json").write_text(json.dumps({"dtype": "uint32",
                                                               "vocab_size": 4}))
    from dxrun.checks import validate
    from dxrun.train import prepare as prepare_run

    cfg = cfg_factory(*make(tmp_path, cases), "logger=none")
    with pytest.raises(ConfigError) as err:
        validate(cfg)
        prepare_run(cfg)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


NO_HELD_OUT = ["data.val_fraction=0", "parallelism=dp1", "train.steps=2", "train.log_every=1",
               "train.eval_every=1", "eval.batches=1"]


def test_no_held_out_data_turns_eval_off_with_one_warning(cfg_factory, corpus, caplog):
    cfg = _cfg(cfg_factory, corpus, *NO_HELD_OUT)
    with caplog.at_level(logging.WARNING, logger="dxrun"):
        data = Data(cfg)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "data.val_fraction" in warnings[0], warnings
    assert "train.eval_every=0" in warnings[0] and "\n" not in warnings[0]
    assert not data.has_eval
    with pytest.raises(ValueError, match="no held-out data"):
        data.local_batch(0, EVAL)  # never the training split in its place
    assert Data(_cfg(cfg_factory, corpus)).has_eval  # the default 5% holds windows


@pytest.mark.e2e
def test_no_held_out_data_trains_without_eval(cfg_factory, corpus, tmp_path):
    from dxrun.train import train

    train(_cfg(cfg_factory, corpus, *NO_HELD_OUT), tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert not any(k.startswith("eval/") for r in rows for k in r), rows


def _token_dir(root, ids, meta=None):
    root.mkdir()
    np.asarray(ids, np.uint16).tofile(root / "train.bin")
    np.asarray(ids[:200], np.uint16).tofile(root / "val.bin")
    if meta is not None:
        (root / "meta.json").write_text(json.dumps(meta))
    return root


def test_a_meta_that_understates_the_largest_id_is_refused(cfg_factory, tmp_path):
    """meta.json's max_id is not taken on trust: the files are scanned, and an id beyond the
    model's vocabulary is one line naming the file and the id (not a NaN loss later)."""
    from dxrun.checks import validate

    ids = [1, 2, 300] * 100  # a scan finds 300; meta.json says 10, and its counts match
    meta = {"dtype": "uint16", "vocab_size": 256, "max_id": 10, "train_tokens": 300,
            "val_tokens": 200}
    root = _token_dir(tmp_path / "meta", ids, meta)
    cfg = cfg_factory("data=tokens", f"data.path={root}", "data.seq_len=16", "logger=none")
    assert cfg.data.vocab_size == cfg.model.vocab_size == 256
    validate(cfg)
    with pytest.raises(ConfigError) as err:
        Data(cfg)
    assert str(err.value) == (f"data.path={root}: train.bin holds token id 300 >= "
                              "model.vocab_size=256; set data.vocab_size (or model.vocab_size) "
                              "to 301 or more")
    (root / "val.bin").write_bytes(np.asarray([1, 2, 400], np.uint16).tobytes())
    with pytest.raises(ConfigError, match=r"^data.path=\S+: val.bin holds token id 400 >= "):
        Data(cfg)


def test_token_files_need_their_dtype(cfg_factory, tmp_path):
    """No dtype in meta.json (or no meta.json) and no data.dtype: refused in one line naming
    the file and what to write, never read as uint16 (these uint32 ids would be twice as many
    uint16 ids, every other one 0)."""
    from dxrun.checks import validate

    root = tmp_path / "wide"
    root.mkdir()
    np.arange(70000, 70300, dtype=np.uint32).tofile(root / "train.bin")
    cfg = lambda *extra: cfg_factory("data=tokens", f"data.path={root}", "data.seq_len=16",
                                     "logger=none", *extra)
    which = ('("uint32" when ids reach 65536; `python -m dxrun.data.prepare` writes it), or set '
             "data.dtype")
    with pytest.raises(ConfigError) as err:
        validate(cfg())
    assert str(err.value) == (f"data.path={root}: no {root / 'meta.json'} to say the token files' "
                              f'dtype; write {{"dtype": "uint16"}} there {which}')
    (root / "meta.json").write_text(json.dumps({"vocab_size": 70400}))
    with pytest.raises(ConfigError) as err:
        validate(cfg())
    assert str(err.value) == (f"data.path={root}: {root / 'meta.json'} gives no dtype of the "
                              f'token files; add "dtype": "uint16" to it {which}')
    given = cfg("data.dtype=uint32")  # said on the command line: taken
    validate(given)
    assert np.asarray(Data(given).local_batch(0)).min() >= 70000
    (root / "meta.json").write_text(json.dumps({"vocab_size": 70400, "dtype": "uint32"}))
    validate(cfg())
    assert cfg().data.dtype == "uint32"


@pytest.mark.e2e  # the launcher as a subprocess
@pytest.mark.parametrize("case", ["no dtype", "understated max_id"])
def test_token_file_refusals_are_one_line_at_the_cli(tmp_path, case):
    from conftest import run_cli

    root = tmp_path / "corpus"
    meta = {"dtype": "uint16", "vocab_size": 256, "max_id": 10, "train_tokens": 300,
            "val_tokens": 200}
    _token_dir(root, [1, 2, 300] * 100, None if case == "no dtype" else meta)
    want = (f"data.path={root}: no {root / 'meta.json'} to say the token files' dtype"
            if case == "no dtype" else
            f"data.path={root}: train.bin holds token id 300 >= model.vocab_size=256")
    proc = run_cli("data=tokens", f"data.path={root}", "data.seq_len=16", "parallelism=dp2",
                   "logger=none", cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [x for x in proc.stderr.splitlines() if x.startswith("dxrun: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"dxrun: error: {want}"), proc.stderr[-2000:]


def test_token_file_source_pickles_by_path(cfg_factory, tmp_path):
    """Grain pickles the source into each worker: a 64 MB train.bin must not travel along."""
    root = tmp_path / "big"
    root.mkdir()
    n, every = 32 * 2**20, 2**16  # uint16 tokens: 64 MB, sparse (zeros) but for 512 marks
    with open(root / "train.bin", "wb") as f:
        f.truncate(2 * n)
    marks = np.memmap(root / "train.bin", np.uint16, mode="r+")
    marks[::every] = np.arange(n // every) % 250 + 1
    marks.flush()
    del marks
    np.arange(1000, dtype=np.uint16).tofile(root / "val.bin")
    (root / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 1000,
                                                "max_id": 999, "train_tokens": n,
                                                "val_tokens": 1000}))
    cfg = cfg_factory("data=tokens", f"data.path={root}", "data.vocab_size=1024",
                      "data.batch_size=8", "logger=none")
    data = Data(cfg)
    ds = data._splits[TRAIN]  # the Grain MapDataset that GrainBatches sends to workers
    blob = pickle.dumps(ds)
    assert len(blob) < 2**20, len(blob)
    for k in (0, 3):
        np.testing.assert_array_equal(pickle.loads(blob)[k], data.local_batch(k))
    # corpus.split's views travel by path too, and read the same tokens.
    train, val = split(TokenFile(root / "train.bin", np.uint16), 0.25)
    for view, first in ((train, 0), (val, 3 * n // 4)):
        blob = pickle.dumps(view)
        back = pickle.loads(blob)
        assert len(blob) < 1000 and len(back) == len(view)
        expected = np.arange(first // every, (first + len(view)) // every) % 250 + 1
        np.testing.assert_array_equal(back[::every], expected)
    # and a real Grain worker process reads the same batches
    from dxrun.data import GrainBatches

    it = GrainBatches(ds, workers=1)
    np.testing.assert_array_equal(next(it), data.local_batch(0))


def test_hf_special_tokens_are_not_added(corpus, tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import processors

    hf = HF.from_file(str(corpus / "tokenizer.json"))
    hf.post_processor = processors.TemplateProcessing(single="[UNK] $A [UNK]",
                                                      special_tokens=[("[UNK]", 0)])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(str(tmp_path / "tokenizer.json"))
    ids = tok.encode("the lazy dog")
    assert len(ids) == 3 and 0 not in ids, ids
    assert tok.decode(ids) == "the lazy dog"


def test_vocab_and_dtype_come_from_the_data(cfg_factory, tmp_path, corpus):
    """prepare wrote meta.json (or text names its tokenizer): no data.vocab_size / data.dtype
    needed, the model is sized for the data (256 bytes, not GPT-2's 50,304)."""
    from dxrun.checks import validate

    out = tmp_path / "mycorpus"
    prepare(str(corpus / "docs"), str(out))
    cfg = cfg_factory("data=tokens", f"data.path={out}", "logger=none")
    assert (cfg.data.vocab_size, cfg.model.vocab_size, cfg.data.dtype) == (256, 256, "uint16")
    validate(cfg)  # what prepare writes passes every check
    assert Data(cfg).vocab_size == 256
    wide = tmp_path / "wide"  # a uint32 corpus: the dtype comes along
    wide.mkdir()
    np.arange(300, dtype=np.uint32).tofile(wide / "train.bin")
    (wide / "meta.json").write_text(json.dumps({"vocab_size": 70000, "dtype": "uint32"}))
    cfg = cfg_factory("data=tokens", f"data.path={wide}", "data.seq_len=16", "logger=none")
    assert (cfg.data.vocab_size, cfg.data.dtype) == (70000, "uint32")
    assert np.asarray(Data(cfg).local_batch(0)).max() < 300
    tj = corpus / "tokenizer.json"  # text: the tokenizer's vocabulary, bytes without one
    cfg = cfg_factory("data=text", f"data.path={corpus / 'docs'}", f"data.tokenizer={tj}")
    assert cfg.model.vocab_size == Data(cfg).vocab_size == len(WORDS) + 3
    assert cfg_factory("data=text", f"data.path={corpus / 'docs'}").data.vocab_size == 256
    bare = tmp_path / "bare"  # no meta.json: GPT-2's vocabulary, but no dtype guessed
    bare.mkdir()
    cfg = cfg_factory("data=tokens", f"data.path={bare}")
    assert (cfg.data.vocab_size, cfg.data.dtype) == (50304, None)
    with pytest.raises(ConfigError, match="to say the token files' dtype"):
        validate(cfg)


def test_explicit_vocab_refused_below_the_data_and_warned_far_above(cfg_factory, tmp_path,
                                                                     corpus, caplog):
    out = tmp_path / "bytes"
    prepare(str(corpus / "docs"), str(out))  # byte ids up to 'z' = 122, vocab 256
    top = json.loads((out / "meta.json").read_text())["max_id"]
    # model=small keeps its own 50304 rows: data.vocab_size is checked for itself.
    cfg = cfg_factory("data=tokens", f"data.path={out}", f"data.vocab_size={top}", "model=small")
    with pytest.raises(ConfigError) as err:
        Data(cfg)
    assert str(err.value).startswith(f"data.vocab_size={top} is not above the data's largest "
                                     f"token id {top}; set data.vocab_size=256")
    with caplog.at_level(logging.WARNING, logger="dxrun"):
        Data(cfg_factory("data=tokens", f"data.path={out}", "data.vocab_size=1281"))
        Data(cfg_factory("data=tokens", f"data.path={out}", "data.vocab_size=1280"))  # 1024 over
        Data(cfg_factory("data=tokens", f"data.path={out}", "model=small"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("model.vocab_size=1281 is far above the data's vocabulary "
                                  f"(256): {(1281 - 256) * 64 * 2:,} parameters")
    assert "model.vocab_size=50304" in warnings[1] and "set data.vocab_size=256" in warnings[1]


@pytest.mark.parametrize("text, says", [('{"vocab_size": 6', "is not valid JSON"),
                                        ("[1, 2]", "holds a JSON list, not an object")])
def test_a_bad_meta_json_is_refused_in_one_line(cfg_factory, tmp_path, text, says):
    np.arange(200, dtype=np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "meta.json").write_text(text)
    cfg = cfg_factory("data=tokens", f"data.path={tmp_path}", "data.vocab_size=256",
                      "data.dtype=uint16", "logger=none")
    with pytest.raises(ConfigError) as e:
        Data(cfg)
    (line,) = str(e.value).splitlines()
    assert line.startswith(f"data.path={tmp_path}: {tmp_path / 'meta.json'} {says}")
    assert line.endswith("or delete it (the token files are then scanned)")
