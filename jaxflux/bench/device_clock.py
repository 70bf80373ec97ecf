"""A GPU-side clock for the benchmark (`--timing device`).

Dispatch timing (`--timing dispatch`) measures the host's wall time from the first queued call
to the end of the last: when a call is shorter than the host's dispatch of it (tens of µs per
jitted call), or the run is short next to the final synchronization, the host shows through.
Here every device reads its own global timer (`%globaltimer`, ns) in stream order before and
after the timed calls, through the FFI target `jaxflux_device_clock`. The first read idles the
stream for a while first, so that the host has queued every timed call behind it before the GPU
starts them: the GPU then runs them back to back, as it would inside a long training step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxflux import _runtime
from jaxflux.bench import processes
from jaxflux.bench.config import AXIS

# Time the host is given to queue the timed calls: generous per call (a jitted multi-device
# call costs tens of µs to dispatch), plus a fixed margin; capped by what the target accepts.
SPIN_PER_CALL_NS = 300_000
SPIN_BASE_NS = 20_000_000
SPIN_MAX_NS = 5_000_000_000


def available() -> bool:
  return "jaxflux_device_clock" in _runtime.register_targets()


def spin_ns_for(calls: int) -> int:
  return min(SPIN_BASE_NS + SPIN_PER_CALL_NS * calls, SPIN_MAX_NS)


class DeviceClock:
  """Reads every device's global timer in stream order, one jitted program per read."""

  def __init__(self, mesh: Mesh):
    if not available():
      raise RuntimeError("--timing device needs the CUDA build of jaxflux and a GPU "
                         "(jaxflux_device_clock is not registered here)")
    self.n = mesh.size

    def read(after, spin_ns: int):
      call = jax.ffi.ffi_call("jaxflux_device_clock", jax.ShapeDtypeStruct((2,), jnp.uint32))
      return call(after, spin_ns=np.int64(spin_ns))

    sharding = NamedSharding(mesh, P(AXIS))
    # From host memory: under jax.distributed each process places its own devices' part.
    self._after = jax.device_put(np.zeros((self.n,), np.int32), sharding)
    self._programs = {}
    self._mesh = mesh
    self._read = read

  def _program(self, spin_ns: int):
    if spin_ns not in self._programs:
      body = lambda a: self._read(a, spin_ns)  # noqa: E731
      self._programs[spin_ns] = jax.jit(jax.shard_map(
          body, mesh=self._mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False))
    return self._programs[spin_ns]

  def read(self, spin_ns: int = 0) -> jax.Array:
    """Queues one read on every device (after idling `spin_ns`); returns it, not waited for."""
    return self._program(spin_ns)(self._after)

  @staticmethod
  def nanoseconds(words: jax.Array) -> np.ndarray:
    """This process's devices' timer values (uint64 ns) from a read's {low, high} words."""
    if isinstance(words, jax.Array):
      words = processes.local_values(words)
    w = np.asarray(words, dtype=np.uint64).reshape(-1, 2)
    return w[:, 0] | (w[:, 1] << np.uint64(32))


def elapsed_ms_per_call(start: jax.Array, end: jax.Array, calls: int) -> float:
  """The slowest device's time between the two reads, per call, in ms (of this process's
  devices: the caller takes the maximum over processes)."""
  t0, t1 = DeviceClock.nanoseconds(start), DeviceClock.nanoseconds(end)
  return float(np.max(t1 - t0)) / 1e6 / calls
