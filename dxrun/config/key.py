"""One config key: ``key(...)``, the dataclass field that carries all its facts (default,
meaning, range, choices, the data sources that read it), and the ``Range`` its numbers take.
dxrun/config/schema.py writes every key with it; pure (no import of dxrun)."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: ``lo``/``hi`` bounds (None = unbounded), each closed
    or open. The docs' tables of ranges are generated from RANGES (``ranges_markdown``)."""

    lo: float | None = None
    hi: float | None = None
    lo_closed: bool = True
    hi_closed: bool = False

    def __contains__(self, v: float) -> bool:
        if isinstance(v, float) and not math.isfinite(v):
            return False  # NaN compares false with every bound, so it would pass them all
        if self.lo is not None and (v < self.lo or (v == self.lo and not self.lo_closed)):
            return False
        return not (self.hi is not None and (v > self.hi or (v == self.hi and not self.hi_closed)))

    def __str__(self) -> str:
        if self.hi is None:
            return f"{'>=' if self.lo_closed else '>'} {_num(self.lo)}"
        return (f"{'[' if self.lo_closed else '('}{_num(self.lo)}, {_num(self.hi)}"
                f"{']' if self.hi_closed else ')'}")

    def fix(self, key: str) -> str:
        """What the refusal of a value outside suggests: ``set KEY > 0``, ``set KEY in [0, 1)``."""
        if self.hi is None:
            return f"set {key} {'>=' if self.lo_closed else '>'} {_num(self.lo)}"
        return f"set {key} in {self}"


def _num(x: float | None) -> str:
    """A bound as the tables show it: the integer limits as powers of two (2^31, 2^32 - 1)."""
    if isinstance(x, int) and x >= 2**16:
        for off, tail in ((0, ""), (1, " - 1")):
            if (x + off) & (x + off - 1) == 0:
                return f"2^{(x + off).bit_length() - 1}{tail}"
    return f"{x:g}" if isinstance(x, float) else str(x)


POSITIVE, NON_NEGATIVE = Range(0, lo_closed=False), Range(0)
FRACTION = Range(0, 1)  # [0, 1)
# Integer keys end where what they feed overflows (each use says which), so a huge value is
# refused here rather than crashing in JAX or silently wrapping. INT32: the step counter
# (TrainState.step) and the jitted step's integer constants are int32 (JAX without x64).
INT32 = 2**31
# The loss divides by the batch's tokens, an int32 in the jitted step: one key alone must stay
# below it (the product with data.seq_len: plan.make_plan).
BATCH = Range(0, INT32, lo_closed=False)
Choices = tuple[str, ...] | Callable[[], tuple[str, ...]]


def key(default: Any = MISSING, meaning: str = "", *, range: Range | None = None,
        choices: Choices | None = None, fix: str = "pick one of them",
        sources: tuple[str, ...] = (), unranged: str = "",
        factory: Callable[[], Any] | None = None) -> Any:
    """A schema field and everything about its key, in one place.

    ``meaning``: the Reference's one line. ``range``: the values a number accepts. ``choices``:
    the strings it accepts (or a function returning them, read when checked); ``fix``: what
    the refusal of another value suggests. ``sources``: the data sources that read a ``data``
    key (any other source refuses it). ``unranged``: for a number without a range, what it
    accepts and where that is checked (``accepted: where``)."""
    metadata = {"meaning": meaning, "range": range, "choices": choices, "fix": fix,
                "sources": sources, "unranged": unranged}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section(cls: type, meaning: str) -> Any:
    """A nested section of the schema (``train.profile``, the top-level groups)."""
    return key(meaning=meaning, factory=cls)


def walk(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field, Any]]:
    """(``section.key``, field, resolved type) for every key of the dataclass ``cls`` (the
    schema's root: its fields are sections), nested sections walked."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(f.default_factory):
            out += walk(f.default_factory, f"{name}.")  # type: ignore[arg-type]
        elif prefix:
            out.append((name, f, hints[f.name]))
    return out


def ranges_table(ranges: dict[str, Range]) -> str:
    """The keys by accepted range, as a Markdown table, so it is never written twice."""
    by_range: dict[str, list[str]] = {}
    for name, r in ranges.items():
        by_range.setdefault(str(r), []).append(f"`{name}`")
    rows = ["| accepted | keys |", "|---|---|"]
    rows += [f"| {r} | {', '.join(names)} |" for r, names in by_range.items()]
    return "\n".join(rows)
