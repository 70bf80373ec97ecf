"""Internal op: tiled all-gather along axis -2 driven by copy engines (per-device view).

`all_gather(x, "tp")` inside `jax.shard_map` equals
`lax.all_gather(x, "tp", axis=x.ndim - 2, tiled=True)`: x [..., m, k] -> [..., tp*m, k].
It is the communication half of AllGather+GEMM and the proving ground of the GPU runtime
(docs/runtime.md): symmetric workspace, epoch flags, bounded waits and rank discovery.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxflux.ops import _common, _group_call, _plan, _platform

IMPLS = ("fused", "xla")


def all_gather(x, axis_name: str, *, impl: str = "fused", debug_skip_rank: int = -1):
  """Gathers x [..., m, k] over `axis_name` along axis -2: returns [..., tp*m, k].

  Args:
    x: local shard, rank >= 2, any dtype (the fused path copies bytes).
    axis_name: a manual mesh axis of the enclosing `jax.shard_map`.
    impl: "fused" (copy engines, needs jaxflux.has_cuda()) or "xla" (lax.all_gather).
    debug_skip_rank: test hook; that rank never signals, so its peers time out.
  """
  if impl not in IMPLS:
    raise ValueError(f"all_gather: impl={impl!r} is not one of {IMPLS}.")
  if not isinstance(axis_name, str):
    raise TypeError(f"all_gather: axis_name must be one mesh axis name (str), got {axis_name!r}.")
  if jnp.ndim(x) < 2:
    raise ValueError(f"all_gather: x must have rank >= 2 ([..., m, k]); got shape {jnp.shape(x)}.")
  if impl == "xla":
    return lax.all_gather(x, axis_name, axis=x.ndim - 2, tiled=True)
  tp = _plan.axis_size("all_gather", axis_name)
  if tp == 1:
    return x
  reason = _platform.platform_reason(axis_name)
  if reason is not None:
    raise _common.FusedKernelUnavailableError(f"all_gather(impl='fused'): {reason} Use "
                                              "impl='xla'.")
  shard_bytes = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
  out_shape = x.shape[:-2] + (tp * x.shape[-2], x.shape[-1])
  return _group_call.call("all_gather", jax.ShapeDtypeStruct(out_shape, x.dtype), (x,),
                          axis_name, item_bytes=shard_bytes, debug_skip_rank=debug_skip_rank)
