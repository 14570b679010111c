"""The global batch and the learning rate that goes with it: pure, no JAX.

A run gives its batch one of two ways. ``data.batch_size`` is the global batch of one optimizer
update (all devices together). ``data.per_device_batch_size=B`` is what one data replica
computes at once, so the global batch grows with the mesh: ``B x dp x fsdp x
train.grad_accum``. Hydra cannot tell a default from a value the user typed, so
``data.batch_size`` defaults to ``${default_batch:${data.per_device_batch_size}}``: 32 when no
per-device batch is given, null when one is; a ``data.batch_size`` beside a per-device batch
was set on purpose and is refused (``check_batch_keys``).

``data.seq_len: null`` (the real-data presets' default) is the model's context on an
accelerator and 64 on CPU (``default_seq_len``), where short windows keep the run quick.
"""
from __future__ import annotations

import math
from typing import Any

from dxrun.config.errors import ConfigError
from dxrun.config.schema import GLOBAL, INT32, PER_DEVICE

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
