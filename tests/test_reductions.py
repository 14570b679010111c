"""Reductions equal NumPy on the gathered arrays, in jit and under a real shard_map; the first
import path (``dxrun.metrics``) still gives them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dxrun.model import reductions as M
from dxrun.model import sharding


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh(dp=2, fsdp=2, tp=2)


@pytest.fixture(scope="module")
def data(mesh):
    host = np.random.default_rng(0).normal(size=(8, 6)).astype(np.float32)
    return host, jax.device_put(host, NamedSharding(mesh, P(("data", "fsdp"), "tensor")))


def test_global_reductions_in_jit(data):
    host, x = data
    got = jax.jit(lambda a: {"mean": M.reduce_mean(a), "sum": M.reduce_sum(a),
                             "max": M.reduce_max(a), "min": M.reduce_min(a)})(x)
    np.testing.assert_allclose(got["mean"], host.mean(), rtol=1e-6)
    np.testing.assert_allclose(got["sum"], host.sum(), rtol=1e-5)
    assert float(got["max"]) == host.max() and float(got["min"]) == host.min()


def test_reduce_custom(data):
    host, x = data
    steps = jnp.arange(8)
    got = jax.jit(lambda a, s: M.reduce_custom({"loss": a, "step": s, "n": a},
                                               {"loss": "mean", "step": "max", "n": "sum"}))(x, steps)
    np.testing.assert_allclose(got["loss"], host.mean(), rtol=1e-6)
    assert int(got["step"]) == 7
    np.testing.assert_allclose(got["n"], host.sum(), rtol=1e-5)
    assert set(M.reduce_custom({"a": x}, {})) == {"a"}  # default op: mean


@pytest.mark.parametrize("ops", [{"loss": "median"}, {"loss": "avg"}, {"absent": "mean"}])
def test_reduce_custom_rejects_unknown_ops(data, ops):
    _, x = data
    with pytest.raises(ValueError, match="reduce_custom"):
        M.reduce_custom({"loss": x}, ops)
    with pytest.raises(ValueError):
        M.reduce_custom({"loss": x}, {}, default=None)


def test_collect_from_devices(data, mesh):
    host, x = data
    shards = M.collect_from_devices(x)
    assert len(shards) == 8 and all(s.shape == (2, 3) for s in shards)
    # Device d holds rows of its (data, fsdp) coordinate and columns of its tensor coordinate.
    ids = mesh.devices.reshape(-1)
    for d, shard in zip(sorted(ids, key=lambda d: d.id), shards, strict=True):
        i, j, e, c, k = (int(v[0]) for v in np.nonzero(mesh.devices == d))  # (expert, context: 1)
        assert e == c == 0
        row = (i * 2 + j) * 2
        np.testing.assert_array_equal(shard, host[row:row + 2, k * 3:k * 3 + 3])


def test_collective_forms_under_shard_map(data, mesh):
    host, x = data

    def body(a):  # a: this device's [2, 3] block
        return (M.reduce_mean_collective(a.mean())[None], M.reduce_sum_collective(a.sum())[None],
                M.all_gather(a), M.reduce_sum_collective(a.sum(), ("data", "fsdp", "tensor")))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("data", "fsdp"), "tensor"),
                              out_specs=(P("tensor"), P("tensor"), P(None, "tensor"), P()),
                              check_vma=False))
    mean, total, gathered, everything = f(x)
    # Default axes are the batch axes: each tensor column block is reduced over the rows.
    for k in range(2):
        cols = host[:, k * 3:(k + 1) * 3]
        np.testing.assert_allclose(mean[k], cols.mean(), rtol=1e-5)
        np.testing.assert_allclose(total[k], cols.sum(), rtol=1e-5)
    np.testing.assert_array_equal(gathered, host)
    np.testing.assert_allclose(everything, host.sum(), rtol=1e-5)


def test_the_first_import_path_gives_the_same_functions():
    from dxrun import metrics

    assert metrics.__all__ == M.__all__
    assert all(getattr(metrics, name) is getattr(M, name) for name in M.__all__)
