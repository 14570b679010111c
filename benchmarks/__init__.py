"""dxrun's benchmarks, one home: the suite and the single measurements, run from the checkout
(not shipped in the wheel: nothing in ``dxrun`` imports them).

    python -m benchmarks [--quick] [--gpu] [--auto] [--published] [--out BENCHMARKS.md]
    python -m benchmarks.NAME ...     # one measurement (a script that imports nothing of the
                                      # suite also runs as python benchmarks/NAME.py)

The suite: ``timing`` interleaves the variants; ``reference`` is the hand-written step dxrun's
is measured against; ``speed`` holds the timed figures, ``structure`` the exact ones
(collectives per layer, state bytes), ``gpu`` the GPU figures (measured, or plan mode's
roofline estimate), ``report`` writes BENCHMARKS.md's sections and the JSON beside them.
"""
