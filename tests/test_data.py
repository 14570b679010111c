"""The markov source: exact floor, data independent of the mesh, learnable to the floor."""

from __future__ import annotations

import numpy as np
import pytest

from dxrun.checks import validate
from dxrun.config.errors import ConfigError
from dxrun.data import EVAL, TRAIN, MarkovSource


def test_floor_is_the_empirical_conditional_entropy():
    src = MarkovSource(symbols=5, order=2, branching=3, seed=3, batch_size=512, seq_len=32)
    # Estimate E[-log p(x_t | context)] over sampled windows with the chain's own table: it
    # must match the exact floor (same positions, same averaging).
    nll = []
    for step in range(8):
        x = src.batch(step)
        ctx = x[:, 0] * src.S + x[:, 1]
        for t in range(2, x.shape[1]):
            row = src.succ[ctx] == x[:, t:t + 1]
            nll.append(-np.log((src.prob[ctx] * row).sum(1)))
            ctx = (ctx * src.S + x[:, t]) % src.S**2
    rate = float(np.mean(nll))
    assert abs(rate - src.entropy_rate) < 0.01, (rate, src.entropy_rate)
    assert src.entropy_floor > src.entropy_rate  # the first target has less context
    # The floor itself: each window's first target is predicted from one token, at the cost
    # H(X1 | X0) of the stationary pair law, the other seq_len - 1 from the full context (the
    # rate). So the floor fixes the first target's cost; measure it on the sampled windows
    # (4,096 of them: standard error ~0.01 nats; the floor of the rate alone would be 0.59 off).
    pair = src.pi.reshape(src.S, src.S)
    first = np.concatenate([-np.log(pair[x[:, 0], x[:, 1]] / pair.sum(1)[x[:, 0]])
                            for x in (src.batch(step) for step in range(8))])
    implied = src.seq_len * src.entropy_floor - (src.seq_len - 1) * src.entropy_rate
    assert abs(float(first.mean()) - implied) < 0.05, (first.mean(), implied)


def test_order_one_floor_is_the_rate():
    src = MarkovSource(symbols=7, order=1, branching=2, seed=0, batch_size=4, seq_len=16)
    assert src.entropy_floor == src.entropy_rate
    assert 0 < src.entropy_rate < np.log(2) + 1e-12


def test_stationary_distribution_is_stationary():
    src = MarkovSource(symbols=6, order=2, branching=3, seed=1, batch_size=4, seq_len=8)
    n = src.S**src.k
    P = np.zeros((n, n))
    for c in range(n):
        for s, p in zip(src.succ[c], src.prob[c], strict=True):
            P[c, (c * src.S + s) % n] += p
    np.testing.assert_allclose(src.pi @ P, src.pi, atol=1e-10)


def test_batch_depends_only_on_seed_and_step():
    a = MarkovSource(symbols=16, order=2, branching=3, seed=7, batch_size=8, seq_len=12)
    b = MarkovSource(symbols=16, order=2, branching=3, seed=7, batch_size=8, seq_len=12)
    np.testing.assert_array_equal(a.batch(5), b.batch(5))
    assert a.batch(5).shape == (8, 13) and a.batch(5).dtype == np.int32
    assert not np.array_equal(a.batch(5), a.batch(6))
    assert not np.array_equal(a.batch(5, TRAIN), a.batch(5, EVAL))
    c = MarkovSource(symbols=16, order=2, branching=3, seed=8, batch_size=8, seq_len=12)
    assert not np.array_equal(a.batch(5), c.batch(5))
    assert a.batch(3).max() < 16


def test_stationary_solve_that_does_not_converge_is_refused():
    kw = dict(symbols=6, order=2, branching=3, seed=1, batch_size=4, seq_len=8)
    with pytest.raises(ConfigError, match=r"did not converge in 3 iterations") as err:
        MarkovSource(**kw, max_iter=3)
    assert "data.symbols=6, data.order=2" in str(err.value) and "\n" not in str(err.value)
    MarkovSource(**kw)  # the default budget converges


def test_markov_tables_are_checked_in_bytes(cfg_factory):
    # 2048^2 = 4M contexts passed the old context cap, but the tables need ~129 GiB.
    big = cfg_factory("data.symbols=2048", "data.vocab_size=2048", "data.order=2")
    with pytest.raises(ConfigError) as err:
        validate(big)
    msg = str(err.value)
    assert "data.symbols=2048 with data.order=2 makes 4,194,304 contexts" in msg, msg
    assert "128.7 GiB (limit 2 GiB)" in msg and "\n" not in msg
    validate(cfg_factory("data.symbols=256", "data.vocab_size=256", "data.order=2"))  # 0.3 GiB
