"""Internal op: the GEMM-only mode of the fused kernels (communication switched off).

`gemm(x, w)` computes x [..., M, K] @ w [K, N] with the CUTLASS sm90 kernel that the fused
AllGather+GEMM and GEMM+ReduceScatter kernels build on. It exists to measure what the fused
path's GEMM costs against XLA's dot (cuBLAS) on the same shape: if this GEMM is slower, fusion
loses what it hides. Not a public API.
"""
from __future__ import annotations

import jax

from jaxflux import _runtime
from jaxflux.ops import _common


def gemm(x, w):
  """x [..., M, K] @ w [K, N] -> [..., M, N] in x's dtype (bf16/fp16, fp32 accumulation)."""
  op = "gemm"
  _common.check_operands(op, x, w)
  for name, a in (("x", x), ("w", w)):
    if a.dtype not in _common.FUSED_DTYPES or a.dtype != x.dtype:
      raise TypeError(f"{op}: x and w must share a dtype, bfloat16 or float16; got x.dtype="
                      f"{x.dtype}, w.dtype={w.dtype}.")
  k, n = w.shape
  if k % 8 or n % 8:
    raise ValueError(f"{op}: K={k} and N={n} must be multiples of 8 (16-byte rows for TMA).")
  reason = _common.platform_reason()
  if reason is not None:
    raise _common.FusedKernelUnavailableError(f"{op}: {reason}")
  _runtime.register_targets()
  out = jax.ShapeDtypeStruct(x.shape[:-1] + (n,), x.dtype)
  return jax.ffi.ffi_call("jaxflux_gemm", out)(x, w)


__all__ = ["gemm"]
