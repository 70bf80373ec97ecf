"""The benchmark under jax.distributed (one process per GPU, or per group of CPU devices).

Every process runs the same rows, variants and repeats in the same order (their collectives
must meet), times its own devices, and the processes agree on one number per timed run: the
slowest process's, as with the devices of one process. Only process 0 prints and writes the
JSON. `--distributed COORD,NUM,ID` joins the group; `examples/launch_multiprocess.py --bench`
starts one.
"""
from __future__ import annotations

import jax
import numpy as np


def join(spec: str | None, local_device_ids: str | None = None,
         cpu_devices: int | None = None) -> None:
  """Per-process JAX setup from the flags; must run before the first JAX operation.

  spec: "COORD,NUM,ID" (coordinator host:port, process count, this process's index), "auto"
  (JAX's cluster detection: SLURM, Open MPI) or None (single process).
  """
  if cpu_devices is not None:
    jax.config.update("jax_num_cpu_devices", cpu_devices)
  if spec == "auto":
    jax.distributed.initialize()
  elif spec:
    try:
      coordinator, num, pid = spec.split(",")
      num, pid = int(num), int(pid)
    except ValueError:
      raise ValueError(f"--distributed {spec!r}: expected COORD,NUM,ID, e.g. "
                       "127.0.0.1:1234,2,0") from None
    local = [int(i) for i in local_device_ids.split(",")] if local_device_ids else None
    # Explicit values: no cluster auto-detection (a SLURM allocation around a local launch
    # would otherwise override them).
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num,
                               process_id=pid, cluster_detection_method="deactivate",
                               local_device_ids=local)


def is_leader() -> bool:
  """Whether this process prints and writes results (process 0)."""
  return jax.process_index() == 0


def max_over_processes(value: float) -> float:
  """The largest of every process's `value` (a collective: every process must call it)."""
  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils
  return float(np.max(multihost_utils.process_allgather(np.float32(value))))


def all_processes(flag: bool) -> bool:
  """True when `flag` is true on every process (a collective, as max_over_processes)."""
  return max_over_processes(0.0 if flag else 1.0) == 0.0


def local_values(array: jax.Array) -> np.ndarray:
  """This process's shards of a 1-D-sharded array, concatenated in index order."""
  if array.is_fully_addressable:
    return np.asarray(array)
  shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
  return np.concatenate([np.asarray(s.data) for s in shards])
