"""The ``model.moe`` section: a mixture-of-experts MLP in place of the dense one every
``every`` layers after ``first_dense`` dense ones (dxrun/model/moe.py builds it), written as
``dxrun.config.schema`` writes its keys, and the checks its keys need beyond their ranges
(``check_moe``; ``check_experts_divide`` against the mesh's ``expert`` axis, from the plan).
``n_experts=0``, the default, is the dense model.

Pure: no JAX, no import of dxrun beyond the config's key and errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dxrun.config.errors import ConfigError
from dxrun.config.key import NON_NEGATIVE, POSITIVE, key


@dataclass
class MoEConfig:
    n_experts: int = key(0, "routed experts per MoE layer; 0 = a dense model (no MoE layer)",
                         range=NON_NEGATIVE)
    top_k: int = key(2, "experts each token is routed to", range=POSITIVE)
    d_ff: int | None = key(None, "each expert's hidden width; null = model.d_ff",
                           range=POSITIVE)
    every: int = key(1, "every this many layers (after first_dense) is an MoE layer, the last "
                     "of each group (Qwen-MoE's decoder_sparse_step)", range=POSITIVE)
    first_dense: int = key(0, "dense layers before the first group (DeepSeek's "
                           "first_k_dense_replace)", range=NON_NEGATIVE)
    shared_d_ff: int = key(0, "hidden width of the shared expert every token passes through "
                           "(Qwen-MoE; DeepSeek: n_shared_experts x its d_ff); 0 = none",
                           range=NON_NEGATIVE)
    shared_gate: bool = key(False, "a sigmoid gate of the token on the shared expert's output "
                            "(Qwen2-MoE)")
    router: str = key("softmax", "softmax over the experts, then the top k (Mixtral, Qwen) | "
                      "sigmoid per expert, top k chosen with a balancing bias (DeepSeek-V3)",
                      choices=("softmax", "sigmoid"))
    renormalize: bool = key(True, "the top k weights divided by their sum (Mixtral, Qwen3, "
                            "DeepSeek-V3: true; Qwen2-MoE: false)")
    routed_scale: float = key(1.0, "the routed experts' output multiplied by this "
                              "(DeepSeek-V3's routed_scaling_factor)", range=POSITIVE)
    bias_rate: float = key(0.0, "router=sigmoid: the balancing bias moves by this per step "
                           "towards the mean load (DeepSeek-V3's gamma, 0.001); 0 = fixed",
                           range=NON_NEGATIVE)
    aux_loss: float = key(0.01, "the load-balancing loss's coefficient (n_experts x sum of "
                          "each expert's share of the routed tokens x its mean router "
                          "probability; 1 when balanced)", range=NON_NEGATIVE)
    z_loss: float = key(0.001, "the router z-loss's coefficient (mean squared logsumexp of "
                        "the router logits)", range=NON_NEGATIVE)
    capacity_factor: float | None = key(
        None, "null = dropless (every routed token computed); c = each expert takes at most "
        "c x tokens x top_k / n_experts of a batch's tokens, the rest dropped (counted: "
        "moe/dropped)", range=POSITIVE)


def moe_layers(n_layers: int, moe: Any) -> tuple[bool, ...]:
    """Which layers are MoE layers: after ``first_dense``, the last of each ``every``."""
    if not moe.n_experts:
        return (False,) * n_layers
    return tuple(i >= moe.first_dense and (i - moe.first_dense + 1) % moe.every == 0
                 for i in range(n_layers))


def expert_d_ff(m: Any) -> int:
    """An expert's hidden width: ``model.moe.d_ff``, else ``model.d_ff``."""
    return m.moe.d_ff or m.d_ff


def check_moe(m: Any) -> None:
    """Raise ConfigError (key, value, fix) for ``model.moe`` keys that do not fit together or
    with the model (``m``, the model section)."""
    moe = m.moe
    if not moe.n_experts:
        return
    if moe.top_k > moe.n_experts:
        raise ConfigError(f"model.moe.top_k={moe.top_k} is more than model.moe.n_experts="
                          f"{moe.n_experts}; set model.moe.top_k<={moe.n_experts}")
    if moe.first_dense >= m.n_layers:
        raise ConfigError(f"model.moe.first_dense={moe.first_dense} leaves no MoE layer of "
                          f"model.n_layers={m.n_layers}; set model.moe.first_dense<{m.n_layers}")
    if (m.n_layers - moe.first_dense) % moe.every:
        raise ConfigError(
            f"model.moe.every={moe.every} does not divide the {m.n_layers - moe.first_dense} "
            f"layers after model.moe.first_dense={moe.first_dense} (the layers scan in groups "
            f"of every); pick model.moe.every dividing {m.n_layers - moe.first_dense}")
    if moe.shared_gate and not moe.shared_d_ff:
        raise ConfigError("model.moe.shared_gate=true gates a shared expert, but "
                          "model.moe.shared_d_ff=0 has none; set model.moe.shared_d_ff")
    if moe.bias_rate and moe.router != "sigmoid":
        raise ConfigError(f"model.moe.bias_rate={moe.bias_rate} moves the sigmoid router's "
                          f"balancing bias, but model.moe.router={moe.router}; set "
                          "model.moe.router=sigmoid or model.moe.bias_rate=0")
    if m.get("_target_"):
        raise ConfigError(f"model.moe.n_experts={moe.n_experts} builds dxrun's own model, not "
                          f"model._target_={m._target_}; drop one of them")


def check_experts_divide(m: Any, ep: int, tp: int) -> None:
    """The experts split evenly over the ``expert`` mesh axis, their widths over ``tensor``."""
    moe = m.moe
    if ep > 1 and not moe.n_experts:
        raise ConfigError(f"parallelism.ep={ep} splits the experts, but model.moe.n_experts=0 "
                          "(a dense model); set parallelism.ep=1 or model.moe.n_experts")
    if moe.n_experts % ep:
        raise ConfigError(
            f"model.moe.n_experts={moe.n_experts} is not divisible by parallelism.ep={ep}; "
            f"pick an ep that divides {moe.n_experts} (each expert device holds "
            "n_experts / ep experts)")
    for name, width in (("d_ff", expert_d_ff(m) if moe.n_experts else 0),
                        ("shared_d_ff", moe.shared_d_ff)):
        if width % tp:
            raise ConfigError(f"model.moe.{name}={width} is not divisible by parallelism.tp="
                              f"{tp}; pick a tp that divides {width}")

