"""The kernel configuration of a fused call, chosen once from this GPU's tables (jaxflux.tuning).

The plan of an op call (_plan) holds it, so the forward's fused call and the GEMM-only target
at tp=1 read one choice; a backward's partner plan chooses its own for its shapes.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jaxflux import _runtime
from jaxflux.tuning import chooser


def choose(op: str, x, w, *, tp: int, transpose_w: bool, out_dtype) -> chooser.Tuned:
  """The configuration of `op` on per-device x [..., m, K] and w [K, n] ([n, K] with
  transpose_w) at group size tp, writing out_dtype (the partials the ops push are in it). At
  tp=1 an op is its GEMM alone, tuned as GEMM+AllReduce tunes its GEMM (by rows)."""
  name = jnp.dtype(x.dtype).name
  n = w.shape[0] if transpose_w else w.shape[1]
  k = x.shape[-1]
  itemsize = jnp.dtype(out_dtype).itemsize
  if tp == 1:
    return chooser.choose_tp1_gemm(dtype=name, rows=math.prod(x.shape[:-1]), k=k, n=n,
                                  itemsize=itemsize)
  batch, m = math.prod(x.shape[:-2]), x.shape[-2]
  if op == "all_gather_matmul":
    tuned = chooser.choose_all_gather_matmul(dtype=name, tp=tp, rows=batch * tp * m, k=k, n=n,
                                            sms=_runtime.sm_count(), shard_rows=m)
  elif op == "matmul_reduce_scatter":
    tuned = chooser.choose_matmul_reduce_scatter(dtype=name, tp=tp, batch=batch, m=m // tp, k=k,
                                                n=n, itemsize=itemsize)
  else:
    tuned = chooser.choose_matmul_all_reduce(dtype=name, tp=tp, batch=batch, m=m, k=k, n=n,
                                            itemsize=itemsize)
  return _leave_sms_to_peers(tuned)


# SMs a fused GEMM leaves free where ranks share one GPU: a peer's push within one device is a
# copy kernel, which a GEMM holding every SM while it spins on that push would starve (one did,
# in a two-rank matrix run without the cap; 100 of an H100's 132 ran at tp 2, 4 and 8).
SHARED_GPU_FREE_SMS = 32


def _leave_sms_to_peers(tuned: chooser.Tuned) -> chooser.Tuned:
  """tuned, its grid capped at SMs - SHARED_GPU_FREE_SMS where processes share a GPU (every
  process caps alike: the rule reads the job-wide ranks_per_gpu)."""
  sms = _runtime.sm_count()
  if _runtime.ranks_per_gpu() <= 1 or sms <= SHARED_GPU_FREE_SMS:
    return tuned
  cap = sms - SHARED_GPU_FREE_SMS
  if 0 < tuned.choice.grid_sms <= cap:
    return tuned
  return tuned._replace(choice=dataclasses.replace(tuned.choice, grid_sms=cap))
