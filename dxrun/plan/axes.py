"""The mesh's axis sizes from the config's (pure): one size inferred from the device count, or
the mesh shrunk to fit (``parallelism.on_mismatch=shrink``). ``cp`` (the ``context`` axis) is
never inferred: it is chosen for the sequence, not for the device count."""

from __future__ import annotations

import math

from dxrun.errors import ConfigError


def resolve_axes(dp: int, fsdp: int, tp: int, n: int, cp: int = 1) -> tuple[int, int, int]:
    """(dp, fsdp, tp) with the one -1 among them inferred so that dp*fsdp*cp*tp = ``n``."""
    sizes = {"dp": dp, "fsdp": fsdp, "cp": cp, "tp": tp}
    inferred = [k for k, v in sizes.items() if v == -1]
    for k, v in sizes.items():
        if v == 0 or v < -1 or (k == "cp" and v < 1):
            raise ConfigError(f"parallelism.{k}={v} must be a positive size"
                              + (" or -1 (inferred)" if k != "cp" else ""))
    if len(inferred) > 1:
        raise ConfigError(
            f"parallelism: {' and '.join('parallelism.' + k for k in inferred)} are both -1; "
            "at most one axis can be inferred, set the others to sizes"
        )
    if inferred:
        known = math.prod(v for v in sizes.values() if v != -1)
        if n % known:
            # Name what the user set (the sized axes), not the axis dxrun was asked to infer.
            typed = [k for k, v in sizes.items() if v > 1] or [k for k, v in sizes.items() if v != -1]
            set_ = " x ".join(f"parallelism.{k}={sizes[k]}" for k in typed)
            fits = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
            fix = (f"pick parallelism.{typed[0]} from {fits}" if len(typed) == 1
                   else f"make their product divide {n}")
            raise ConfigError(
                f"{set_} does not divide the {n} devices in use, so parallelism.{inferred[0]} "
                f"cannot be inferred; {fix}, or set parallelism.n_devices to a multiple of {known}"
            )
        sizes[inferred[0]] = n // known
    return sizes["dp"], sizes["fsdp"], sizes["tp"]


def shrink(dp: int, fsdp: int, cp: int, tp: int, n: int) -> tuple[int, int, int, int]:
    """Largest mesh that fits n devices: give up data replicas first, then fsdp, then context,
    then tp."""
    sizes = [dp, fsdp, cp, tp]
    while math.prod(sizes) > n:
        i = next(i for i in range(4) if sizes[i] > 1)
        sizes[i] //= min(p for p in range(2, sizes[i] + 1) if sizes[i] % p == 0)
    return sizes[0], sizes[1], sizes[2], sizes[3]
