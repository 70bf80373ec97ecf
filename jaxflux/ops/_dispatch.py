"""Which implementation a call runs: impl="auto" | "fused" | "xla" -> "fused" or "xla", resolved
once per call at trace time, by one rule for every op family (dense, FP8, grouped, MoE):

  "xla"    XLA.
  "fused"  the kernel, or an error saying why it can't run here (never a silent fallback).
  "auto"   the kernel where it can run and a rule of the tuning table (AUTO_RULES,
           jaxflux/tuning/table.py) says it was measured ahead of XLA for this op, group size,
           rows, operands (16-bit or FP8) and kind of GPU; XLA elsewhere. FP8 calls have one
           rule so far: the decode rows at tp=1 on an H100.

Each op family says why its kernel can't run (a `reason`); `decide` applies the rule. At tp=1
nothing is communicated: the fused call is the op's GEMM alone, so only the platform (not the
mesh's other axes or processes) and the operands decide."""
from __future__ import annotations

import functools
from typing import Callable

from jaxflux import tuning
from jaxflux.ops import _common, _platform

# What an impl='fused' error suggests.
FALL_BACK = "Use impl='auto' to fall back to XLA where the fused kernel cannot run."
FP8_FALL_BACK = ("Use impl='xla' (or 'auto', which takes XLA for FP8 where no measured rule "
                 "says otherwise) to run XLA's FP8 dot instead.")


def decide(op: str, impl: str, reason: Callable[[], str | None], *, tp: int, rows: int, k: int,
           fp8: bool = False, fix: str | None = None) -> str:
  """"fused" or "xla" for a call of `op` (checked impl) at group size tp on a GEMM of `rows`
  rows and contraction K_local `k`. reason() says why the kernel can't run here (None: it can);
  it is asked only where the answer matters (impl="fused", or a rule that takes the kernel).
  impl="fused" with a reason raises FusedKernelUnavailableError ending with `fix`."""
  if impl == "xla":
    return "xla"
  if impl == "auto" and not tuning.auto_prefers_fused(op, tp, rows, k, fp8=fp8):
    return "xla"
  why = reason()
  if why is None:
    return "fused"
  if impl == "auto":
    return "xla"
  what = f"{op}(impl='fused') with FP8 operands" if fp8 else f"{op}(impl='fused')"
  fix = (FP8_FALL_BACK if fp8 else FALL_BACK) if fix is None else fix
  raise _common.FusedKernelUnavailableError(f"{what}: {why} {fix}".rstrip())


def resolve(op: str, impl: str, x, w, *, out_dtype, tp: int, axis_name: str,
            transpose_w: bool, fp8: bool) -> str:
  """"fused" or "xla" for the dense `op` on checked per-device x, w inside shard_map over
  `axis_name` (size tp), writing `out_dtype`. With transpose_w, w is given as [N, K]."""
  if impl == "xla":
    return "xla"
  k = x.shape[-1]
  rows = x.size // k  # batch * rows of x
  if op == "all_gather_matmul":
    rows *= tp  # the gathered rows the GEMM computes
  group_axis = axis_name if tp > 1 else None
  if fp8:
    return decide(op, impl, functools.partial(_platform.fused_fp8_reason, x, w, out_dtype, tp,
                                              group_axis, transpose_w),
                  tp=tp, rows=rows, k=k, fp8=True)
  w = _common.weight_for_checks(w, transpose_w)
  dtype_error = _platform.fused_dtype_error(op, x, w)
  if dtype_error is not None:
    if impl == "fused":
      raise TypeError(dtype_error)
    return "xla"
  return decide(op, impl, functools.partial(_platform.fused_reason, x, w, out_dtype, tp,
                                            group_axis),
                tp=tp, rows=rows, k=k)
