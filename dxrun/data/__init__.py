"""Data sources, chosen by ``data.name``. Each yields the global token batch of a step as a host
array [batch_size, seq_len + 1], a pure function of (seed, step)."""

from __future__ import annotations

from typing import Any

from dxrun.data.markov import MarkovSource


def build_source(cfg: Any) -> MarkovSource:
    d = cfg.data
    if d.name == "markov":
        return MarkovSource(symbols=d.symbols or cfg.model.vocab_size, order=d.order,
                            branching=d.branching, seed=d.seed, batch_size=d.batch_size,
                            seq_len=d.seq_len)
    raise AssertionError(f"data.name={d.name!r} passed validation but has no source")
