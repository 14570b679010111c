"""Test setup: 8 simulated CPU devices (set before JAX is imported), offline W&B, and config
composition through Hydra's compose API exactly as the launcher does.

The suite runs on the CPU platform even on a GPU machine (JAX_PLATFORMS=cpu, which every
subprocess a test starts inherits): on GPUs it would run with TF32 matmuls and 75% of the memory
preallocated per process, so numbers and memory would not be what the tests assert.
DXRUN_TEST_GPU=1 leaves the platform to JAX."""

from __future__ import annotations

import os

from dxrun.run import simulate_cpu_devices

if os.environ.get("DXRUN_TEST_GPU") != "1":
    os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX is imported: it reads this once
# Before anything imports jax. glibc's allocator as it comes (reuse=False): what
# runtime.reuse_freed_memory=auto gives a run of the suite's shapes (runtime.reuse_pays), whose
# buffers are too small to pay for one malloc arena's lock, which every compile thread and
# simulated device takes. The suite is mostly compiles of such programs: test_model.py,
# test_chunked_loss.py, test_shard_optimizer.py and test_vocab_padding.py took 111-119 CPU s
# in one process against 136-144 under the one arena (2026-12-06, alternating). The setting
# itself: test_runtime.py, in a process of its own.
simulate_cpu_devices(8, reuse=False)
# XLA:CPU's code generation made cheap, here and in every subprocess a test starts
# (``subprocess_env``): the suite's programs are tiny and run a few steps, so code generation
# was most of their compile. LLVM's optimisation off, and XLA:CPU's older fusion emitters
# instead of its MLIR ones, which were most of what was left, and the code generated in one
# piece, not split for threads the other worker needs (docs/tests.md has the commands). The
# optimised HLO, its buffer assignment, cost analysis and collectives are settled before code
# generation and are what the tests read (one difference: without the MLIR emitters XLA expands
# a scatter into a loop); the numbers a test compares come from programs compiled alike.
# DXRUN_TEST_LLVM_OPT=1 compiles as a user's run does.
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
                " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1")
if os.environ.get("DXRUN_TEST_LLVM_OPT") != "1":
    os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {FAST_COMPILE}"
# Forced, not defaulted: an exported WANDB_MODE=online (or HYDRA_FULL_ERROR=1) would send the
# W&B tests to a server and put tracebacks where the tests read one-line errors.
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_ERROR_REPORTING"] = "false"
os.environ["WANDB_SILENT"] = "true"
os.environ["HYDRA_FULL_ERROR"] = "0"

# One persistent XLA compilation cache for the whole session, in process and in every
# subprocess a test starts (``runtime.compile_cache=auto`` is ``$XDG_CACHE_HOME/dxrun/jax``):
# the many runs of the same small configs compile each program once. A fresh directory per
# session unless DXRUN_TEST_CACHE names one, so a session never reads programs an older JAX or
# dxrun wrote and its time is a fresh clone's (DXRUN_TEST_CACHE=~/.cache/dxrun-tests keeps
# one across sessions: a faster inner loop). Subprocesses inherit the variable. A test that
# counts compiles counts each cache hit as the compile it replaces (test_train.py).
import atexit
import shutil
import tempfile

if not os.environ.get("DXRUN_TEST_CACHE"):
    os.environ["DXRUN_TEST_CACHE"] = tempfile.mkdtemp(prefix="dxrun-tests-cache-")
    atexit.register(shutil.rmtree, os.environ["DXRUN_TEST_CACHE"], ignore_errors=True)
os.environ["XDG_CACHE_HOME"] = os.environ["DXRUN_TEST_CACHE"]
# Every program into the cache, not only those that took dxrun's 0.5 s to compile: the suite's
# fast compiles fall under it, and most are compiled again by another test or subprocess.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import contextlib
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from dxrun.config.registry import register
from dxrun.run import collect_cycles_rarely, enable_compile_cache, freeze_imported

# The collector's thresholds of a dxrun command's process, for the tests that trace and compile
# in this one.
collect_cycles_rarely()

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
register()


def pytest_collection_finish(session):
    """The test modules imported (JAX, Flax, dxrun): frozen out of the collector's sight as a
    command freezes its imports (``runtime.freeze_imported``), here at a point of the suite's
    choosing rather than inside the first in-process run."""
    freeze_imported()


@pytest.fixture(scope="session", autouse=True)
def compile_cache():
    """The session's cache in this process too, as ``python -m dxrun`` sets it (a fixture, not
    at import: the multi-process workers that import this file leave the cache alone)."""
    return enable_compile_cache("auto")


# Files whose tests read the same session fixture's run (markov_run, text_run): under the
# README's ``-n 2 --dist loadfile`` they go to one worker together, which trains each run
# once; apart, each worker trained both (about 40 s of the suite).
SHARES_RUNS_WITH = {"tests/test_evaluate.py": "tests/test_sample.py",
                    "tests/test_load.py": "tests/test_sample.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the files of SHARES_RUNS_WITH as one unit of work."""
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own
    from xdist.scheduler import LoadFileScheduling

    class SharedRuns(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SHARES_RUNS_WITH.get(path, path)

    return SharedRuns(config, log)


@contextlib.contextmanager
def recorded_compiles(stage: str = "backend_compile"):
    """The names of the programs compiled inside the block (a list, filled as they come). JAX
    times every program's compile request under this event, a persistent-cache hit included
    (its own cache_hits event comes on top: counting both counts a hit twice). ``stage``:
    another of JAX's compile events (``jaxpr_to_mlir_module``: each lowering)."""
    import jax.monitoring

    names: list[str] = []

    def listen(event: str, duration: float, fun_name: str = "", **_) -> None:
        if event == f"/jax/core/compile/{stage}_duration":
            names.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


# LLVM's optimisation on again (FAST_COMPILE turns it off for the process), for a compile
# whose options override the process's XLA_FLAGS: level 1, whose code runs nearly as fast as a
# user's default (2, with LLVM's expensive passes) for less compile time.
OPTIMISED_STEP = {"xla_backend_optimization_level": 1}


@contextlib.contextmanager
def optimised_steps():
    """Inside the block, a run's train step (``TrainStep.compile``: the one compile that passes
    no options; analysis compiles pass their own) is compiled with ``OPTIMISED_STEP``: for the
    in-process runs of tens to hundreds of steps whose time is in their steps, as
    ``subprocess_env(optimised=True)`` is for the default run. Same HLO, same numbers: only
    XLA:CPU's code generation differs (``DXRUN_TEST_LLVM_OPT=1`` compiles every program as a
    user's run does)."""
    import jax.stages

    compile_ = jax.stages.Lowered.compile

    def compile(self, compiler_options=None, **kw):
        return compile_(self, compiler_options or OPTIMISED_STEP, **kw)

    jax.stages.Lowered.compile = compile
    try:
        yield
    finally:
        jax.stages.Lowered.compile = compile_


def make_cfg(*overrides: str):
    """The run config the launcher would build for ``python -m dxrun <overrides>``: a copy of
    its composition, composed once a session for each command line (Hydra's compose is most of
    a small test's time, and the suite composes the same few lines again and again). A copy:
    a test that changes its config changes its own. A refused composition is not kept: each
    call raises it again."""
    import copy

    return copy.deepcopy(_composed(overrides))


@functools.cache
def _composed(overrides: tuple[str, ...]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="dxrun"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def cfg_factory():
    return make_cfg


def subprocess_env(drop: tuple[str, ...] = (), optimised: bool = False) -> dict[str, str]:
    """The environment of a ``python -m dxrun...`` a test starts: this session's, less the
    simulated device count (each run sets its own: ``runtime.cpu_devices``) and ``drop``.
    ``optimised``: LLVM's passes on (no FAST_COMPILE), for a run of hundreds of steps, whose
    time is in its steps, not its compiles (the default run: 52 CPU s against 101)."""
    from dxrun.launch import without_device_count

    env = {k: v for k, v in os.environ.items() if k not in drop}
    flags = without_device_count(env.pop("XLA_FLAGS", ""))
    if optimised:
        flags = flags.replace(FAST_COMPILE, "").strip()
    if flags:
        env["XLA_FLAGS"] = flags
    return env


def run_cli(*args: str, cwd: Path, timeout: int = 600, env: dict | None = None):
    """``python -m dxrun <args>`` as a subprocess in ``cwd`` (its outputs/ land there)."""
    import subprocess

    return subprocess.run([sys.executable, "-m", "dxrun", *args], cwd=cwd,
                          env={**subprocess_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def cli_in_process(*args: str, cwd: Path, entry: Callable[[], None] | None = None,
                   prog: str = "dxrun"):
    """``python -m dxrun <args>`` through its entry point (``dxrun.__main__.cli``, or ``entry``:
    another command's, ``prog`` its name in argv) in this process, in ``cwd``, returned as
    ``run_cli`` returns it: the exit code, stdout and stderr (Python's, then what was written to
    the file descriptors). For tests whose point is not the process boundary: no interpreter or
    JAX start. What the launcher sets up for its own process
    (the working dir, the stop signals' handlers, the unraisable hook, the root logger's
    handlers and level) is put back after. Hydra's logging setup (``logging.config.dictConfig``)
    closes every handler of the process: this process's own (pytest's, absl's, whose stream
    is pytest's capture) are kept open and registered."""
    import io
    import logging
    import signal
    import subprocess
    import tempfile

    from dxrun.__main__ import cli
    from dxrun.launch import job_status as job_dir

    entry = entry or cli
    root = logging.getLogger()
    handlers, level, hook, argv, started = (root.handlers[:], root.level, sys.unraisablehook,
                                            sys.argv, job_dir._started_in)
    signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    registered = logging._handlerList[:]  # weak references to every handler of the process
    kept_open = [h for h in (ref() for ref in registered) if h is not None]
    for h in kept_open:
        h.close = lambda: None  # logging.shutdown's call, for the duration
    here = os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    with tempfile.TemporaryFile() as fd_out, tempfile.TemporaryFile() as fd_err:
        sys.stdout.flush()
        sys.stderr.flush()
        kept = os.dup(1), os.dup(2)
        try:
            os.chdir(cwd)
            sys.argv = [prog, *args]
            os.dup2(fd_out.fileno(), 1)
            os.dup2(fd_err.fileno(), 2)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    entry()
                except SystemExit as e:
                    code = e.code
        finally:
            os.dup2(kept[0], 1)
            os.dup2(kept[1], 2)
            os.close(kept[0])
            os.close(kept[1])
            os.chdir(here)
            sys.argv, job_dir._started_in, sys.unraisablehook = argv, started, hook
            for s, handler in signals.items():
                signal.signal(s, handler)
            for h in root.handlers[:]:
                if h not in handlers:
                    root.removeHandler(h)
                    h.close()
            for h in handlers:
                if h not in root.handlers:
                    root.addHandler(h)
            root.setLevel(level)
            for h in kept_open:
                del h.close
            logging._handlerList[:] = registered + [
                ref for ref in logging._handlerList if ref not in registered]
        fd_out.seek(0)
        fd_err.seek(0)
        stdout = out.getvalue() + fd_out.read().decode(errors="replace")
        stderr = err.getvalue() + fd_err.read().decode(errors="replace")
    return subprocess.CompletedProcess([prog, *args], 0 if code is None else code, stdout,
                                       stderr)


def finished_wandb_run(path: Path, timeout: float = 60) -> dict:
    """``read_run`` of an offline W&B file once it is complete (its last record, the run's
    exit, is there): ``wandb.finish()`` can return before W&B's service has written the
    file's last block (it writes 32 KiB blocks), so a test that reads right after an
    in-process run could see no history at all under load."""
    import time

    from dxrun.tracking.wandb_file import read_run, records

    deadline = time.monotonic() + timeout
    while True:
        try:
            kinds = [r.WhichOneof("record_type") for r in records(path)]
        except ValueError:  # a block cut short mid-write
            kinds = []
        if kinds and kinds[-1] == "exit":
            return read_run(path)
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout} s"
        time.sleep(0.2)


class Output:
    """A subprocess's stdout (stderr merged into it), read by a thread as it comes, so that a
    full pipe never blocks the process and every wait has a timeout."""

    def __init__(self, proc):
        import threading

        self.proc, self.lines = proc, []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        self._seen = 0  # lines wait_for has looked at

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, predicate, timeout: float = 240) -> str:
        """The first line after the ones earlier waits returned for which ``predicate`` holds;
        fails when the output ends first or after ``timeout`` seconds."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            ended = not self.thread.is_alive()  # before reading: the lines are all there
            while self._seen < len(self.lines):
                line = self.lines[self._seen]
                self._seen += 1
                if predicate(line):
                    return line
            if ended or time.monotonic() > deadline:
                self.proc.kill()  # a failed test leaves no process behind
                raise AssertionError(("the output ended first" if ended else
                                      f"timed out ({timeout} s)") + ":\n" + self.text()[-4000:])
            time.sleep(0.02)

    def finish(self, timeout: float = 240) -> str:
        """The whole output, once the process has exited (within ``timeout`` seconds)."""
        import subprocess

        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"still running after {timeout} s:\n"
                                 + self.text()[-4000:]) from None
        self.thread.join(timeout=30)
        return self.text()

    def text(self) -> str:
        return "".join(self.lines)


class FakeClock:
    """A clock the test moves by hand (goodput's and the step timer's unit tests)."""

    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def tick(self, dt: float) -> None:
        self.t += dt


def tree_digest(tree: Path) -> dict[str, str]:
    """Every file under ``tree`` by its sha256: "untouched" means equal digests."""
    import hashlib

    return {str(p.relative_to(tree)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(tree.rglob("*")) if p.is_file()}


def run_digest(run_dir: Path) -> dict[str, str]:
    """``tree_digest`` of a run's own files: W&B's debug logs are links to the newest W&B
    process's (another test's evaluation of the shared run writes them, and W&B's service can
    still be writing after its process returned), not the run's files."""
    return {k: v for k, v in tree_digest(run_dir).items()
            if not (k.startswith("wandb/") and (k.endswith(".log") or "latest-run" in k))}


# Runs the evaluate and sample tests share (each trained once per session). One save, at the
# end: every reader takes the newest checkpoint. 200 steps at twice the preset's lr: its greedy
# samples follow the chain as the preset's lr's did after 300 steps, well clear of
# test_sample.py's bar, which 200 steps at the preset's lr only just reach.
MARKOV_STEPS = 200
MARKOV_RUN = ["parallelism=dp2", "data.seq_len=32", f"train.steps={MARKOV_STEPS}",
              "optimizer.lr=0.02", "train.log_every=50", "train.eval_every=100",
              f"checkpoint.every={MARKOV_STEPS}"]


@pytest.fixture(scope="session")
def markov_run(tmp_path_factory) -> Path:
    """The default markov data trained towards its floor (200 steps, logged to offline W&B)."""
    from dxrun.train import train

    run_dir = tmp_path_factory.mktemp("markov_run")
    with optimised_steps():
        train(make_cfg(*MARKOV_RUN), run_dir)
    # Its W&B file complete before a test reads it or digests it as "the run's files": W&B's
    # service can still be writing its last block after wandb.finish() has returned.
    for path in run_dir.glob("wandb/offline-run-*/run-*.wandb"):
        finished_wandb_run(path)
    return run_dir


def write_corpus(path: Path, n_sentences: int = 1500, seed: int = 0) -> Path:
    """Plain ASCII sentences from a small grammar: learnable in a few hundred steps."""
    import numpy as np

    rng = np.random.default_rng(seed)
    subjects, verbs = ["the cat", "a dog", "the bird", "my friend"], ["sees", "likes", "finds"]
    objects = ["the mat", "a ball", "the tree", "some bread"]
    text = " ".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}."
                    for _ in range(n_sentences))
    path.write_text(text + "\n")
    return path


def write_tokens(root: Path, val_batches: int, vocab: int = 65, seq_len: int = 8,
                 batch_size: int = 8) -> Path:
    """A ``data=tokens`` corpus (train.bin, val.bin, meta.json) of random ids whose held-out
    split is exactly ``val_batches`` batches of ``batch_size`` x ``seq_len``; the vocabulary
    (65 by default) is padded differently on every tp."""
    import json

    import numpy as np

    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    rng.integers(0, vocab, 4096).astype(np.uint16).tofile(root / "train.bin")
    n_val = val_batches * batch_size * seq_len + 1  # + the last window's target
    rng.integers(0, vocab, n_val).astype(np.uint16).tofile(root / "val.bin")
    (root / "meta.json").write_text(json.dumps({"vocab_size": vocab, "dtype": "uint16"}))
    return root


@pytest.fixture(scope="session")
def text_run(tmp_path_factory) -> Path:
    """A bytes-level text run on a small corpus (100 steps, no W&B): its samples are already
    the corpus's characters and words."""
    from dxrun.train import train

    root = tmp_path_factory.mktemp("text_run")
    corpus = write_corpus(root / "corpus.txt")
    train(make_cfg("data=text", f"data.path={corpus}", "data.seq_len=32", "data.batch_size=16",
                   "parallelism=dp2", "train.steps=100", "train.log_every=50",
                   "train.eval_every=100", "checkpoint.every=100", "logger=none"), root / "run")
    return root / "run"


def stepped(exp, params, steps: int) -> tuple:
    """(the train state after ``steps`` steps of ``exp`` from ``params``, each step's metrics
    fetched to the host)."""
    import jax

    state = exp.init_state(params)
    out = []
    for i in range(steps):
        state, m = exp.step(state, exp.batch(i))
        out.append(m)
    return state, jax.device_get(out)
