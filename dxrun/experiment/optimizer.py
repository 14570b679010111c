"""Optimizer and learning-rate schedule from the ``optimizer`` section (optax); your own optax
factory through ``optimizer._target_``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import optax

from dxrun.config import ConfigError, checked_factory
from dxrun.plan import scaled_lr

if TYPE_CHECKING:
    from dxrun.config import OptimizerConfig


def make_schedule(opt: OptimizerConfig, peak_lr: float, steps: int) -> optax.Schedule:
    warmup = min(opt.warmup_steps, steps)
    end_lr = peak_lr * opt.min_lr_ratio
    if opt.schedule == "constant":
        if warmup == 0:
            return optax.constant_schedule(peak_lr)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, peak_lr, warmup), optax.constant_schedule(peak_lr)],
            [warmup])
    if opt.schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak_lr, warmup, max(steps, warmup + 1),
                                                  end_value=end_lr)
    # wsd: warmup, stable at the peak, then a linear decay over the last decay_frac of training.
    decay = max(1, int(round(steps * opt.decay_frac)))
    stable = max(0, steps - warmup - decay)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak_lr, max(warmup, 1)),
         optax.constant_schedule(peak_lr),
         optax.linear_schedule(peak_lr, end_lr, decay)],
        [warmup, warmup + stable])


def decay_mask(params: dict, decay_all: bool) -> dict:
    """Weight decay on weight matrices only: not on norm scales, biases (named ``b*``, also the
    2-D per-head ones) or the embedding tables."""
    def keep(path: tuple, leaf: Any) -> bool:
        top, name = str(getattr(path[0], "key", "")), str(getattr(path[-1], "key", ""))
        is_bias_or_norm = name == "scale" or name.startswith("b")
        return decay_all or not (is_bias_or_norm or top in ("wte", "wpe"))
    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(opt: OptimizerConfig, params: dict, batch_size: int, steps: int
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = make_schedule(opt, scaled_lr(opt, batch_size), steps)
    mask = decay_mask(params, opt.decay_all)
    if opt._target_:
        tx = custom_optimizer(opt._target_, schedule, dict(opt.kwargs))
    elif opt.name == "adamw":
        tx = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                         weight_decay=opt.weight_decay, mask=mask)
    elif opt.name == "lion":
        tx = optax.lion(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay, mask=mask)
    else:
        tx = optax.chain(optax.add_decayed_weights(opt.weight_decay, mask),
                         optax.sgd(schedule, momentum=opt.momentum or None))
    if opt.clip_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(opt.clip_norm), tx)
    return tx, schedule


def custom_optimizer(target: str, schedule: optax.Schedule, kwargs: dict[str, Any]
                     ) -> optax.GradientTransformation:
    """``optimizer._target_``: ``target(learning_rate=schedule, **kwargs)``, which must be an
    optax ``GradientTransformation`` (Hydra's ``_target_`` convention: a dotted path)."""
    factory = checked_factory("optimizer", target, kwargs)
    tx = factory(learning_rate=schedule, **kwargs)
    if not isinstance(tx, optax.GradientTransformation):
        raise ConfigError(f"optimizer._target_={target} returned a {type(tx).__name__}, not an "
                          "optax GradientTransformation")
    return tx
