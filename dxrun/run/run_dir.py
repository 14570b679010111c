"""Which run dir a launch writes to: a new run's dir claimed (never shared), a training launch's
continued, waited for or refused, held by a lock for the run's life, and the command that
relaunches into it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import re
import shlex
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dxrun.config import (
    RUNNING,
    UNFINISHED,
    ConfigError,
)
from dxrun.run.files import STATUS, make_dir
from dxrun.run.signals import SIGNALS

log = logging.getLogger("dxrun")


def claim_run_dir(run_dir: Path) -> Path:
    """The run dir Hydra made, claimed for a new run: the claim is creating ``.hydra/`` with an
    atomic mkdir: a dir whose ``.hydra/`` exists belongs to an earlier or a concurrent run (two
    launches in the same second, a SLURM array), and this run takes the first free sibling
    ``<name>_1``, ``<name>_2``, ... so no two runs ever share a dir. (A relaunch that continues
    a run claims its dir through ``claim``.)"""
    candidate, i = run_dir, 0
    while True:
        nameable(run_dir, candidate)
        candidate.mkdir(parents=True, exist_ok=True)
        try:
            (candidate / ".hydra").mkdir()
            return candidate
        except FileExistsError:
            i += 1
            candidate = run_dir.with_name(f"{run_dir.name}_{i}")

LOCK = Path(".hydra") / "lock"
# What says a dir holds a run (a plan-mode dir included), beside its checkpoints.
_RUN_FILES = (STATUS, "summary.json", "metrics.jsonl", ".hydra/config.yaml", "checkpoints",
              "checkpoints.txt")
POLL_S = 0.5  # how often a waiting launch tries the lock again


def wait_seconds(setting: bool | float | None) -> float:
    """``run.wait_for_lock``: false = do not wait (0), true = as long as it takes (inf), a
    number = at most that many seconds."""
    if setting is True:
        return math.inf
    return float(setting or 0)


@dataclass(frozen=True)
class Holder:
    """The live run a lock file names (what the refusal says)."""

    pid: int | None = None
    host: str | None = None
    since: float | None = None

    def describe(self, now: float | None = None) -> str:
        if self.pid is None:
            return "a live run (its lock file names no holder yet)"
        ago = "" if self.since is None else (
            f" since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))}, "
            f"{max(0, int((now or time.time()) - self.since))} s ago")
        return f"pid {self.pid} on {self.host}{ago}"


def holder(run_dir: Path) -> Holder:
    """Who the lock file of ``run_dir`` names (a half-written or missing file: nobody named)."""
    try:
        info = json.loads((Path(run_dir) / LOCK).read_text())
        return Holder(int(info["pid"]), str(info["host"]), float(info["since"]))
    except (OSError, ValueError, KeyError, TypeError):
        return Holder()


class RunLock:
    """An exclusive ``flock`` on ``<run dir>/.hydra/lock``, held until ``release`` or the
    process's end. The file exists only while a run holds it (or after a holder was killed):
    ``release`` unlinks it while still holding it, and ``acquire`` checks that the file it
    locked is still the one at the path, so a launch that locked a file just unlinked tries
    again instead of holding a lock nobody else sees."""

    def __init__(self, run_dir: Path, fd: int):
        self.run_dir, self.fd = Path(run_dir), fd

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock | None:
        """The lock of ``run_dir`` (its ``.hydra/`` made if need be), or None while a live
        process holds it."""
        path = Path(run_dir) / LOCK
        while True:
            make_dir(path.parent)  # a file named .hydra: set aside (bookkeeping.make_dir)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:  # .hydra/ removed by a launch discarding it: again
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            except OSError as e:  # a filesystem without flock (Lustre without -o flock)
                log.warning("%s: this filesystem takes no lock (%s): the run dir is not held "
                            "against a second launch", path, e.strerror)
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # unlinked by its last holder between our open and our lock
                os.close(fd)
                continue
            info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
            os.ftruncate(fd, 0)
            os.write(fd, (json.dumps(info) + "\n").encode())
            return cls(run_dir, fd)

    def release(self) -> None:
        """Give the dir up; ``.hydra/`` goes too when the lock was all it held."""
        if self.fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.run_dir / LOCK)
        os.close(self.fd)
        self.fd = -1
        with contextlib.suppress(OSError):  # holds the run's config: stays
            (self.run_dir / LOCK.parent).rmdir()


def holds_run(run_dir: Path) -> bool:
    """Whether a run (training or plan mode) has written into ``run_dir``."""
    return any((Path(run_dir) / name).exists() for name in _RUN_FILES)


def read_status(run_dir: Path) -> dict[str, Any]:
    """The run's status.json ({} when there is none or it cannot be read)."""
    try:
        status = json.loads((Path(run_dir) / STATUS).read_text())
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def continues(run_dir: Path, has_checkpoints: Callable[[Path], bool]) -> bool:
    """Whether a relaunch naming the dir continues the run in ``run_dir``: it holds checkpoints
    of its own (a resume, or "nothing to train"), or it is unfinished."""
    return has_checkpoints(run_dir) or read_status(run_dir).get("status") in UNFINISHED


def chain(asked: Path) -> list[Path]:
    """``asked`` and its siblings ``<asked>_1``, ``<asked>_2``, ... that exist, in order."""
    asked = Path(asked)
    pattern = re.compile(re.escape(asked.name) + r"_(\d+)")
    siblings = []
    with contextlib.suppress(OSError):
        for p in asked.parent.iterdir():
            if (m := pattern.fullmatch(p.name)) and p.is_dir():
                siblings.append((int(m.group(1)), p))
    return [asked, *(p for _, p in sorted(siblings))]


def sibling(asked: Path, i: int) -> Path:
    return asked if i == 0 else asked.with_name(f"{asked.name}_{i}")


def pick(asked: Path, has_checkpoints: Callable[[Path], bool]) -> tuple[Path, bool]:
    """Where a launch naming ``asked`` trains: (dir, whether it continues the run there)."""
    dirs = chain(asked)
    runs = [d for d in dirs if holds_run(d)]
    if not runs:
        return asked, False
    newest = runs[-1]
    if continues(newest, has_checkpoints):
        return newest, True
    index = 0 if newest == asked else int(newest.name.rsplit("_", 1)[1])
    return sibling(asked, index + 1), False


@dataclass
class Claim:
    """The run dir a launch trains in, held (``lock``) until ``release``."""

    dir: Path
    lock: RunLock | None = None
    # The status.json of the run it continues ({}: a new run); its attempt number and the
    # attempts that ended without recording their end (killed outright) carry on.
    earlier: dict[str, Any] | None = None

    @property
    def continues(self) -> bool:
        return self.earlier is not None

    @property
    def attempt(self) -> int:
        """This launch's number among the run's attempts (1: a new run)."""
        if self.earlier is None:
            return 1
        return int(self.earlier.get("attempt") or 1) + 1

    @property
    def lost_attempts(self) -> int:
        """Earlier attempts that died without saying how they ended (status still running)."""
        if not self.earlier:
            return 0
        return (int(self.earlier.get("lost_attempts") or 0)
                + (self.earlier.get("status") == RUNNING))

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def claim(asked: Path, *, named: bool, fresh: bool, has_checkpoints: Callable[[Path], bool],
          wait_s: float = 0.0, clock: Callable[[], float] = time.monotonic,
          held: list[Claim] | None = None) -> Claim:
    """The dir a training launch asking for ``asked`` trains in, locked (module docstring).
    ``named``: the user named the dir (no generated timestamp); ``fresh``: a new run
    (``checkpoint.resume=none``). A named dir held by a live run: wait up to ``wait_s``, then
    ConfigError naming the holder. ``held`` gets the claim the moment its lock is taken, so
    that a signal before this returns still stops the run as one that holds its dir."""
    held = [] if held is None else held
    if fresh or not named:
        while True:
            run_dir = claim_run_dir(asked)  # the first dir whose .hydra/ this launch made
            with SIGNALS.held_back():  # a stop comes after the lock is in ``held``
                if (lock := RunLock.acquire(run_dir)) is not None:
                    held[:] = [Claim(run_dir, lock)]
            if lock is not None:
                return held[0]
    deadline, said = clock() + wait_s, False
    while True:
        target, cont = pick(asked, has_checkpoints)
        nameable(asked, target)
        with SIGNALS.held_back():
            lock = RunLock.acquire(target)
            held[:] = [] if lock is None else [Claim(target, lock)]
        if lock is None:
            if clock() >= deadline:
                raise ConfigError(busy(target, wait_s))
            if not said:
                log.info("%s is held by %s: waiting for it to end (run.wait_for_lock=%s)",
                         target, holder(target).describe(),
                         "true" if math.isinf(wait_s) else f"{wait_s:g}")
                said = True
            time.sleep(POLL_S)
            continue
        if pick(asked, has_checkpoints) != (target, cont):  # it changed before we held it
            held.clear()
            lock.release()
            continue
        held[:] = [Claim(target, lock, read_status(target) if cont else None)]
        return held[0]


def busy(run_dir: Path, wait_s: float) -> str:
    """The refusal of a launch into a dir a live run holds."""
    waited = f" (waited {wait_s:g} s, run.wait_for_lock)" if wait_s > 0 else ""
    return (f"{run_dir} is in use by a live run: {holder(run_dir).describe()}{waited}; let it "
            "end or stop it, or set run.wait_for_lock=true (or a number of seconds) to wait "
            "for it")


def hydra_value(text: str) -> str:
    """``text`` written as the value of a Hydra override that reads back as ``text``: as it
    is where Hydra's grammar takes it unchanged as a string, else double-quoted. Inside the
    quotes Hydra unescapes only backslashes before a quote (so a quote gets one, and a run of
    backslashes before a quote or the end is doubled); OmegaConf would still resolve ``${``,
    so it is escaped too. ``=``, quotes, spaces, commas and non-ASCII need the quotes."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if "${" not in text:
        try:
            if OverridesParser.create().parse_override(f"k={text}").value() == text:
                return text
        except Exception:  # noqa: BLE001 - Hydra's grammar refused it: quote it
            pass
    body = re.sub(r'(\\*)"', lambda m: m[1] * 2 + '\\"', text)
    body = re.sub(r"(\\+)$", lambda m: m[1] * 2, body).replace("${", "\\${")
    return f'"{body}"'


# Set by ``dxrun.launch`` for its ranks: {"program": its own command up to "--", "added": the
# overrides it adds to the user's}, so that a rank's resume command is the launcher's.
LAUNCHED_BY = "DXRUN_LAUNCHED_BY"


def stopped_words(signal_name: str, when: str, checkpoint: object, relaunch: str) -> str:
    """The one line a run stopped by a signal ends with (status.json's reason): what stopped
    it and when, the newest checkpoint kept (None: none yet) and the command that resumes it."""
    kept = f"checkpoint {checkpoint} is the newest" if checkpoint else "no checkpoint yet"
    return f"{signal_name}: stopped {when}; {kept}. Resume with: {relaunch}"


def relaunch_command(overrides: list[str], run_dir: Path | str, program: str | None = None
                     ) -> str:
    """The command that resumes a stopped run in place: its overrides (Hydra's task
    overrides, which leave out ``hydra.*``, each as the user wrote it) and its run dir (a path,
    written for Hydra by ``hydra_value``), quoted for a POSIX shell. ``program``: by default
    ``python -m dxrun``, or in a rank of ``dxrun.launch`` the launcher's (``LAUNCHED_BY``)."""
    launcher = json.loads(os.environ.get(LAUNCHED_BY) or "{}") if program is None else {}
    program = program or launcher.get("program", "python -m dxrun")
    kept = [o for o in overrides if not o.startswith("hydra.run.dir=")]
    added = launcher.get("added", [])
    if added and kept[-len(added):] == added:
        kept = kept[:-len(added)]
    run_dir_override = f"hydra.run.dir={hydra_value(str(run_dir))}"
    return " ".join([program, *map(shlex.quote, kept), shlex.quote(run_dir_override)])


def run_dir_of(command: str) -> str | None:
    """The run dir a ``relaunch_command`` resumes in, read from its ``hydra.run.dir=`` word as
    the shell, Hydra and OmegaConf (which undoes the escaped ``${``) read it; None without."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    word = next((w for w in shlex.split(command) if w.startswith("hydra.run.dir=")), None)
    if word is None:
        return None
    return OmegaConf.create({"dir": OverridesParser.create().parse_override(word).value()}).dir

def dir_refusal(key: str, value: Any, fix: str) -> str | None:
    """Why the dir ``key=value`` cannot be made or written, in one line ending in ``fix``;
    None when it can. A name longer than the filesystem takes (NAME_MAX, or the whole path
    PATH_MAX) is refused by its length; otherwise the dir, or its nearest parent that exists,
    is tried with a real mkdir (removed at once): permission bits pass root, and /proc or a
    read-only mount refuse only the mkdir itself. Nothing is left behind."""
    path = Path(str(value)).expanduser()  # relative stays relative: named as the user gave it
    nearest = _nearest(path)
    if why := _too_long(path, nearest):
        return f"{key}={_shortened(str(value))} cannot be created: {why}; shorten it, {fix}"
    where = f"{key}={value}" if nearest == path else f"{key}={value} cannot be created: {nearest}"
    if not nearest.is_dir():
        kind = "a file, not a directory" if nearest.is_file() else "not a directory"
        return f"{where} is {kind}; {fix}"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dxrun-probe-", dir=nearest))
    except OSError as e:
        # ENOENT from a mkdir in an existing dir (/proc): the filesystem takes no new dirs.
        reason = "" if e.errno == errno.ENOENT else f" ({e.strerror.lower()})"
        return f"{where} is not writable{reason}; {fix}"
    return None


def nameable(asked: Path, sibling: Path) -> None:
    """A new run's dir ``sibling`` of ``asked`` (``<asked>_N``: ``asked`` holds a run) that
    the filesystem cannot name, ``asked`` being near NAME_MAX, refused in one line before
    anything is made (``dir_refusal`` checked ``asked`` alone)."""
    if sibling != asked and (why := _too_long(sibling, _nearest(sibling))):
        raise ConfigError(f"the run dir {_shortened(asked.name)} holds a run, and this run's "
                          f"own dir beside it cannot be created: {why}; give a shorter "
                          "hydra.run.dir")


def _nearest(path: Path) -> Path:
    """``path`` or its nearest parent that exists (a parent that is a file ends the walk)."""
    while not os.path.lexists(path):
        path = path.parent
    return path


def _too_long(path: Path, nearest: Path) -> str | None:
    """Why ``path`` cannot be made for its length alone (None: it can): a name to be made under
    ``nearest`` (its nearest part that exists) longer than the filesystem's NAME_MAX, or the
    whole path longer than PATH_MAX, both in bytes (the kernel's ENAMETOOLONG)."""
    def limit(name: str, default: int) -> int:
        try:
            return os.pathconf(nearest, name)
        except (OSError, ValueError):
            return default

    name_max = limit("PC_NAME_MAX", 255)
    for part in path.parts[len(nearest.parts):]:
        if (n := len(os.fsencode(part))) > name_max:
            return (f"its name {_shortened(part, count=False)} is {n} bytes, over the {name_max} "
                    "a file name may have on this filesystem (NAME_MAX)")
    path_max = limit("PC_PATH_MAX", 4096)
    if (n := len(os.fsencode(os.path.abspath(path)))) >= path_max:
        return f"its path is {n} bytes, over the {path_max - 1} a path may have (PATH_MAX)"
    return None


def _shortened(text: str, keep: int = 48, count: bool = True) -> str:
    """``text`` for a one-line message: as it is up to ``keep`` characters, else its start and
    end around ``...`` (and, ``count``, its length)."""
    if len(text) <= keep:
        return text
    head = keep * 2 // 3
    return f"{text[:head]}...{text[head - keep:]}" + (f" ({len(text)} characters)" if count else "")
