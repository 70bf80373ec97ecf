"""The kernel configuration of a fused call, chosen once from this GPU's tables (jaxflux.tuning).

The plan of an op call (_plan) holds it, so the forward's fused call and the GEMM-only target
at tp=1 read one choice; a backward's partner plan chooses its own for its shapes.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from jaxflux import _runtime, tuning


def choose(op: str, x, w, *, tp: int, transpose_w: bool, out_dtype) -> tuning.Tuned:
  """The configuration of `op` on per-device x [..., m, K] and w [K, n] ([n, K] with
  transpose_w) at group size tp, writing out_dtype (the partials the ops push are in it). At
  tp=1 an op is its GEMM alone, tuned as GEMM+AllReduce tunes its GEMM (by rows)."""
  name = jnp.dtype(x.dtype).name
  n = w.shape[0] if transpose_w else w.shape[1]
  k = x.shape[-1]
  itemsize = jnp.dtype(out_dtype).itemsize
  if tp == 1:
    return tuning.choose_tp1_gemm(dtype=name, rows=math.prod(x.shape[:-1]), k=k, n=n,
                                  itemsize=itemsize)
  batch, m = math.prod(x.shape[:-2]), x.shape[-2]
  if op == "all_gather_matmul":
    return tuning.choose_all_gather_matmul(dtype=name, tp=tp, rows=batch * tp * m, k=k, n=n,
                                           sms=_runtime.sm_count(), shard_rows=m)
  if op == "matmul_reduce_scatter":
    return tuning.choose_matmul_reduce_scatter(dtype=name, tp=tp, batch=batch, m=m // tp, k=k,
                                               n=n, itemsize=itemsize)
  return tuning.choose_matmul_all_reduce(dtype=name, tp=tp, batch=batch, m=m, k=k, n=n,
                                         itemsize=itemsize)
