"""The mesh and the random input arrays of a row, placed with the sharding each variant expects."""
from __future__ import annotations

import functools
import json
import math
import zlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxflux.bench import fp8_table
from jaxflux.bench.config import AXIS
from jaxflux.bench.rows import Row


def make_mesh(tp: int) -> Mesh:
  devices = jax.devices()
  if tp > len(devices):
    raise ValueError(f"--tp {tp}: only {len(devices)} local devices")
  return Mesh(np.asarray(devices[:tp]), (AXIS,), axis_types=(AxisType.Auto,))


def _input_layouts(row: Row) -> dict[str, tuple[tuple[int, ...], P]]:
  """Global shape and PartitionSpec of every array a row's variants take."""
  M, K, N, tp = row.M, row.K, row.N, row.tp
  if row.op == "gemm":  # one device: the per-device operands themselves, unsharded
    if row.of == "ag_gemm":
      return {"x": ((M, K), P()), "w": ((K, N // tp), P())}
    if row.of == "gemm_ar":
      return {"x": ((M, K // tp), P()), "w": ((K // tp, N), P())}
    m, k = M // tp, K // tp
    # gemm_only's two row blocks and own_rows' operands are arrays of their own: a slice of x
    # passed to a custom call would be copied first, inside the timed program.
    return {"x": ((M, k), P()), "w": ((k, N), P()), "x_peer": ((M - m, k), P()),
            "x_own": ((m, k), P()), "c": ((m, N), P())}
  if row.op == "all_gather":
    return {"x": ((M, K), P(AXIS, None))}
  if row.op == "ag_gemm":
    return {"x": ((M, K), P(AXIS, None)), "w": ((K, N), P(None, AXIS)),
            # gemm: each device multiplies its own full [M, K] by its w shard.
            "x_full": ((tp * M, K), P(AXIS, None)),
            # jaxflux_wt: w given transposed (made from w, see make_inputs).
            "wt": ((N, K), P(AXIS, None))}
  return {"x": ((M, K), P(None, AXIS)), "w": ((K, N), P(AXIS, None)),
          # gemm_only: x's two row blocks as arrays of their own (tp=2).
          "x_peer": ((M - M // tp, K), P(None, AXIS)), "x_own": ((M // tp, K), P(None, AXIS)),
          # comm: each device reduce-scatters its own [M, N] partial.
          "partial": ((tp * M, N), P(AXIS, None)),
          "wt": ((N, K), P(None, AXIS))}


def _main_input_bytes_per_device(row: Row) -> int:
  names = ("x",) if row.op == "all_gather" else ("x", "w")
  layouts = _input_layouts(row)
  devices = 1 if row.op == "gemm" else row.tp
  return sum(math.prod(layouts[n][0]) for n in names) // devices * row.itemsize


def input_set_count(row: Row, rotate_mib: float) -> int:
  """How many independent input sets to rotate through so repeated calls don't run from L2."""
  if rotate_mib <= 0:
    return 1
  return int(min(8, max(1, math.ceil(rotate_mib * 2**20 / _main_input_bytes_per_device(row)))))


@functools.lru_cache(maxsize=64)
def random_input(shape: tuple[int, ...], dtype: str, sharding: NamedSharding) -> Callable:
  return jax.jit(lambda key: jax.random.normal(key, shape, jnp.dtype(dtype)),
                 out_shardings=sharding)


@functools.lru_cache(maxsize=64)
def _transposer(sharding: NamedSharding) -> Callable:
  return jax.jit(lambda w: w.T, out_shardings=sharding)


def make_inputs(row: Row, mesh: Mesh, n_sets: int, seed: int) -> list[dict[str, jax.Array]]:
  """Fresh standard-normal arrays (never zeros), generated in place with their final sharding;
  an FP8 row's quantized from them (fp8_table.make_inputs)."""
  sets = []
  base = jax.random.fold_in(jax.random.key(seed), zlib.crc32(json.dumps(row.key()).encode()) >> 1)
  if row.fp8:
    return fp8_table.make_inputs(row, mesh, n_sets, base)
  for s in range(n_sets):
    arrays = {}
    layouts = _input_layouts(row)
    for i, (name, (shape, spec)) in enumerate(sorted(layouts.items())):
      if name == "wt":  # w itself, transposed: the variant must compute the same product
        continue
      key = jax.random.fold_in(jax.random.fold_in(base, s), i)
      arrays[name] = random_input(shape, row.dtype, NamedSharding(mesh, spec))(key)
    if "wt" in layouts:
      arrays["wt"] = _transposer(NamedSharding(mesh, layouts["wt"][1]))(arrays["w"])
    sets.append(arrays)
  jax.block_until_ready(sets)
  return sets
