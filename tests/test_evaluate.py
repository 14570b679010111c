"""``python -m dxrun.evaluate``: a finished run's checkpoint scored again, on its own mesh (bitwise
the run's last in-training evaluation) and on another (to 1e-5), its W&B run continued, its
training files untouched."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys

import pytest
from conftest import (
    MARKOV_STEPS,
    finished_wandb_run,
    make_cfg,
    run_digest,
    subprocess_env,
    tree_digest,
    write_tokens,
)

from dxrun.config.errors import ConfigError
from dxrun.evaluate import evaluate_checkpoint


def _evaluate_cli(*args: str) -> subprocess.CompletedProcess:
    env = subprocess_env()
    return subprocess.run([sys.executable, "-m", "dxrun.evaluate", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)


def _last_eval(run_dir) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/loss" in r][-1]


@pytest.mark.e2e  # trains a run, then the tool on it: end to end
def test_evaluate_equals_in_training_eval_on_any_mesh(markov_run):
    want = _last_eval(markov_run)
    before = run_digest(markov_run)
    out = _evaluate_cli(markov_run)  # the run's own mesh (parallelism=dp2), its W&B run
    assert out.returncode == 0, out.stderr[-3000:]
    (rec,) = json.loads((markov_run / "eval.json").read_text())
    assert rec["step"] == want["step"] == MARKOV_STEPS and rec["mesh"] == {"data": 2, "fsdp": 1,
                                                                   "tensor": 1}
    # Bitwise: the same params, batches and jitted evaluation as in training.
    assert rec["eval/loss"] == want["eval/loss"] and rec["eval/accuracy"] == want["eval/accuracy"]
    assert rec["eval/ppl"] == want["eval/ppl"]
    assert rec["eval/tokens"] == 4 * 32 * 32  # eval.batches x data.batch_size x data.seq_len
    assert f"eval/loss {want['eval/loss']:.4f}" in out.stdout
    # Training files untouched: every file the run had is byte-identical.
    after = run_digest(markov_run)
    assert {k: after.get(k) for k in before} == before
    # The run's own W&B run (same id) got eval/* at the checkpoint's step.
    runs = [finished_wandb_run(p) for p in markov_run.glob("wandb/offline-run-*/run-*.wandb")]
    assert len(runs) == 2 and runs[0]["id"] == runs[1]["id"]
    logged = [h for r in runs for h in r["history"] if "eval/tokens" in h]
    assert logged == [{**{k: rec[k] for k in ("eval/loss", "eval/ppl", "eval/accuracy",
                                              "eval/tokens")}, "step": MARKOV_STEPS, **{
        k: v for k, v in logged[0].items() if k.startswith("_")}}]

    # Another mesh (tensor parallel, in process): the same numbers to 1e-5.
    other = evaluate_checkpoint(markov_run / "checkpoints", ["parallelism=dp2_tp4",
                                                             "logger=none"])
    assert other["mesh"] == {"data": 2, "fsdp": 1, "tensor": 4}
    assert abs(other["eval/loss"] - want["eval/loss"]) <= 1e-5 * want["eval/loss"]
    assert abs(other["eval/accuracy"] - want["eval/accuracy"]) <= 1e-5
    assert len(json.loads((markov_run / "eval.json").read_text())) == 2  # appended


@pytest.mark.e2e  # reads the session's trained markov run, the tool as a subprocess
def test_evaluate_takes_the_devices_it_finds(markov_run, tmp_path):
    """The dp2 run scored where one device is visible (``runtime.cpu_devices=1``, as on a host
    with one accelerator): its layout does not fit, so the tool lays the checkpoint out on the
    device it finds, says so in one line, and gets the run's own loss to 1e-5. A copy (without
    its W&B files and the other tests' eval.json) takes the record."""
    run = tmp_path / "run"
    shutil.copytree(markov_run, run, ignore=shutil.ignore_patterns("wandb", "eval.json"))
    want = _last_eval(markov_run)  # dp2's, bitwise the tool's on dp2 (the test above)
    out = _evaluate_cli(run, "runtime.cpu_devices=1", "logger=none")
    assert out.returncode == 0, out.stderr[-3000:]
    (rec,) = json.loads((run / "eval.json").read_text())
    assert rec["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1} and rec["step"] == want["step"]
    assert abs(rec["eval/loss"] - want["eval/loss"]) <= 1e-5 * want["eval/loss"]
    assert abs(rec["eval/accuracy"] - want["eval/accuracy"]) <= 1e-5
    (said,) = [line for line in out.stderr.splitlines() if "does not fit" in line]
    assert said.startswith("the run's parallelism=dp2 does not fit here") and "on dp=1" in said


@pytest.mark.e2e  # trains a run, then the tool on it: end to end
def test_what_evaluate_cannot_score_is_refused(markov_run):
    """A model shape other than the checkpoint's (alone, or through another model preset),
    eval.batches=all on markov's endless held-out stream and a layout asked for that the devices
    cannot hold: one ConfigError naming the key and the fix (the CLI's one line and exit 2), and
    nothing written."""
    before = run_digest(markov_run)
    ckpt = re.escape(str(markov_run / "checkpoints" / str(MARKOV_STEPS)))
    for overrides, says in [
        (["model.n_layers=3"], f"^model.n_layers=3 but checkpoint {ckpt} was written with "
                               r"model.n_layers=2 \(a checkpoint's model shape is fixed\); drop "
                               "the model.n_layers override$"),
        (["model=tiny_llama"], "^model.n_kv_heads=2 but checkpoint .* drop the model.n_kv_heads "
                               "override$"),
        (["model.d_ff=128"], "^model.d_ff=128 but checkpoint .* drop the model.d_ff override$"),
        (["eval.batches=all"], "^eval.batches=all: data=markov has an endless held-out stream; "
                               "give a number, e.g. eval.batches=16$"),
        # A layout asked for is never replaced by one that fits: refused, here (a process
        # whose JAX had started: runtime.cpu_devices cannot act) with what works.
        (["parallelism.n_devices=16"], r"^parallelism=dp2 needs 16 devices but JAX had started "
                                       r"in this process with 8 cpu devices, .*; load the model "
                                       r"before anything else starts JAX, or start Python with "
                                       r"XLA_FLAGS=--xla_force_host_platform_device_count=16$"),
    ]:
        with pytest.raises(ConfigError, match=says):
            evaluate_checkpoint(markov_run, overrides)
    assert run_digest(markov_run) == before


@pytest.mark.e2e  # trains a run, then the tool on it: end to end
def test_evaluate_whole_held_out_split_of_a_corpus(text_run):
    rec = evaluate_checkpoint(text_run, ["eval.batches=all"])
    n_tokens = len((text_run.parent / "corpus.txt").read_bytes()) + 1  # + end-of-text
    windows = (int(n_tokens * 0.05) - 1) // 32  # the held-out tail in windows of seq_len
    assert rec["batches"] == windows // 16 >= 2  # every full batch of data.batch_size=16
    assert rec["eval/tokens"] == rec["batches"] * 16 * 32
    assert rec["data"]["path"] == str(text_run.parent / "corpus.txt")
    # Its first 4 batches are training's: scored alone they give training's number, bitwise.
    first4 = evaluate_checkpoint(text_run, ["eval.batches=4"])
    assert first4["eval/loss"] == _last_eval(text_run)["eval/loss"]


@pytest.mark.e2e  # the text run's checkpoint: scored on more than its split holds
def test_an_evaluation_reads_no_held_out_window_twice(text_run, caplog):
    n_tokens = len((text_run.parent / "corpus.txt").read_bytes()) + 1
    windows = (int(n_tokens * 0.05) - 1) // 32
    whole = evaluate_checkpoint(text_run, ["eval.batches=all"])
    with caplog.at_level(logging.WARNING, logger="dxrun"):
        asked = evaluate_checkpoint(text_run, ["eval.batches=1000"])  # capped, said once
    (said,) = [r.getMessage() for r in caplog.records]
    assert said == (f"eval.batches=1000: the held-out split holds {windows} windows of "
                    f"data.seq_len=32, {windows // 16} batches of 16: each evaluation reads "
                    f"those, no window twice; lower eval.batches to {windows // 16} to silence "
                    "this")
    assert asked["batches"] == whole["batches"] == windows // 16
    assert asked["eval/loss"] == whole["eval/loss"]
    assert asked["eval/tokens"] == windows // 16 * 16 * 32
    # A split smaller than one batch: one batch, its windows repeated, each counted once.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dxrun"):
        one = evaluate_checkpoint(text_run, ["data.batch_size=64"])
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith(f"eval.batches=4: the held-out split holds {windows} windows of "
                           "data.seq_len=32, fewer than one batch of 64: each evaluation reads 1 "
                           f"batch, in which windows repeat; eval/* is over those {windows} ")
    assert one["batches"] == 1 and one["eval/tokens"] == windows * 32
    # eval.batches=all reads that split as a number does (it was refused: "fewer than one batch").
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dxrun"):
        every = evaluate_checkpoint(text_run, ["eval.batches=all", "data.batch_size=64"])
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith(f"eval.batches=all: the held-out split holds {windows} windows of "
                           "data.seq_len=32, fewer than one batch of 64: each evaluation reads 1 ")
    assert (every["batches"], every["eval/loss"]) == (1, one["eval/loss"])


@pytest.mark.e2e  # a training, then hundreds of eval batches
def test_hundreds_of_eval_batches_on_8_cpu_devices_never_deadlock(tmp_path, caplog):
    # XLA:CPU deadlocks when the host dispatches ~32+ programs ahead of 8 simulated devices:
    # 200 held-out batches, in training and in dxrun.evaluate, must each run to the end. In
    # process (the bound is step.InFlight's, the same under the CLI; the CLI's own exit code and
    # output are test_evaluate_equals_in_training_eval_on_any_mesh's): no two interpreter starts.
    # eval.batches=250 asks for more than the split's 200: training reads those 200, no window
    # twice (as eval.batches=all below), and says so once.
    from dxrun.train import train

    corpus = write_tokens(tmp_path / "corpus", val_batches=200)
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="dxrun"):
        train(make_cfg("data=tokens", f"data.path={corpus}", "data.seq_len=8",
                       "data.batch_size=8", "train.steps=2", "train.eval_every=2",
                       "eval.batches=250", "checkpoint.every=2", "logger=none"), run_dir)
    (said,) = [r.getMessage() for r in caplog.records if "eval.batches" in r.getMessage()]
    assert said.startswith("eval.batches=250: the held-out split holds 1600 windows of "
                           "data.seq_len=8, 200 batches of 8: each evaluation reads those")
    want = _last_eval(run_dir)
    assert want["step"] == 2 and 3.5 < want["eval/loss"] < 5  # ~ln(65) for random ids
    evaluate_checkpoint(run_dir, ["eval.batches=all"])
    (rec,) = json.loads((run_dir / "eval.json").read_text())
    assert rec["batches"] == 200 and rec["eval/tokens"] == 200 * 8 * 8
    assert rec["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}
    # The whole split is training's 200 batches: the same number, bitwise.
    assert rec["eval/loss"] == want["eval/loss"] and rec["eval/accuracy"] == want["eval/accuracy"]


@pytest.mark.e2e  # a training, then its evaluation
def test_a_shared_checkpoint_dir_gets_no_results(tmp_path):
    # checkpoint.dir elsewhere (a shared dir): eval.json and the W&B log go to the run dir
    # given; a step dir of the shared dir, outside any run dir, gets its result printed only.
    # The mesh and shapes of the test above (dp over 8, 8 x 8 tokens of 65 ids): its train and
    # eval steps come from the session's compile cache.
    from dxrun.train import train

    corpus = write_tokens(tmp_path / "corpus", val_batches=2)
    run_dir, shared = tmp_path / "runs" / "a", tmp_path / "shared"
    train(make_cfg("data=tokens", f"data.path={corpus}", "data.seq_len=8", "data.batch_size=8",
                   "train.steps=1", "train.eval_every=0", "eval.batches=2",
                   "checkpoint.every=1", f"checkpoint.dir={shared}"), run_dir)
    (step_dir,) = [p for p in shared.rglob("1") if (p / "state").is_dir()]
    (trained,) = [finished_wandb_run(p) for p in run_dir.glob("wandb/offline-run-*/run-*.wandb")]
    # (W&B's own debug logs are links to the newest W&B process's, not the run's files.)
    files = lambda: {k: v for k, v in tree_digest(tmp_path).items()
                     if not (k.endswith(".log") or "latest-run" in k)}
    before = files()
    printed = evaluate_checkpoint(step_dir, [])
    assert printed["step"] == 1 and files() == before  # nothing written
    rec = evaluate_checkpoint(run_dir, [])  # its checkpoints.txt leads to the shared dir
    assert rec["eval/loss"] == printed["eval/loss"]
    assert json.loads((run_dir / "eval.json").read_text()) == [rec]
    assert not [p for p in tmp_path.rglob("*") if p.name in ("eval.json", "wandb")
                and p.parent != run_dir]
    runs = [finished_wandb_run(p) for p in run_dir.glob("wandb/offline-run-*/run-*.wandb")]
    assert {r["id"] for r in runs} == {trained["id"]}  # the run's own W&B run, continued
    assert [h["eval/loss"] for r in runs for h in r["history"] if "eval/tokens" in h] == [
        rec["eval/loss"]]


@pytest.mark.e2e  # reads the session's trained markov run
def test_a_copied_or_moved_run_gets_its_own_results(markov_run, tmp_path):
    """eval.json goes to the run dir given, never to the one the checkpoint recorded: the
    original run is untouched, and a moved run keeps its results."""
    original = run_digest(markov_run)
    copy = tmp_path / "copy"
    shutil.copytree(markov_run, copy)
    had = json.loads((copy / "eval.json").read_text()) if (copy / "eval.json").is_file() else []
    rec = evaluate_checkpoint(copy, ["logger=none"])
    assert json.loads((copy / "eval.json").read_text()) == [*had, rec]
    step = str(MARKOV_STEPS)
    assert rec["step"] == MARKOV_STEPS and rec["checkpoint"] == str(copy / "checkpoints" / step)
    moved = tmp_path / "moved"
    copy.rename(moved)
    again = evaluate_checkpoint(moved / "checkpoints" / step, ["logger=none"])
    assert json.loads((moved / "eval.json").read_text()) == [*had, rec, again]
    assert again["eval/loss"] == rec["eval/loss"]
    assert not copy.exists() and run_digest(markov_run) == original
