"""Read what XLA made of a jitted function: which collectives the compiled HLO contains."""

from __future__ import annotations

import re
from collections import Counter

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# An HLO instruction line: `%name = f32[...]{...} all-reduce(...)` (or the -start async form).
_OP = re.compile(r"=\s*[^=]*?\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collectives(hlo_text: str) -> Counter:
    """Count collective ops by kind in compiled HLO text (async start/done pairs count once)."""
    return Counter(m.group(1) for line in hlo_text.splitlines() if (m := _OP.search(line)))


def collective_lines(hlo_text: str, kind: str) -> list[str]:
    return [line.strip() for line in hlo_text.splitlines()
            if (m := _OP.search(line)) and m.group(1) == kind]
