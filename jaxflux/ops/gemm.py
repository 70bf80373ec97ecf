"""Internal op: the GEMM-only mode of the fused kernels (communication switched off).

`gemm(x, w)` computes x [..., M, K] @ w [K, N] with the CUTLASS sm90 kernel that the fused
AllGather+GEMM and GEMM+ReduceScatter kernels build on. It exists to measure what the fused
path's GEMM costs against XLA's dot (cuBLAS) on the same shape: if this GEMM is slower, fusion
loses what it hides. Not a public API.
"""
from __future__ import annotations

import jax
import numpy as np

from jaxflux import _runtime
from jaxflux.ops import _common


TILE_ORDERS = {"cutlass": 0, "all_gather_matmul": 1}


def gemm(x, w, *, tile_order: str = "cutlass"):
  """x [..., M, K] @ w [K, N] -> [..., M, N] in x's dtype (bf16/fp16, fp32 accumulation).

  tile_order: "cutlass" (CUTLASS's persistent scheduler) or "all_gather_matmul" (the fused
  AllGather+GEMM kernel with its waits off: its GEMM-only mode).
  """
  op = "gemm"
  _common.check_operands(op, x, w)
  for name, a in (("x", x), ("w", w)):
    if a.dtype not in _common.FUSED_DTYPES or a.dtype != x.dtype:
      raise TypeError(f"{op}: x and w must share a dtype, bfloat16 or float16; got x.dtype="
                      f"{x.dtype}, w.dtype={w.dtype}.")
  k, n = w.shape
  if k % 8 or n % 8:
    raise ValueError(f"{op}: K={k} and N={n} must be multiples of 8 (16-byte rows for TMA).")
  if tile_order not in TILE_ORDERS:
    raise ValueError(f"{op}: tile_order={tile_order!r} is not one of {tuple(TILE_ORDERS)}.")
  reason = _common.platform_reason()
  if reason is not None:
    raise _common.FusedKernelUnavailableError(f"{op}: {reason}")
  _runtime.register_targets()
  out = jax.ShapeDtypeStruct(x.shape[:-1] + (n,), x.dtype)
  call = jax.ffi.ffi_call("jaxflux_gemm", out)
  return call(x, w, tile_order=np.int64(TILE_ORDERS[tile_order]))


__all__ = ["gemm"]
