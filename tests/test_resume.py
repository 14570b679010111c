"""What a resume decides, before anything is written: whose checkpoints it continues (a shared
checkpoint.dir, a requeued warm start), what may change (the optimizer, the batch, the data
workers), what counts as damage, and a relaunch that has nothing to train. Real runs (model=tiny,
a few steps), real Orbax files, real subprocesses where the launcher's part is the point."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import (
    cli_in_process,
    make_cfg,
    run_cli,
    subprocess_env,
    tree_digest,
    write_corpus,
    write_tokens,
)

from dxrun.checkpointing import (
    DATA_SOURCE,
    MODEL_SHAPE,
    VOCABULARY,
    Resume,
    check_compatible,
    committed_steps,
    data_position,
    is_a_given_up_read,
    is_damage,
    locate,
    newest_meta,
    quiet_reads_that_finish_late,
    restore,
    run_id,
)
from dxrun.config.errors import CheckpointReadError, ConfigError
from dxrun.experiment import Experiment
from dxrun.train import prepare, train

SHORT = ["model=tiny", "train.steps=3", "checkpoint.every=1", "train.log_every=1",
         "train.eval_every=0", "logger=none", "parallelism=dp2", "data.batch_size=8"]


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> dict:
    """Run A, its checkpoints under a shared checkpoint.dir. In process (``python -m dxrun``
    runs this same train() after prepare(); the launcher's own part, a relaunch, is
    test_relaunch_that_trains_nothing_leaves_the_run_untouched's): no second Python to start."""
    root = tmp_path_factory.mktemp("shared")
    shared_dir, run_a = root / "ckpts", root / "A"
    train(make_cfg(*SHORT, f"checkpoint.dir={shared_dir}"), run_a)
    return {"root": root, "dir": shared_dir, "A": run_a,
            "A_ckpts": shared_dir / run_id(run_a)}


def test_shared_checkpoint_dir_keeps_each_runs_own(shared):
    a_ckpts = shared["A_ckpts"]
    assert committed_steps(a_ckpts) == [1, 2, 3]
    before = tree_digest(a_ckpts)
    run_b = shared["root"] / "B"
    # Another run on the same checkpoint.dir, another lr, fewer kept: it starts fresh, trains
    # its own steps, and its rotation leaves A's checkpoints alone.
    train(make_cfg(*SHORT, f"checkpoint.dir={shared['dir']}", "optimizer.lr=0.001",
                   "checkpoint.keep=2"), run_b)
    assert _steps(run_b) == [1, 2, 3]
    b_ckpts = shared["dir"] / run_id(run_b)
    assert committed_steps(b_ckpts) == [2, 3]
    assert tree_digest(a_ckpts) == before
    # Each checkpoint names its run; a run dir leads to its checkpoints (evaluate, warm starts).
    for run, ckpts in ((shared["A"], a_ckpts), (run_b, b_ckpts)):
        found = locate(run)
        assert found.directory == ckpts
        step, meta = newest_meta(found)
        assert step == 3 and meta["run_dir"] == str(run.resolve())
        assert meta["run_id"] == run_id(run)


# The README's list ("Refused, with one line naming both values, before anything is written"),
# key by key, with a value each that validates.
REFUSED = {"model.n_layers": "3", "model.d_model": "32", "model.n_heads": "2",
           "model.n_kv_heads": "2", "model.d_ff": "128", "model.max_seq_len": "64",
           "model.bias": "false", "model.norm": "rmsnorm", "model.mlp": "swiglu",
           "model.pos": "rope", "model.tie_embeddings": "true", "model.vocab_size": "128",
           "data.name": "tokens", "data.path": "/elsewhere", "data.tokenizer": "gpt2",
           "data.dtype": "uint32", "data.seq_len": "32", "data.seed": "7", "data.order": "1",
           "data.symbols": "8", "data.branching": "2", "model._target_": "mypkg.Model",
           "model.kwargs": "d_model=32", "data._target_": "mypkg.Data", "data.kwargs": "n=2"}


def test_every_listed_key_is_refused_on_resume(shared):
    """Each key the README lists as fixed, changed alone against run A's checkpoint: one
    ConfigError naming both values; prepare() (what a relaunch runs first) refuses before
    anything is written."""
    assert set(REFUSED) == set(MODEL_SHAPE + VOCABULARY + DATA_SOURCE)  # the README's list is the code's
    where = shared["A_ckpts"] / "3"
    _, meta = newest_meta(locate(shared["A"]))
    now = make_cfg(*SHORT)
    for key, value in REFUSED.items():
        group, name = key.split(".")
        saved = {**meta["config"], group: {**meta["config"][group], name: value}}
        then = saved[group][name]
        with pytest.raises(ConfigError,
                           match=f"^{key}=.* but checkpoint {re.escape(str(where))} was written with "
                                 f"{key}={then} .*resume with {key}={then}, or start fresh"):
            check_compatible(now, saved, where)
    before = tree_digest(shared["root"])
    for change, says in [("model.tie_embeddings=true", "model.tie_embeddings=True but "),
                         ("data.seed=7", "data.seed=7 but "),
                         ("model.norm=rmsnorm", "model.norm=rmsnorm but ")]:
        with pytest.raises(ConfigError, match=f"^{says}checkpoint .* was written with"):
            prepare(make_cfg(*SHORT, f"checkpoint.resume={shared['A']}", "train.steps=5",
                             change), shared["root"] / "new")
    assert tree_digest(shared["root"]) == before and not (shared["root"] / "new").exists()


@pytest.mark.e2e  # a training stopped and resumed against the uninterrupted one
def test_dropout_resumes_exactly(tmp_path):
    """model.dropout > 0: each step's dropout key comes from (seed, step), so a run stopped
    after step 2 and resumed draws step 3's masks, not step 1's again: its steps 3 and 4 are
    bitwise those of the run that never stopped (that dropout changes the numbers at all is
    test_train's). The run is masked diffusion's (model.objective=mdlm, dxrun/model/objectives.py), whose
    token masks are drawn from (seed, step) too, from another seed: one run resumes both."""
    # A constant lr: the schedule follows train.steps, and the split run's first leg has 2.
    drop = [*SHORT, "model.dropout=0.1", "model.objective=mdlm", "train.steps=4",
            "checkpoint.every=2", "optimizer.schedule=constant", "optimizer.warmup_steps=0"]
    train(make_cfg(*drop), tmp_path / "straight")
    train(make_cfg(*drop, "train.steps=2"), tmp_path / "split")
    train(make_cfg(*drop), tmp_path / "split")  # resumes from its step 2
    rows = {run: {r["step"]: r for r in map(json.loads, (tmp_path / run / "metrics.jsonl")
                                             .read_text().splitlines())}
            for run in ("straight", "split")}
    assert sorted(rows["split"]) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in ("train/loss", "train/grad_norm", "train/param_norm"):
            assert rows["split"][step][key] == rows["straight"][step][key], (step, key)
    # each step masked its own tokens, and the resumed steps the uninterrupted run's
    rates = [rows["straight"][s]["train/mask_rate"] for s in (1, 2, 3, 4)]
    assert len(set(rates)) == 4 and rates[2:] == [rows["split"][s]["train/mask_rate"]
                                                  for s in (3, 4)]


def test_relaunch_that_trains_nothing_leaves_the_run_untouched(shared):
    run_a = shared["A"]
    before = tree_digest(shared["root"])
    proc = run_cli(*SHORT, f"checkpoint.dir={shared['dir']}", f"hydra.run.dir={run_a}",
                   "optimizer.lr=0.001", cwd=shared["root"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.startswith("dxrun:")]
    assert len(lines) == 1 and "nothing to train: train.steps=3" in lines[0], proc.stderr
    assert "is at step 3" in lines[0]
    assert tree_digest(shared["root"]) == before  # config, status, summary, checkpoints


@pytest.mark.e2e  # a fine-tune's training and its requeue
def test_requeued_warm_start_continues_its_own_checkpoints(shared, tmp_path, caplog):
    ft = tmp_path / "ft"
    warm = [*SHORT, f"checkpoint.resume={shared['A']}"]
    train(make_cfg(*warm, "train.steps=5"), ft)
    assert _steps(ft) == [4, 5]
    with caplog.at_level(logging.INFO, logger="dxrun"):  # requeued, with a longer schedule
        train(make_cfg(*warm, "train.steps=7"), ft)
    assert f"resuming from step 5 (checkpoint {ft / 'checkpoints' / '5'})" in caplog.text
    assert _steps(ft) == [4, 5, 6, 7]


@pytest.mark.parametrize("change, why", [
    ("optimizer.clip_norm=0", "optimizer.clip_norm=0.0 (was 1.0)"),
    # (momentum=0: the program test_fresh_optimizer_state_trains_on trains, compiled once)
    ("optimizer=sgd optimizer.momentum=0", "optimizer.name=sgd (was adamw)"),
])
def test_changed_optimizer_restores_parameters_with_a_fresh_state(shared, change, why):
    """Decided in prepare() from the checkpoint's tree metadata, before anything is written."""
    cfg = make_cfg(*SHORT, f"checkpoint.resume={shared['A']}", "train.steps=5", *change.split())
    resume = prepare(cfg, shared["root"] / "new").resume
    assert resume.fresh_optimizer is not None and why in resume.fresh_optimizer
    same = make_cfg(*SHORT, f"checkpoint.resume={shared['A']}", "train.steps=5",
                    "optimizer.lr=0.5")
    assert prepare(same, shared["root"] / "new").resume.fresh_optimizer is None


@pytest.mark.e2e  # a resumed training
def test_fresh_optimizer_state_trains_on(shared, tmp_path, caplog):
    run = tmp_path / "run"
    cfg = make_cfg(*SHORT, f"checkpoint.resume={shared['A']}", "train.steps=5",
                   "optimizer=sgd", "optimizer.momentum=0")
    with caplog.at_level(logging.INFO, logger="dxrun"):
        train(cfg, run)
    assert "fresh optimizer state" in caplog.text and "corrupt" not in caplog.text
    assert _steps(run) == [4, 5]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["train/loss"]) for r in rows)
    # The parameters came from A's step 3: the first step's loss is A's level, not the init's.
    first_a = json.loads((shared["A"] / "metrics.jsonl").read_text().splitlines()[0])
    assert rows[0]["train/loss"] < first_a["train/loss"]


# The reads still in flight when a damaged checkpoint's read fails finish after Orbax closed
# its event loop: no "Event loop is closed" traceback for each of them (checkpoint.py).
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_only_damage_sets_a_checkpoint_aside(shared, tmp_path):
    ckpts = tmp_path / "ckpts"
    shutil.copytree(shared["A_ckpts"], ckpts)
    exp = Experiment.build(make_cfg(*SHORT))
    target = exp.abstract_state()
    # A tree that does not fit (another optimizer) is no damage: one line, the files stay.
    sgd = Experiment.build(make_cfg(*SHORT, "optimizer=sgd")).abstract_state()
    before = tree_digest(ckpts)
    with pytest.raises(CheckpointReadError, match="is left as it is"):
        restore(Resume(ckpts, None, in_place=True), sgd)
    assert tree_digest(ckpts) == before
    # Truncated array files are damage: the one before, and the damaged one set aside.
    for f in (ckpts / "3" / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d" and f.stat().st_size > 64:
            with open(f, "r+b") as fh:
                fh.truncate(f.stat().st_size // 2)
    state, _, step = restore(Resume(ckpts, None, in_place=True), target)
    assert step == 2 and (ckpts / "3.corrupt").is_dir()
    assert committed_steps(ckpts) == [1, 2]
    assert not is_damage(MemoryError()) and not is_damage(OSError(5, "EIO"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


def _text(corpus: Path, *extra: str) -> list[str]:
    return [*SHORT, "data=text", f"data.path={corpus}", "data.seq_len=16", *extra]


@pytest.mark.e2e  # a training, then its resume
def test_workers_and_batch_may_change_and_tokens_are_counted(corpus, tmp_path):
    """Saved with data.workers=0, resumed with 1 and a doubled batch: the position carries over
    and data/tokens_seen counts the tokens read, not steps x the new batch."""
    run = tmp_path / "run"
    train(make_cfg(*_text(corpus, "data.workers=0")), run)
    cfg = make_cfg(*_text(corpus, "data.workers=1", "train.steps=5", "data.batch_size=16",
                          "checkpoint.allow_batch_change=true"))
    prepare(cfg, run)  # the data position is decided here, before anything is written
    train(cfg, run)
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert rows[3]["data/tokens_seen"] == 3 * 8 * 16
    assert rows[4]["data/tokens_seen"] == 3 * 8 * 16 + 16 * 16
    assert rows[5]["data/tokens_seen"] == 3 * 8 * 16 + 2 * 16 * 16
    _, meta = newest_meta(locate(run))
    assert meta["data"] == {"next_index": 3 * 8 // 16 + 2}  # same tokens, then 2 batches
    assert meta["tokens_seen"] == rows[5]["data/tokens_seen"]


def test_grain_state_of_any_worker_count_resumes_the_same_position(corpus):
    nested = {"next_index_in_cycle": 1, "next_index_in_datasets": 2,
              "iterators_in_use_indices": [0, 1],
              "iterators_in_use_states": [{"next_index": 3}, {"next_index": 2}],
              "exhausted": [0, 0], "future_states": {}}  # mp_prefetch, 2 workers, 5 batches
    meta = {"data": nested, "config": {"data": {"batch_size": 8}}}
    assert data_position(meta, 8) == {"next_index": 5}
    assert data_position(meta, 16) == {"next_index": 2}
    from dxrun.data import Data

    want = Data(make_cfg(*_text(corpus))).local_batch(5)
    for workers in (0, 1):
        it = Data(make_cfg(*_text(corpus, f"data.workers={workers}"))).train_iterator()
        it.set_state(data_position(meta, 8))
        np.testing.assert_array_equal(next(it), want)
        assert it.get_state() == {"next_index": 6}
        it.close()


@pytest.mark.e2e
@pytest.mark.parametrize("data", ["text", "tokens"])
def test_a_corpus_run_resumes_at_its_readers_position(corpus, tmp_path, data):
    """A data=text / data=tokens run continued from its step-2 checkpoint in a new run dir:
    Grain's position comes back from the checkpoint, so steps 3 and 4 read the batches the run
    that went on read there, and their numbers are bitwise its own (a reader started from its
    beginning again would train on steps 1 and 2's batches)."""
    path = corpus if data == "text" else write_tokens(tmp_path / "corpus", val_batches=1)
    run = [*SHORT, f"data={data}", f"data.path={path}", "data.seq_len=16", "train.steps=4",
           "checkpoint.every=2"]
    train(make_cfg(*run), tmp_path / "straight")
    step2 = tmp_path / "straight" / "checkpoints" / "2"
    _, meta = newest_meta(Resume(step2.parent, 2, in_place=False))
    assert meta["data"] == {"next_index": 2}  # the reader's position, in the checkpoint
    train(make_cfg(*run, f"checkpoint.resume={step2}"), tmp_path / "resumed")
    rows = {name: {r["step"]: r for r in map(json.loads, (tmp_path / name / "metrics.jsonl")
                                              .read_text().splitlines())}
            for name in ("straight", "resumed")}
    assert sorted(rows["resumed"]) == [3, 4]
    for step in (3, 4):
        for key in ("train/loss", "train/grad_norm", "train/param_norm"):
            assert rows["resumed"][step][key] == rows["straight"][step][key], (step, key)


def _children(pid: int) -> set[int]:
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.e2e  # a subprocess run, killed
def test_grain_workers_end_with_a_killed_run(corpus, tmp_path):
    env = subprocess_env()
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dxrun", *_text(corpus, "data.workers=1", "train.steps=100000",
                                               "checkpoint.every=0"), f"hydra.run.dir={run}"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        workers = _children(proc.pid)
        assert workers, "no Grain worker process found"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in workers if _alive(p)]
    for p in left:  # never leave them behind, even when the test fails
        os.kill(p, signal.SIGKILL)
    assert not left, f"Grain workers outlived their run: {left}"


def test_damaged_meta_is_found_before_restore(shared, tmp_path):
    """prepare() reads the meta and the tree metadata of the newest step; a damaged one is
    named there, skipped by the restore and set aside after it."""
    ckpts = tmp_path / "ckpts"
    shutil.copytree(shared["A_ckpts"], ckpts)
    (ckpts / "3" / "meta" / "metadata").write_text('{"trunc')
    resume = Resume(ckpts, None, in_place=True)
    step, _ = newest_meta(resume, check_state=True)
    assert step == 2 and resume.damaged == [3]
    exp = Experiment.build(make_cfg(*SHORT))
    state, _, got = restore(resume, exp.abstract_state())
    assert got == 2 and (ckpts / "3.corrupt").is_dir()
    assert int(jax.device_get(state.step)) == 2


@pytest.mark.e2e
def test_processes_agree_on_a_step_one_of_them_cannot_read(tmp_path):
    """fsdp over 2 processes: each reads only its own shards. Process 1's shards of step 3 are
    truncated; both processes continue from step 2 and process 0 alone sets step 3 aside.
    One device a process (fsdp=2): each still holds only its own shards, and its startup and
    compile are cheaper than on four."""
    env = subprocess_env()

    def launch(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "dxrun.launch", "--nproc", "2", "--devices-per-proc", "1",
             "--", "runtime.compile_cache=null", "model=tiny", "parallelism=fsdp8",
             "parallelism.fsdp=2",
             "data.batch_size=16", "checkpoint.every=1", "train.log_every=1",
             "train.eval_every=0", "logger=none", "hydra.run.dir=run", *extra],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    first = launch("train.steps=3")
    assert first.returncode == 0, first.stderr[-3000:]
    step3 = tmp_path / "run" / "checkpoints" / "3"
    shards = [f for f in (step3 / "state" / "ocdbt.process_1").rglob("*")
              if f.is_file() and f.parent.name == "d" and f.stat().st_size > 64]
    assert shards
    for f in shards:
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size // 2)
    second = launch("train.steps=4")
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert "resuming from step 2" in out and "FileNotFoundError" not in out
    assert "Traceback" not in out, out[out.find("Traceback") - 2000:][:3000]  # one line says it
    assert (step3.parent / "3.corrupt").is_dir()
    assert committed_steps(step3.parent) == [2, 3, 4]  # 3 saved anew, keep=3
    assert _steps(tmp_path / "run") == [1, 2, 3, 4]



def test_a_given_up_orbax_read_is_not_reported_as_unraisable():
    """The coroutine of an Orbax array read that nobody awaits any more (another read's failure
    came out of the restore first) raises its own failure again when collected: not reported.
    An unraisable exception raised anywhere else still is."""
    import types

    orbax_read: dict = {}  # a function whose frame is Orbax's serialization module
    exec(compile("def _read_array_index_and_device_put():\n    raise Exception('truncated')\n",
                 "/site-packages/orbax/checkpoint/_src/serialization/serialization.py", "exec"),
         orbax_read)

    def elsewhere():
        raise ValueError("not a read")

    def unraisable(fail) -> types.SimpleNamespace:
        try:
            fail()
        except Exception as e:  # noqa: BLE001
            return types.SimpleNamespace(exc_value=e, exc_traceback=e.__traceback__)
        raise AssertionError("did not raise")

    assert is_a_given_up_read(unraisable(orbax_read["_read_array_index_and_device_put"]))
    assert not is_a_given_up_read(unraisable(elsewhere))


def test_a_given_up_orbax_read_is_not_logged_by_asyncio(caplog):
    """The same failure as a task nobody awaited: asyncio's "Task exception was never retrieved"
    is not logged for an Orbax read once a restore has installed the filter; for any other
    failure it still is."""
    import asyncio
    import gc
    import logging

    orbax_read: dict = {}
    exec(compile("async def _read_array_index_and_device_put():\n    raise Exception('cut')\n",
                 "/site-packages/orbax/checkpoint/_src/serialization/serialization.py", "exec"),
         orbax_read)

    async def elsewhere():
        raise ValueError("not a read")

    def never_awaited(coroutine) -> None:
        loop = asyncio.new_event_loop()
        task = loop.create_task(coroutine())
        loop.run_until_complete(asyncio.sleep(0.01))  # the task fails; nobody asks why
        del task
        gc.collect()
        loop.close()

    quiet_reads_that_finish_late()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        never_awaited(orbax_read["_read_array_index_and_device_put"])
        assert not caplog.records
        never_awaited(elsewhere)
        assert [r.getMessage().splitlines()[0] for r in caplog.records] == [
            "Task exception was never retrieved"]


@pytest.mark.e2e  # a run, then a relaunch through the CLI (status.json is the launcher's)
def test_damaged_bookkeeping_is_set_aside_and_the_resume_goes_on(tmp_path):
    """status.json cut short, goodput.json malformed, a file named .hydra (where the run keeps
    its lock and configs), one byte of metrics.jsonl that is not UTF-8, and the newest
    checkpoint's meta without its data position: each is set aside with one warning, and the
    relaunch resumes in the same run dir from the checkpoint before (a .hydra file once made the
    relaunch fail and the next one train from step 0 in a sibling dir)."""
    run = tmp_path / "run"
    train(make_cfg(*SHORT), run)
    (run / ".hydra").write_text("not a dir\n")
    (run / "status.json").write_text('{"status": "ok", "star')  # a write cut short
    (run / "goodput.json").write_text('{"attempts": [{"wall_s": "soon"}]}')
    lines = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    lines[0] = lines[0].replace(b'"step"', b'"st\xffep"')
    (run / "metrics.jsonl").write_bytes(b"".join(lines))
    meta_file = run / "checkpoints" / "3" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    del meta["data"]
    meta_file.write_text(json.dumps(meta))
    proc = run_cli(*SHORT, "train.steps=5", f"hydra.run.dir={run}", cwd=tmp_path, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no sibling dir
    for name in ("status.json", "goodput.json", ".hydra"):
        assert len(re.findall(rf"{run / name} is damaged \(.*\); moved it to {name}.damaged", out)) == 1
    assert f"checkpoint {run / 'checkpoints' / '3'} is incomplete or corrupt (IncompleteMeta: " \
        "its meta has no data); using the one before" in out
    assert "moved 1 metrics rows after step 2 and 1 line(s) cut short or damaged" in out
    assert f"resuming from step 2 (checkpoint {run / 'checkpoints' / '2'})" in out
    assert _steps(run) == [2, 3, 4, 5]
    assert (run / "metrics.discarded.jsonl").read_bytes().splitlines()[0] == lines[0].rstrip()
    assert (run / "status.json.damaged").read_text() == '{"status": "ok", "star'
    assert (run / ".hydra.damaged").read_text() == "not a dir\n"
    assert (run / ".hydra" / "attempts" / "1" / "config.yaml").is_file()
    assert json.loads((run / "status.json").read_text())["status"] == "ok"
    assert json.loads((run / "goodput.json").read_text())["attempts"][0]["first_step"] == 2
    assert (run / "checkpoints" / "3.corrupt").is_dir()
    assert committed_steps(run / "checkpoints") == [3, 4, 5]
    # dxrun.evaluate appends to eval.json: a damaged one is set aside, not a crash.
    from dxrun.evaluate import evaluate_checkpoint

    (run / "eval.json").write_bytes(b'[{"step": 3, "eval/loss": \xff')
    evaluate_checkpoint(run, [])
    assert [r["step"] for r in json.loads((run / "eval.json").read_text())] == [5]
    assert (run / "eval.json.damaged").read_bytes().endswith(b"\xff")


def _own_copy_of_a(shared: dict, run: Path) -> Path:
    """Run A as a run dir of its own: its files, and its checkpoints in ``<run>/checkpoints``
    (no checkpoint.dir), as a run trained without one leaves them."""
    shutil.copytree(shared["A"], run, ignore=shutil.ignore_patterns("checkpoints.txt"))
    shutil.copytree(shared["A_ckpts"], run / "checkpoints")
    return run


def _warnings(out: str, about: str) -> list[str]:
    """The messages of dxrun's warnings in ``out`` that mention ``about``."""
    return [x.split(" - ", 1)[1] for x in out.splitlines()
            if "[dxrun][WARNING]" in x and about in x]


def test_a_checkpoint_whose_meta_holds_a_wrong_type_is_set_aside(shared, tmp_path):
    """A meta that a resume cannot read (``"data": {"step": "abc"}``) is a damaged checkpoint:
    the relaunch (through the entry point, as ``python -m dxrun``) says so once, resumes from
    the one before and sets the damaged one aside, instead of failing in the same way every
    time."""
    run = _own_copy_of_a(shared, tmp_path / "run")
    meta_file = run / "checkpoints" / "3" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["data"] = {"step": "abc"}
    meta_file.write_text(json.dumps(meta))
    proc = cli_in_process(*SHORT, "train.steps=4", f"hydra.run.dir={run}", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "ValueError" not in out
    ckpts = run / "checkpoints"
    # every warning naming a checkpoint dir (a loaded machine adds the saves' cost warning)
    assert _warnings(out, str(ckpts)) == [
        f"checkpoint {ckpts / '3'} is incomplete or corrupt (IncompleteMeta: its meta's "
        "data.step is 'abc', not a whole number); using the one before",
        f"moved the damaged checkpoint {ckpts / '3'} to {ckpts / '3.corrupt'}"]
    assert f"resuming from step 2 (checkpoint {ckpts / '2'})" in out
    assert json.loads((ckpts / "3.corrupt" / "meta" / "metadata").read_text())["data"] == {
        "step": "abc"}  # kept as it was
    assert committed_steps(ckpts) == [2, 3, 4] and _steps(run) == [1, 2, 3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.e2e  # a training, then its resume
def test_a_moved_run_dir_resumes_from_its_checkpoint_dir(tmp_path):
    """With ``checkpoint.dir`` the checkpoints' subdir is named from the run dir's path at its
    first save; a run dir moved since finds them through its checkpoints.txt, resumes them in
    place and saves on beside them. A copy of a run dir whose original is still there is
    refused (the two would rotate each other's checkpoints away)."""
    ckpts = tmp_path / "ckpts"
    at = [*SHORT, f"checkpoint.dir={ckpts}"]
    train(make_cfg(*at, "train.steps=2"), tmp_path / "A")
    (own,) = ckpts.iterdir()
    shutil.move(tmp_path / "A", tmp_path / "B")
    prepared = prepare(make_cfg(*at), tmp_path / "B")
    assert prepared.resume is not None and prepared.resume.in_place
    assert prepared.resume.directory == own and prepared.resume.meta_step == 2
    train(prepared.exp.cfg, tmp_path / "B", prepared=prepared)
    assert _steps(tmp_path / "B") == [1, 2, 3]
    assert list(ckpts.iterdir()) == [own] and committed_steps(own) == [1, 2, 3]
    shutil.copytree(tmp_path / "B", tmp_path / "C")
    with pytest.raises(ConfigError, match=f"^checkpoints {re.escape(str(own))} belong to run "
                                          f"dir {re.escape(str((tmp_path / 'B').resolve()))}"):
        prepare(make_cfg(*at, "train.steps=4"), tmp_path / "C")


@pytest.mark.e2e  # a training, then its resume on another mesh
def test_an_auto_run_resumes_on_fewer_devices(tmp_path, caplog):
    """Resume on any mesh, ``parallelism=auto`` too: trained on dp8, relaunched on 4 devices, the
    run says in one line that the checkpoint's layout does not fit and chooses again as a new
    run would (3 steps: its start, dp4); the checkpoint is resharded onto it. Relaunched on 4
    devices again, the checkpoint's layout (dp4) is kept."""
    auto = [*(x for x in SHORT if x != "parallelism=dp2"), "parallelism=auto", "train.steps=2"]
    train(make_cfg(*auto), tmp_path / "run")
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["mesh_shape"] == [8, 1, 1, 1, 1]
    with caplog.at_level(logging.INFO, logger="dxrun"):
        prepared = prepare(make_cfg(*auto, "train.steps=3", "parallelism.n_devices=4"),
                           tmp_path / "run")
    (said,) = [r.getMessage() for r in caplog.records if "checkpoint's layout" in r.getMessage()]
    assert said.startswith("parallelism=auto: the checkpoint's layout dp8 does not fit this run "
                           "(its 8 devices are not this run's 4); choosing again")
    plan = prepared.exp.plan
    assert (plan.dp, plan.fsdp, plan.tp, plan.n_devices) == (4, 1, 1, 4)
    assert prepared.resume.meta_step == 2
    train(prepared.exp.cfg, tmp_path / "run", prepared=prepared)
    assert _steps(tmp_path / "run") == [1, 2, 3]
    kept = prepare(make_cfg(*auto, "train.steps=4", "parallelism.n_devices=4"), tmp_path / "run")
    assert kept.plan.search["search"] == "resume"
    assert (kept.exp.plan.dp, kept.exp.plan.n_devices) == (4, 4)
