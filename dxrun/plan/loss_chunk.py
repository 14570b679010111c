"""How many positions the chunked loss takes at a time (``model.loss_chunk``): pure, read by
the config check before JAX starts and by ``make_plan``, whose plan the memory and time models
and the step (``dxrun.model.chunked_loss``) read."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dxrun.config.errors import ConfigError

if TYPE_CHECKING:
    from dxrun.config.schema import ModelConfig

AUTO_ON_BYTES = 512 * 2**20  # null: chunk when one micro-batch's fp32 logits exceed this


CHUNK_BYTES = 256 * 2**20  # null: the largest chunk whose fp32 logits fit in this


def resolve_loss_chunk(value: int | None, rows: int, seq_len: int, vocab: int) -> int:
    """Positions per chunk (0 = unchunked) for ``model.loss_chunk=value`` when each device
    computes ``rows`` sequences of ``seq_len`` over ``vocab`` (padded, per device) logits.
    null: unchunked while the fp32 logits fit in ``AUTO_ON_BYTES``, else the largest divisor
    of ``seq_len`` whose chunk fits in ``CHUNK_BYTES``. A chunk of the whole sequence or more
    is the unchunked loss."""
    if value == 0:
        return 0
    if value is not None:
        if value >= seq_len:
            return 0
        if seq_len % value:
            divisors = [d for d in range(1, seq_len) if seq_len % d == 0]
            near = min(divisors, key=lambda d: abs(d - value))
            raise ConfigError(f"model.loss_chunk={value} does not divide data.seq_len={seq_len}; "
                              f"pick a divisor (e.g. {near}), 0 (off) or null (auto)")
        return value
    per_position = rows * vocab * 4
    if per_position * seq_len <= AUTO_ON_BYTES:
        return 0
    fits = [d for d in range(1, seq_len) if seq_len % d == 0 and d * per_position <= CHUNK_BYTES]
    return max(fits, default=1)


def loss_chunk_for(m: ModelConfig, rows: int, seq_len: int, vocab: int, cp: int = 1) -> int:
    """``resolve_loss_chunk`` for the model ``m`` when each device computes ``rows`` sequences
    (one micro-batch's) of ``seq_len`` over ``vocab`` (padded, per tensor-parallel device)
    logits: the run plan's, taken once by ``make_plan``. A user model (``model._target_``) has
    no output layer of dxrun's to chunk: 0. With a context axis (cp > 1) the logits are split
    over it already: 0, and a chunk asked for is refused."""
    if m.get("_target_"):
        return 0
    chunk = m.get("loss_chunk")
    if cp > 1:  # the chunks would run along the sequence the context axis splits
        if chunk:
            raise ConfigError(f"model.loss_chunk={chunk} does not run with "
                              f"parallelism.cp={cp} (the chunks run along the sequence that "
                              "the context axis splits); set model.loss_chunk=0 or null")
        return 0
    return resolve_loss_chunk(chunk, max(1, rows), seq_len, vocab)
