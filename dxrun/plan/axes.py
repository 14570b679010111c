"""The mesh's axis sizes (pure), axis by axis over ``schema_parallel.AXES``: ``Sizes``, the
ordered mapping of axis key to size a layout and a mesh plan hold; from the config's, one size
inferred from the device count, or the mesh shrunk to fit (``parallelism.on_mismatch=shrink``).
An axis that ``AXES`` marks not inferable (the ``context`` axis: chosen for the sequence, not
for the device count) is never inferred. A ``Layout`` is the sizes with the recomputation and
the micro-batches a run is laid out with.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from dxrun.config import (
    AXES,
    Axis,
    ConfigError,
)


class Sizes(Mapping[str, int]):
    """Each mesh axis's size by its key, in ``AXES``' order: read-only and hashable (a layout
    holding it is a dict key); an axis not given is 1 (a record written before that axis)."""

    __slots__ = ("_d",)

    def __init__(self, sizes: Mapping[str, int] | None = None, /, **more: int) -> None:
        given = {**(sizes or {}), **more}
        if unknown := sorted(set(given) - {a.key for a in AXES}):
            raise TypeError(f"no mesh axis {', '.join(unknown)} (the axes: schema_parallel.AXES)")
        self._d = {a.key: given.get(a.key, 1) for a in AXES}

    def __getitem__(self, key: str) -> int:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __hash__(self) -> int:
        return hash(tuple(self._d.items()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._d) == dict(other.items())

    def __reduce__(self) -> tuple[Any, ...]:
        return Sizes, (self._d,)

    def __repr__(self) -> str:
        return f"Sizes({', '.join(f'{k}={v}' for k, v in self._d.items())})"

    @property
    def n(self) -> int:
        """The devices they multiply to."""
        return math.prod(self._d.values())


class AxisAttrs:
    """``.dp``, ``.fsdp``, ``.cp``, ``.tp`` (any key of ``AXES``): its size in ``self.sizes``;
    ``.replicas``, the devices that split the batch."""

    sizes: Sizes

    @property
    def replicas(self) -> int:
        return replicas_of(self.sizes)

    def __getattr__(self, name: str) -> int:
        if name != "sizes" and any(a.key == name for a in AXES):
            return self.sizes[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def replicas_of(sizes: Mapping[str, int]) -> int:
    """The product of the batch axes' sizes (``Axis.batch``): data replicas, each a group of
    the other axes' devices computing the same rows."""
    return math.prod(sizes[a.key] for a in AXES if a.batch)


def named(sizes: Mapping[str, int]) -> list[tuple[Axis, int]]:
    """The axes a message or table names, with their sizes: every inferable axis, and one that
    is not (the context axis) or serves some models only (the expert axis: ``only_with``)
    only where it is used (size > 1)."""
    return [(a, sizes[a.key]) for a in AXES
            if (a.inferable and not a.only_with) or sizes[a.key] > 1]


def resolve_axes(sizes: dict[str, int], n: int) -> dict[str, int]:
    """``sizes`` (each axis's, by key, in ``AXES``' order) with the one -1 among them inferred
    so that their product is ``n``."""
    sizes = {a.key: sizes.get(a.key, 1) for a in AXES}  # an axis not given: 1
    inferred = [k for k, v in sizes.items() if v == -1]
    for a in AXES:
        v = sizes[a.key]
        if v == 0 or v < -1 or (not a.inferable and v < 1):
            raise ConfigError(f"parallelism.{a.key}={v} must be a positive size"
                              + (" or -1 (inferred)" if a.inferable else ""))
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
    return sizes


def shrink(sizes: dict[str, int], n: int) -> dict[str, int]:
    """Largest mesh that fits n devices: the axes give up sizes in ``AXES``' order (data
    replicas first, then fsdp, then context, then tensor)."""
    sizes = {a.key: sizes.get(a.key, 1) for a in AXES}  # an axis not given: 1
    while math.prod(sizes.values()) > n:
        k = next(k for k, v in sizes.items() if v > 1)
        sizes[k] //= min(p for p in range(2, sizes[k] + 1) if sizes[k] % p == 0)
    return sizes


@dataclass(frozen=True)
class Layout(AxisAttrs):
    """How a run is laid out: the mesh (``sizes``: each axis's size by key; ``.dp``, ``.tp``,
    ... read one), the recomputation (``model.remat``) and the micro-batches of one update
    (``train.grad_accum``)."""

    sizes: Sizes = Sizes()
    remat: str = "none"
    grad_accum: int = 1

    @classmethod
    def of(cls, remat: str = "none", grad_accum: int = 1, **sizes: int) -> Layout:
        """``Layout.of(dp=4, tp=2, remat="dots")``: the axes by key, those not given 1."""
        return cls(Sizes(sizes), remat, grad_accum)

    @property
    def mesh(self) -> str:
        """The preset-style name: ``dp4_tp2``, ``fsdp8``, ``dp2_fsdp2_tp2``, ``cp2_tp4``, ``dp1``."""
        parts = [f"{k}{v}" for k, v in self.sizes.items() if v > 1]
        return "_".join(parts) or "dp1"

    @property
    def mesh_sizes(self) -> dict[str, int]:
        """Each axis's size by its JAX mesh axis name (``data``, ``fsdp``, ...)."""
        return {a.mesh: self.sizes[a.key] for a in AXES}

    @property
    def label(self) -> str:
        extra = [f"remat={self.remat}"] * (self.remat != "none") + [
            f"accum={self.grad_accum}"] * (self.grad_accum > 1)
        return " ".join([self.mesh, *extra])

    def overrides(self) -> dict[str, Any]:
        """The config keys that name this layout (what a run's saved record holds)."""
        return {"parallelism": dict(self.sizes), "model": {"remat": self.remat},
                "train": {"grad_accum": self.grad_accum}}

    def to_json(self) -> dict[str, Any]:
        """The layout as a ranking row holds it: each axis's size by key, remat, grad_accum
        (what ``layout_of`` reads back)."""
        return {**self.sizes, "remat": self.remat, "grad_accum": self.grad_accum}


def layout_of(row: dict[str, Any]) -> Layout:
    """The layout of a ranking row or record (``plan.json``'s), an axis it lacks 1 (cp, in
    one written before the context axis)."""
    return Layout(Sizes({a.key: row[a.key] for a in AXES if a.key in row}), row["remat"],
                  row["grad_accum"])
