"""Regenerate the command output quoted in the docs, so their numbers come from the code.

usage: python docs/numbers.py [--list] [FILE.md ...]   (default: README.md and every page in docs/)

A quoted block is regenerated when a marker comment stands on the line above its fence:

    <!-- numbers: keep="^step|^  mesh" setup="python -m dxrun hydra.run.dir=outputs/markov" -->
    ```
    $ python -m dxrun.evaluate outputs/markov
    step 600  eval/loss 0.8931 ...
    ```

Each `$ <command>` line of the block is run (after the marker's `setup` commands, whose output is
dropped) in one scratch directory that links the checkout's top-level files, so a block's commands
see each other's outputs, `README.md` and `benchmarks/` as a user in the checkout would. The lines
after a command, up to the next `$` line, become the command's output: every line of stdout and
stderr, or only those matching `keep` (a regular expression), log lines without Hydra's
`[time][dxrun][LEVEL] - ` prefix. The exit code is whatever the
command returns (bad-input examples exit 2 on purpose). Run it before a release, on a quiet
machine, and read the diff: timings move from run to run, the rest should not.

Blocks without a marker are left alone (illustrations, or output from hardware the machine does
not have: say so beside them). `--list` prints each marked block's commands without running them.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- numbers:(?P<opts>.*?)-->\n(?P<fence>```[^\n]*)\n(?P<body>.*?)^```$",
                    re.M | re.S)
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Hydra's log-line prefix, `[2026-01-01 12:00:00,000][dxrun][INFO] - `: the docs quote the message
# (after the launcher's `[rank N] `, which stays).
LOG_PREFIX = re.compile(r"^((?:\[rank \d+\] )?)\[[^\]]*\]\[[^\]]*\]\[[A-Z]+\] - ")


@dataclass
class Block:
    keep: str | None
    setup: list[str]
    commands: list[str]
    start: int  # character offsets of the marked block (marker through closing fence)
    end: int
    fence: str = "```"
    options: dict[str, str] = field(default_factory=dict)


def parse_options(text: str) -> dict[str, str]:
    """`keep="..." setup="..."` -> dict; a repeated `setup` joins with ` && ` order kept."""
    opts: dict[str, str] = {}
    for word in shlex.split(text):
        key, sep, value = word.partition("=")
        if not sep or key not in ("keep", "setup"):
            raise SystemExit(f"docs/numbers.py: error: unknown marker option {word!r}; "
                             "use keep=\"REGEX\" or setup=\"COMMAND\"")
        opts[key] = f"{opts[key]} && {value}" if key in opts else value
    return opts


def blocks(markdown: str) -> list[Block]:
    found = []
    for m in MARKER.finditer(markdown):
        opts = parse_options(m["opts"])
        commands = [line[2:] for line in m["body"].splitlines() if line.startswith("$ ")]
        if not commands:
            raise SystemExit(f"docs/numbers.py: error: a marked block has no `$ command` line "
                             f"(near {m['body'][:60]!r}); put the command on its first line")
        setup = [opts["setup"]] if "setup" in opts else []
        found.append(Block(opts.get("keep"), setup, commands, m.start(), m.end(), m["fence"],
                           opts))
    return found


def scratch_dir() -> Path:
    """A working directory that sees the checkout's top-level files but keeps run outputs."""
    tmp = Path(tempfile.mkdtemp(prefix="dxrun-numbers-"))
    for entry in ROOT.iterdir():
        if entry.name not in ("outputs", "multirun", ".git"):
            (tmp / entry.name).symlink_to(entry)
    return tmp


def run(command: str, cwd: Path, keep: str | None) -> list[str]:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_ERROR_REPORTING": "false",
           "WANDB_SILENT": "true", "PYTHONPATH": str(ROOT), "NO_COLOR": "1",
           "COLUMNS": "200"}
    proc = subprocess.run(command, shell=True, cwd=cwd, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    # paths as the reader sees them, relative to where they ran the command
    text = proc.stdout.replace(f"{cwd}/", "")
    lines = [LOG_PREFIX.sub(r"\1", ANSI.sub("", line)).rstrip() for line in text.splitlines()]
    if keep:
        lines = [line for line in lines if re.search(keep, line)]
    return lines


def regenerate(block: Block, cwd: Path) -> str:
    for command in block.setup:
        run(command, cwd, keep="$^")
    out = []
    for command in block.commands:
        out.append(f"$ {command}")
        out.extend(run(command, cwd, block.keep))
    opts = " ".join(f'{k}="{v}"' if '"' not in v else f"{k}={shlex.quote(v)}"
                    for k, v in block.options.items())
    marker = f"<!-- numbers: {opts} -->" if opts else "<!-- numbers: -->"
    return "\n".join([marker, block.fence, *out, "```"])


def rewrite(path: Path, cwd: Path | None = None) -> int:
    """Regenerates every marked block of one file in place; returns how many there were."""
    text = path.read_text()
    found = blocks(text)
    cwd = cwd or scratch_dir()
    for block in reversed(found):  # from the end, so earlier offsets stay valid
        text = text[:block.start] + regenerate(block, cwd) + text[block.end:]
    path.write_text(text)
    return len(found)


def default_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print("usage: " + (__doc__ or "").split("usage: ", 1)[1])
        return 0
    listing = bool(argv) and argv[0] == "--list"
    files = [Path(a) for a in argv[listing:]] or default_files()
    for path in files:
        found = blocks(path.read_text())
        if listing:
            for block in found:
                for command in block.setup + block.commands:
                    print(f"{path.relative_to(ROOT) if path.is_absolute() else path}: {command}")
        elif found:
            print(f"{path}: {rewrite(path)} block(s) regenerated", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
