"""The global batch and the learning rate that goes with it: pure, no JAX.

A run gives its batch one of two ways. ``data.batch_size`` is the global batch of one optimizer
update (all devices together). ``data.per_device_batch_size=B`` is what one data replica
computes at once, so the global batch grows with the mesh: ``B x dp x fsdp x
train.grad_accum``. Hydra cannot tell a default from a value the user typed, so
``data.batch_size`` defaults to ``${default_batch:${data.per_device_batch_size}}``: 32 when no
per-device batch is given, null when one is; a ``data.batch_size`` beside a per-device batch
was set on purpose and is refused (``check_batch_keys``).

``data.seq_len: null`` (the real-data presets' default) is the model's context on an
accelerator and 64 on CPU (``default_seq_len``), where short windows keep the run quick. The
chunked loss's positions a chunk (``model.loss_chunk``): checked before JAX starts, decided by
``make_plan`` (``loss_chunk_for``) for the models and the step (``model.losses``).
"""

from __future__ import annotations

import math
from typing import Any

from dxrun.config import (
    GLOBAL,
    INT32,
    PER_DEVICE,
    ConfigError,
    ModelConfig,
)

CPU_SEQ_LEN = 64  # data.seq_len=null on CPU (capped by model.max_seq_len)


def check_batch_keys(data: Any) -> None:
    """Exactly one of the global and the per-device batch: each decides the other."""
    if data.batch_size is None and data.per_device_batch_size is None:
        raise ConfigError("data.batch_size=null but data.per_device_batch_size is not set either;"
                          " give one, e.g. data.batch_size=32 or data.per_device_batch_size=4")
    if data.batch_size is not None and data.per_device_batch_size is not None:
        raise ConfigError(
            f"data.batch_size={data.batch_size} and data.per_device_batch_size="
            f"{data.per_device_batch_size} are both set, but each decides the other; give one "
            f"(drop data.batch_size, or set data.batch_size=null, to keep the per-device batch "
            "and let the global batch grow with the devices)")


def batch_set_by(data: Any) -> str:
    """The key the global batch comes from. The per-device batch wins: a run's saved config
    records the resolved global batch in ``data.batch_size`` (``resolved_config``), and
    planning that config again must follow the per-device batch on whatever mesh it is planned
    for."""
    return PER_DEVICE if data.per_device_batch_size is not None else GLOBAL


def global_batch(data: Any, replicas: int, grad_accum: int) -> int:
    """Examples of one optimizer update across all devices."""
    if batch_set_by(data) == PER_DEVICE:
        return data.per_device_batch_size * replicas * grad_accum
    return data.batch_size


def default_seq_len(seq_len: int | None, max_seq_len: int, platform: str) -> int:
    """``data.seq_len``, or for null the platform's default: the model's whole context
    (``model.max_seq_len``) on an accelerator, ``CPU_SEQ_LEN`` (at most the context) on CPU."""
    if seq_len is not None:
        return int(seq_len)
    return min(CPU_SEQ_LEN, max_seq_len) if platform == "cpu" else int(max_seq_len)


def scaled_lr(opt: Any, batch_size: int) -> float:
    """Peak lr after the batch-size scaling rule, relative to ``optimizer.base_batch_size``."""
    ratio = batch_size / opt.base_batch_size
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[opt.lr_scaling]
    return opt.lr * factor


def check_tokens_per_step(key: str, value: int, batch: int, seq_len: int) -> None:
    """The loss divides by a step's tokens (global batch x seq_len), a Python int that JAX
    makes an int32: from 2^31 the jitted step fails to trace with an OverflowError. ``key``,
    ``value``: where the batch came from."""
    if batch * seq_len < INT32:
        return
    given = f"{key}={value}"
    if key == PER_DEVICE:
        given += f" (a global batch of {batch})"
    raise ConfigError(f"{given} with data.seq_len={seq_len} makes {batch * seq_len:,} tokens a "
                      f"step, beyond the int32 the loss divides by (at most {INT32 - 1:,}); "
                      f"lower {key} or data.seq_len")


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
