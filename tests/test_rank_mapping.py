"""Rank mapping of the fused ops (CPU): the in-graph [rank, group] operand that the GPU runtime
uses to find its peers must match the mesh layout, for multi-axis and permuted meshes."""
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxflux.ops._group_call import rank_info
from jaxflux.ops._mesh import expected_rank_info


def _mesh(shape, names, order):
  n = int(np.prod(shape))
  devices = jax.devices()
  if len(devices) < n:
    pytest.skip(f"needs {n} devices, have {len(devices)}")
  devices = np.asarray(devices[:n])[np.asarray(order)]
  return Mesh(devices.reshape(shape), names)


def _device_rank_info(mesh, axis_name):
  all_axes = tuple(mesh.axis_names)

  def body():
    info, num_groups = rank_info(axis_name)
    return info[None], np.full((1,), num_groups, np.int32)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(), out_specs=(P(all_axes), P(all_axes))))
  info, num_groups = f()
  info = np.asarray(info).reshape(mesh.devices.shape + (2,))
  result = {}
  for pos in np.ndindex(*mesh.devices.shape):
    result[int(mesh.devices[pos].id)] = tuple(int(v) for v in info[pos])
  return result, set(np.asarray(num_groups).tolist())


@pytest.mark.parametrize("shape,names,axis", [
    ((2, 4), ("dp", "tp"), "tp"),
    ((4, 2), ("dp", "tp"), "tp"),
    ((2, 4), ("tp", "dp"), "tp"),
    ((8,), ("tp",), "tp"),
    ((2, 2, 2), ("dp", "tp", "sp"), "tp"),
])
@pytest.mark.parametrize("order", ["natural", "reversed", "shuffled"])
def test_rank_info_matches_mesh(shape, names, axis, order):
  n = int(np.prod(shape))
  perm = {"natural": np.arange(n), "reversed": np.arange(n)[::-1],
          "shuffled": np.random.default_rng(0).permutation(n)}[order]
  mesh = _mesh(shape, names, perm)
  got, num_groups = _device_rank_info(mesh, axis)
  expected = expected_rank_info(mesh, axis)
  assert got == expected
  tp = mesh.shape[axis]
  assert num_groups == {n // tp}
  # Every group holds each rank exactly once.
  groups = {}
  for rank, group in expected.values():
    groups.setdefault(group, []).append(rank)
  assert all(sorted(r) == list(range(tp)) for r in groups.values())
  assert len(groups) == n // tp
