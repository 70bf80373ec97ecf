"""Internal op: the fused kernels' GEMMs on one GPU with communication off (benchmark feature).

`gemm(x, w, kernel=...)` computes x [..., M, K] @ w [K, N] (+ c for the own-rows kernel) with
one of the CUTLASS sm90 kernels the fused ops run, tuned from jaxflux.tuning as the fused ops
would tune it. Timing it against XLA's dot (cuBLAS) on the same shape says what the fused path's
GEMM costs: if it is slower, fusion loses what it hides. Not a public API.

Kernels (the `kernel` attribute of the jaxflux_gemm target):
  "cutlass"            CUTLASS's persistent GEMM, the one GEMM+RS runs for its peers' rows
  "all_gather_matmul"  the AG+GEMM kernel with its waits off (one shard, no rotation)
  "own_rows"           GEMM+RS's own-rows kernel with its waits off: x @ w + c, c [..., M, N]
  "matmul_all_reduce"  GEMM+AllReduce's GEMM: CUTLASS's persistent GEMM (kernel 0) with the
                       tile the fused op picks (`tile` 0: stock 128x256, 1: stream-K 128x128)
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxflux import _runtime, tuning
from jaxflux.ops import _common, _platform

KERNELS = {"cutlass": 0, "all_gather_matmul": 1, "own_rows": 2, "matmul_all_reduce": 0}


def _check_operands(op: str, x, w) -> tuple[int, int]:
  """The kernels' operand rules at trace time: x [..., M, K] and w [K, N] of one dtype, bf16 or
  fp16, K and N multiples of 8. Returns (K, N)."""
  _common.check_operands(op, x, w)
  if x.dtype not in _common.FUSED_DTYPES or w.dtype != x.dtype:
    raise TypeError(f"{op}: x and w must share a dtype, bfloat16 or float16; got x.dtype="
                    f"{x.dtype}, w.dtype={w.dtype}.")
  k, n = w.shape
  if k % 8 or n % 8:
    raise ValueError(f"{op}: K={k} and N={n} must be multiples of 8 (16-byte rows for TMA).")
  return k, n


def _check_c(op: str, kernel: str, c, out_shape: tuple, dtype) -> None:
  if kernel != "own_rows":
    if c is not None:
      raise ValueError(f"{op}: c is read by kernel='own_rows' only; pass c=None with "
                       f"kernel={kernel!r}.")
    return
  if c is None:
    raise ValueError(f"{op}: kernel='own_rows' computes x @ w + c and needs c, laid out like the "
                     f"output {out_shape} in {dtype} (zeros for a plain product).")
  if tuple(c.shape) != out_shape or c.dtype != dtype:
    raise ValueError(f"{op}: c must have the output's shape {out_shape} and dtype {dtype}; "
                     f"got {tuple(c.shape)} {c.dtype}.")


def attributes(kernel: str, dtype, rows: int, k: int, n: int) -> dict:
  """The jaxflux_gemm attributes of `kernel` for an [rows, k] @ [k, n] product (all rows of x),
  tuned as the fused ops tune the same GEMM (transpose_w aside)."""
  name = jnp.dtype(dtype).name
  attrs = {"kernel": KERNELS[kernel], "tile": 0, "own_rows_schedule": 0, "push_chunks": 0}
  if kernel == "all_gather_matmul":
    choice = tuning.choose_all_gather_matmul(dtype=name, tp=2, rows=rows, n=n,
                                             sms=_runtime.sm_count()).choice
    attrs.update(tile=tuning.AG_TILES.index(choice.tile), swizzle=choice.swizzle)
  elif kernel == "matmul_all_reduce":  # as the fused op at tp=2 tunes an unbatched x of `rows`
    choice = tuning.choose_matmul_all_reduce(dtype=name, tp=2, batch=1, m=rows, k=k, n=n,
                                             itemsize=jnp.dtype(dtype).itemsize).choice
    attrs.update(tile=tuning.AR_TILES.index(choice.tile), swizzle=choice.swizzle)
  else:
    choice = tuning.choose_own_rows_gemm(dtype=name, rows=rows, k=k, n=n,
                                         itemsize=jnp.dtype(dtype).itemsize).choice
    if kernel == "cutlass":
      attrs.update(swizzle=choice.peer_rows_swizzle)
    else:
      attrs.update(own_rows_schedule=tuning.OWN_ROWS_SCHEDULES.index(choice.own_rows_schedule),
                   push_chunks=int(choice.push == "chunked"), swizzle=choice.own_rows_swizzle)
  attrs["grid_sms"] = choice.grid_sms
  return attrs


def gemm(x, w, *, kernel: str = "cutlass", c=None, transpose_w: bool = False):
  """x [..., M, K] @ w [K, N] (+ c) -> [..., M, N] in x's dtype (bf16/fp16, fp32 accumulation).

  kernel: "cutlass", "all_gather_matmul", "own_rows" or "matmul_all_reduce" (module
    docstring).
  c: with kernel="own_rows", the source added to the product ([..., M, N], x's dtype), as the
    fused op adds the peer's partial; None for the other kernels.
  transpose_w: w is given as [N, K] and read K-major, as the fused ops read it in a backward.
  """
  op = "gemm"
  if kernel not in KERNELS:
    raise ValueError(f"{op}: kernel={kernel!r} is not one of {tuple(KERNELS)}.")
  k, n = _check_operands(op, x, _common.weight_for_checks(w, transpose_w))
  out_shape = tuple(x.shape[:-1]) + (n,)
  _check_c(op, kernel, c, out_shape, x.dtype)
  rows = math.prod(x.shape[:-1])
  attrs = attributes(kernel, x.dtype, rows, k, n)
  reason = _platform.platform_reason()
  if reason is not None:
    raise _common.FusedKernelUnavailableError(f"{op}(kernel={kernel!r}): {reason}")
  _runtime.register_targets()
  source = c if c is not None else jnp.zeros((8,), x.dtype)  # not read by kernels 0 and 1
  call = jax.ffi.ffi_call("jaxflux_gemm", jax.ShapeDtypeStruct(out_shape, x.dtype))
  return call(x, w, source, transpose_w=np.int64(transpose_w),
              **{name: np.int64(value) for name, value in attrs.items()})


__all__ = ["KERNELS", "gemm"]
