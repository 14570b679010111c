"""Context parallelism (``parallelism.cp``, the ``context`` mesh axis), its pure part: which
positions each device holds, the checks a config must pass, and the key/value traffic.

Each sequence is cut into 2·cp equal chunks and device i of the axis holds chunks i and
2·cp-1-i (the zig-zag split): under a causal mask an early chunk attends to few keys and a late
one to many, so pairing them gives every device the same work. The step permutes each
sequence into that order once (``dxrun.model.context_parallel``); the model reads the true positions
from ``zigzag_order``, and the loss, a mean over all tokens, does not depend on the order.
"""

from __future__ import annotations

from dxrun.config import (
    ConfigError,
)

# parallelism=auto's layout search tries context-parallel layouts only from this sequence
# length on: below it a sequence's activations are small beside the weights and optimizer
# state, and the per-layer key/value gather costs more than the memory it frees.
LONG_SEQ = 8192
# Keys per block of the context axis's attention at most (dxrun.model.context_parallel.flash): one
# block's local-queries x BLOCK scores alive at a time.
BLOCK = 512


def zigzag_order(seq_len: int, cp: int) -> tuple[int, ...]:
    """The true position of each slot of the permuted sequence: device i's L/cp slots are
    chunk i then chunk 2·cp-1-i of 2·cp chunks. The identity when cp = 1."""
    if cp == 1:
        return tuple(range(seq_len))
    c = seq_len // (2 * cp)
    out: list[int] = []
    for i in range(cp):
        out += [*range(i * c, (i + 1) * c), *range((2 * cp - 1 - i) * c, (2 * cp - i) * c)]
    return tuple(out)


def check_processes(cp: int, processes: int) -> None:
    """Raise ConfigError for a context axis in a multi-process run (not laid out over hosts)."""
    if cp > 1 and processes > 1:
        raise ConfigError(f"parallelism.cp={cp} runs in one process for now; set "
                          "parallelism.cp=1 for a multi-process run")


def check_context(cp: int, seq_len: int, *, user_model: bool = False,
                  objective: str = "ar") -> None:
    """Raise ConfigError (key, value, fix) for a context axis this model or sequence cannot
    take."""
    if cp == 1:
        return
    if seq_len % (2 * cp):
        good = 2 * cp * max(1, round(seq_len / (2 * cp)))
        raise ConfigError(
            f"parallelism.cp={cp} needs data.seq_len divisible by 2*cp={2 * cp} (the balanced "
            f"causal split cuts each sequence into 2*cp chunks), but data.seq_len={seq_len}; "
            f"use e.g. data.seq_len={good}")
    if user_model:
        raise ConfigError(f"parallelism.cp={cp} needs dxrun's own model (its attention gathers "
                          "keys/values over the context axis); set parallelism.cp=1 with "
                          "model._target_")
    if objective != "ar":  # the context kernel masks causally; the bound's mask is not ordered
        raise ConfigError(f"parallelism.cp={cp} trains model.objective=ar only (its attention "
                          f"is causal), not model.objective={objective}; set parallelism.cp=1")


def check_sequence_parallel(on: bool, seq_len: int, cp: int, tp: int) -> None:
    """Sequence parallelism splits a device's positions (seq_len / cp) over the tp devices."""
    if on and seq_len % (cp * tp):
        raise ConfigError(
            f"parallelism.sequence_parallel=true splits the sequence over cp*tp={cp * tp} "
            f"devices, but data.seq_len={seq_len} is not a multiple of it; use e.g. "
            f"data.seq_len={cp * tp * max(1, round(seq_len / (cp * tp)))}")


def kv_gather_bytes(*, batch_per_replica: int, seq_len: int, n_kv_heads: int, head_dim: int,
                    n_layers: int, cp: int, tp: int, dtype_bytes: int) -> float:
    """Bytes each device sends per step for the key/value all-gathers over ``context``: per
    layer, K and V of its replica's rows and its kv heads (over tp), gathered forward, and
    their gradients reduce-scattered backward (a ring: (cp-1)/cp of the gathered buffer
    each way)."""
    if cp == 1:
        return 0.0
    gathered = 2 * batch_per_replica * seq_len * (n_kv_heads // tp) * head_dim * dtype_bytes
    return 2 * n_layers * gathered * (cp - 1) / cp
