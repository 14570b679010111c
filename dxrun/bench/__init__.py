"""The benchmark suite: every figure a ratio of variants measured side by side in one run.

    python -m dxrun.bench [--quick] [--gpu] [--out BENCHMARKS.md]

``timing`` interleaves the variants; ``reference`` is the hand-written step dxrun's is measured
against; ``speed`` holds the timed figures, ``structure`` the exact ones (collectives per layer,
state bytes), ``gpu`` the GPU figures (measured, or plan mode's roofline estimate), ``report``
writes BENCHMARKS.md's suite section and the JSON beside it.
"""
