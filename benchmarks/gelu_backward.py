"""The one-device benchmark's MLP alone (x [12, 64, 128] -> d_ff 512 -> 128, fp32), forward and
backward under one ``jax.jit``, by activation, interleaved in one process: what the tanh GELU's
elementwise backward costs XLA:CPU next to the MLP's matmuls (the activation "none" is the
matmuls alone). Prints ms per call (median of per-repetition medians) and the loop fusions of
the compiled program that write a transposed layout.

    python -m benchmarks.gelu_backward [--steps 20 --reps 5]
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp

from benchmarks.timing import interleaved

ACTIVATIONS = {"none": lambda h: h, "relu": jax.nn.relu,
               "gelu_tanh": lambda h: jax.nn.gelu(h, approximate=True)}


def program(act):  # noqa: ANN001
    def loss(w_up_DxF, w_down_FxD, x_BxLxD):
        h_BxLxF = act(jnp.einsum("bld,df->blf", x_BxLxD, w_up_DxF))
        return (jnp.einsum("blf,fd->bld", h_BxLxF, w_down_FxD) ** 2).sum()

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    k = jax.random.split(jax.random.key(0), 3)
    args = (0.02 * jax.random.normal(k[0], (128, 512)), 0.02 * jax.random.normal(k[1], (512, 128)),
            jax.random.normal(k[2], (12, 64, 128)))
    compiled = {n: program(f).lower(*args).compile() for n, f in ACTIVATIONS.items()}
    t = interleaved({n: (lambda c=c: jax.block_until_ready(c(*args)))
                     for n, c in compiled.items()}, a.steps, a.reps)
    for n, c in compiled.items():
        transposing = len(re.findall(r"^\s*ROOT %\S+ = \S+ (?:bitcast\(%copy|copy\(%transpose)",
                                     c.as_text(), re.M))
        print(f"{n:<10} {1e3 * t[n].median_s:7.2f} ms  cpu {1e3 * t[n].cpu_s:7.2f} ms  "
              f"fusions ending in a transposing copy: {transposing}")


if __name__ == "__main__":
    main()
