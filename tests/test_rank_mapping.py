"""Rank mapping of the fused ops (CPU): the in-graph [rank, group] operand that the GPU runtime
uses to find its peers must match the mesh layout, for multi-axis and permuted meshes; and the
runtime's one-process rendezvous must pair the devices of each run."""
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


# The handlers' one-process rendezvous (xla_ffi/runtime/discovery.cc), each device a thread: the
# devices of one XLA run meet; calls with equal signature keys pair up in program order.

@pytest.fixture
def meet():
  from jaxflux import _runtime
  if not _runtime.cuda_built():
    pytest.skip("needs the CUDA build of the extension (its host-side runtime needs no GPU)")
  _runtime._ext.set_timeout_ns(int(2e9))
  yield _runtime._ext._meet_local_peers
  _runtime._push_settings()


def _devices_meet(meet, calls):
  """Runs meet(ordinal, rank, group, run, site, tp) for every call, each device's calls in order
  on its own thread; returns {(ordinal, call index): peers or the error}."""
  import threading

  by_device, results = {}, {}
  for i, call in enumerate(calls):
    by_device.setdefault(call[0], []).append((i, call))

  def device(items):
    for i, call in items:
      try:
        results[call[0], i] = meet(*call)
      except RuntimeError as e:
        results[call[0], i] = str(e)

  threads = [threading.Thread(target=device, args=(items,)) for items in by_device.values()]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return results


def test_one_traced_call_run_over_disjoint_gpus_meets_per_run(meet):
  """Pipeline stages in one process: the same call (site) over GPUs {0, 1} and over {2, 3},
  two runs at once, each pair with its own (the ranks alone would pair 0 with 2)."""
  site = 1234
  calls = [(0, 0, 0, 11, site, 2), (1, 1, 0, 11, site, 2),
           (2, 0, 0, 12, site, 2), (3, 1, 0, 12, site, 2)]
  got = _devices_meet(meet, calls)
  assert got[0, 0] == got[1, 1] == [0, 1], got
  assert got[2, 2] == got[3, 3] == [2, 3], got


def test_equal_keys_in_one_run_pair_up_in_program_order(meet):
  """Two layers' identical calls in one program: each device's first call meets the others'
  first; ranks permuted between the two calls must come out permuted."""
  run, site = 21, 99
  calls = [(4, 0, 0, run, site, 2), (4, 1, 0, run, site, 2),
           (5, 1, 0, run, site, 2), (5, 0, 0, run, site, 2)]
  got = _devices_meet(meet, calls)
  assert got[4, 0] == got[5, 2] == [4, 5], got
  assert got[4, 1] == got[5, 3] == [5, 4], got


def test_a_missing_rank_times_out_naming_what_it_found(meet):
  with pytest.raises(RuntimeError, match=r"GPU 6 \(rank 0, group 0\) found only these local "
                                         r"devices of its call after 2000 ms: GPU 6=rank 0"):
    meet(6, 0, 0, 31, 7, 2)
