"""The rows a model's vocabulary tables really have: a multiple of tp (the vocab axis is split
over ``tensor``) and, on an accelerator, of an alignment that tiles its matmul units evenly."""

from __future__ import annotations

import math
from typing import Any

# Accelerators get the vocabulary padded to a multiple of 128 as well (nanoGPT's 50304, MaxText):
# the output matmul's vocab axis then tiles the tensor cores / MXU evenly. On CPU only tp matters,
# so CPU runs (and the tests) keep the smallest table.
VOCAB_ALIGN = {"gpu": 128, "cuda": 128, "rocm": 128, "tpu": 128}


def vocab_align(platform: str, given: int = 0) -> int:
    """``parallelism.vocab_align`` when set (> 0), else the platform's (VOCAB_ALIGN; 1 on CPU).
    Setting it makes another platform's layout here, e.g. a GPU run's 128-padding on CPU."""
    return given or VOCAB_ALIGN.get(platform, 1)


def padded_vocab(vocab_size: int, tp: int, platform: str, align: int = 0) -> int:
    """The smallest multiple of lcm(tp, alignment) that holds ``vocab_size`` rows (``align``:
    ``parallelism.vocab_align``, 0 = the platform's)."""
    multiple = math.lcm(tp, vocab_align(platform, align))
    return -(-vocab_size // multiple) * multiple


def table_rows(model: Any) -> int:
    """The vocabulary rows the model's tables must hold (the model section ``model``): the
    vocabulary, and for ``model.objective=mdlm`` its [MASK] token after it (``dxrun.model.mdlm``),
    which then always sits in the first padding row."""
    return model.vocab_size + (getattr(model, "objective", "ar") == "mdlm")
