"""Which implementation a call runs: impl="auto" | "fused" | "xla" -> "fused" or "xla",
resolved once per call at trace time. "fused" raises where no fused kernel can run (never a
silent fallback); "auto" takes the fused kernel only where it can run and an AUTO_RULES rule of
the tuning table says it was measured ahead of XLA. FP8 calls have no auto rule (no two-GPU
timing of the FP8 kernels exists): "auto" takes XLA, "fused" the FP8 kernel or an error.

At tp=1 nothing is communicated: the fused call is the op's GEMM alone, so only the platform
(not the mesh's other axes or processes) and the operands decide."""
from __future__ import annotations

from jaxflux import tuning
from jaxflux.ops import _common, _platform


def resolve(op: str, impl: str, x, w, *, out_dtype, tp: int, axis_name: str,
            transpose_w: bool, fp8: bool) -> str:
  """"fused" or "xla" for `op` on checked per-device x, w inside shard_map over `axis_name`
  (size tp), writing `out_dtype`. With transpose_w, w is given as [N, K]."""
  if impl == "xla":
    return "xla"
  if fp8:
    return _resolve_fp8(op, impl, x, w, out_dtype, tp, axis_name, transpose_w)
  w = _common.weight_for_checks(w, transpose_w)
  dtype_error = _platform.fused_dtype_error(op, x, w)
  if dtype_error is not None:
    if impl == "fused":
      raise TypeError(dtype_error)
    return "xla"
  reason = (_platform.platform_reason(axis_name if tp > 1 else None)
            or _platform.fused_operand_reason(x, w, out_dtype, tp))
  if reason is not None:
    if impl == "fused":
      raise _common.FusedKernelUnavailableError(
          f"{op}(impl='fused'): {reason} Use impl='auto' to fall back to XLA where the fused "
          "kernel cannot run.")
    return "xla"
  return "fused" if impl == "fused" or _auto_prefers_fused(op, x, tp) else "xla"


def _auto_prefers_fused(op: str, x, tp: int) -> bool:
  k = x.shape[-1]
  rows = x.size // k  # batch * rows of x
  if op == "all_gather_matmul":
    rows *= tp  # the gathered rows the GEMM computes
  return tuning.auto_prefers_fused(op, tp, rows, k)


def _resolve_fp8(op: str, impl: str, x, w, out_dtype, tp: int, axis_name: str,
                 transpose_w: bool) -> str:
  """FP8 operands (checked and paired by the plan): "auto" -> XLA; "fused" -> the FP8 kernel
  where every condition holds, else FusedKernelUnavailableError naming the first that fails."""
  if impl == "auto":
    return "xla"
  reason = (_platform.fused_fp8_dtype_reason(x, w)
            or _platform.platform_reason(axis_name if tp > 1 else None)
            or _platform.fused_fp8_operand_reason(x, w, out_dtype, tp, transpose_w))
  if reason is not None:
    raise _common.FusedKernelUnavailableError(
        f"{op}(impl='fused') with FP8 operands: {reason} Use impl='xla' (or 'auto', which takes "
        "XLA for FP8) to run XLA's FP8 dot instead.")
  return "fused"
