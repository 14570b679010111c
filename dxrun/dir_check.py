"""Whether a dir the config names (``hydra.run.dir``, ``hydra.sweep.dir``, ``checkpoint.dir``)
can be made and written, said in one line before anything is made (``dir_refusal``). No JAX:
the run dir is checked before Hydra makes it.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Any


def dir_refusal(key: str, value: Any, fix: str) -> str | None:
    """Why the dir ``key=value`` cannot be made or written, in one line ending in ``fix``;
    None when it can. A name longer than the filesystem takes (NAME_MAX, or the whole path
    PATH_MAX) is refused by its length; otherwise the dir, or its nearest parent that exists,
    is tried with a real mkdir (removed at once): permission bits pass root, and /proc or a
    read-only mount refuse only the mkdir itself. Nothing is left behind."""
    path = Path(str(value)).expanduser()  # relative stays relative: named as the user gave it
    nearest = path
    while not os.path.lexists(nearest):  # a parent that is a file ends the walk too
        nearest = nearest.parent
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
