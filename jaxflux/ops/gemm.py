"""Internal op: the GEMM-only mode of the fused kernels (communication switched off).

`gemm(x, w)` computes x [..., M, K] @ w [K, N] with the CUTLASS sm90 kernel that the fused
AllGather+GEMM and GEMM+ReduceScatter kernels build on. It exists to measure what the fused
path's GEMM costs against XLA's dot (cuBLAS) on the same shape: if this GEMM is slower, fusion
loses what it hides. Not a public API.
"""
from __future__ import annotations

import jax
import numpy as np

from jaxflux import _knobs, _runtime
from jaxflux.ops import _common


TILE_ORDERS = {"cutlass": 0, "all_gather_matmul": 1, "matmul_reduce_scatter": 2}


# The fused AllGather+GEMM kernel's tile configs (xla_ffi/kernels/ag_gemm_sm90.h, AgGemmConfig).
AG_GEMM_CONFIGS = ("coop_128x256_cluster2x1", "coop_128x256_cluster1x2",
                   "coop_256x128_cluster1x2", "pingpong_128x128_cluster1x2")


def config_index(op: str, config: str | None) -> int:
  """AG_GEMM_CONFIGS index of `config`; -1 (the kernel chooses) for None."""
  if config is None:
    return -1
  if config not in AG_GEMM_CONFIGS:
    raise ValueError(f"{op}: config={config!r} is not one of {AG_GEMM_CONFIGS} (or None to let "
                     "the kernel choose).")
  return AG_GEMM_CONFIGS.index(config)


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


def _kernel_call(op: str, target: str, out: jax.ShapeDtypeStruct, *operands, **attrs):
  """The FFI call of `target` once the platform can run it (else FusedKernelUnavailableError
  naming `op`); attrs are int64 attributes."""
  reason = _common.platform_reason()
  if reason is not None:
    raise _common.FusedKernelUnavailableError(f"{op}: {reason}")
  _knobs.check_environment(op)
  _runtime.register_targets()
  return jax.ffi.ffi_call(target, out)(*operands, **{k: np.int64(v) for k, v in attrs.items()})


def gemm(x, w, *, tile_order: str = "cutlass", config: str | None = None, owners: int = 1):
  """x [..., M, K] @ w [K, N] -> [..., M, N] in x's dtype (bf16/fp16, fp32 accumulation).

  tile_order: "cutlass" (CUTLASS's persistent scheduler), "all_gather_matmul" (the fused
  AllGather+GEMM kernel with its waits off: its GEMM-only mode) or "matmul_reduce_scatter" (the
  fused GEMM+ReduceScatter's GEMMs without pushes or reduction: one launch per owner's block of
  M / owners rows of every batch entry; its GEMM-only mode with owners = tp).
  config: with tile_order="all_gather_matmul", one of AG_GEMM_CONFIGS (None: the kernel's
  choice, or JAXFLUX_AG_GEMM_CONFIG).
  owners: with tile_order="matmul_reduce_scatter", how many row blocks; must divide M.
  """
  op = "gemm"
  _, n = _check_operands(op, x, w)
  if tile_order not in TILE_ORDERS:
    raise ValueError(f"{op}: tile_order={tile_order!r} is not one of {tuple(TILE_ORDERS)}.")
  config_id = config_index(op, config)
  rows = x.shape[-2]
  if tile_order == "matmul_reduce_scatter" and (owners < 1 or rows % owners):
    raise ValueError(f"{op}: owners={owners} must be >= 1 and divide M={rows} (x.shape[-2]).")
  return _kernel_call(op, "jaxflux_gemm", jax.ShapeDtypeStruct(x.shape[:-1] + (n,), x.dtype),
                      x, w, tile_order=TILE_ORDERS[tile_order], config=config_id, owners=owners)


OWN_ROWS_SCHEDULERS = ("fused", "cutlass")
OWN_ROWS_SCHEDULES = ("cooperative", "pingpong")


def gemm_own_rows(x, w, c=None, *, chunked: bool = False, scheduler: str = "fused",
                  schedule: str = "cooperative", transpose_w: bool = False):
  """x [..., M, K] @ w [K, N] (+ c [..., M, N]) with the fused GEMM+ReduceScatter's own-rows
  kernel alone (tp = 2's epilogue reduction, communication off: no peer, no waits).

  With c, the kernel reads it as the source C, as the fused op reads the peer's partial; without,
  the same kernel skips C (beta 0). Timing the two apart from the fused op says how much of the
  own-rows GEMM's extra time is the C read and how much the pushes running beside it.
  chunked: sweep the tiles along N, as the fused op does when the partial lands in row chunks.
  scheduler: "fused" (the fused ops' tile scheduler, as in the fused op) or "cutlass" (the same
  GEMM, tile order and epilogue under CUTLASS's own scheduler): what the scheduler itself costs.
  schedule: "cooperative" (128x256 tiles) or "pingpong" (128x128 tiles, the two consumer warp
  groups alternating tiles), the two the fused op chooses from (JAXFLUX_GEMM_RS_SCHEDULE).
  transpose_w: w is given as [N, K] and read K-major, as the fused op reads it in the backward
  of a column-parallel layer (the fused scheduler only).
  """
  op = "gemm_own_rows"
  if scheduler not in OWN_ROWS_SCHEDULERS:
    raise ValueError(f"{op}: scheduler must be one of {OWN_ROWS_SCHEDULERS}; got {scheduler!r}.")
  if schedule not in OWN_ROWS_SCHEDULES:
    raise ValueError(f"{op}: schedule must be one of {OWN_ROWS_SCHEDULES}; got {schedule!r}.")
  if scheduler == "cutlass" and schedule != "cooperative":
    raise ValueError(f"{op}: scheduler='cutlass' runs the cooperative schedule only; pass "
                     "schedule='cooperative' or scheduler='fused'.")
  if scheduler == "cutlass" and transpose_w:
    raise ValueError(f"{op}: scheduler='cutlass' reads the weight N-major only; pass "
                     "transpose_w=False or scheduler='fused'.")
  _, n = _check_operands(op, x, _common.weight_for_checks(w, transpose_w))
  out_shape = x.shape[:-1] + (n,)
  if c is not None and (tuple(c.shape) != out_shape or c.dtype != x.dtype):
    raise ValueError(f"{op}: c must have the output's shape {out_shape} and dtype {x.dtype}; "
                     f"got {tuple(c.shape)} {c.dtype}.")
  source = c if c is not None else jax.numpy.zeros((8,), x.dtype)  # not read without c
  return _kernel_call(op, "jaxflux_gemm_own_rows", jax.ShapeDtypeStruct(out_shape, x.dtype),
                      x, w, source, with_c=c is not None, chunked=chunked,
                      cutlass_scheduler=scheduler == "cutlass", pingpong=schedule == "pingpong",
                      transpose_w=transpose_w)


# The own-rows kernel's measured variants by name, as the benchmark scripts
# (benchmarks/ncu_gemms.py, benchmarks/fused_timeline.py) spell them:
# own_rows[_c][_chunked][_cutlass_scheduler|_pingpong][_kmajor]; _kmajor variants take the
# weight as [N, K] (transpose_w).
OWN_ROWS_VARIANTS = ("own_rows", "own_rows_c", "own_rows_chunked", "own_rows_c_chunked",
                     "own_rows_c_chunked_cutlass_scheduler", "own_rows_pingpong",
                     "own_rows_c_pingpong", "own_rows_chunked_pingpong",
                     "own_rows_c_chunked_pingpong", "own_rows_c_kmajor",
                     "own_rows_c_pingpong_kmajor", "own_rows_c_chunked_kmajor",
                     "own_rows_c_chunked_pingpong_kmajor")


def own_rows_variant(name: str) -> tuple[bool, dict]:
  """(whether the variant reads a source C, gemm_own_rows keyword arguments) of one of
  OWN_ROWS_VARIANTS."""
  if name not in OWN_ROWS_VARIANTS:
    raise ValueError(f"own-rows variant {name!r} is not one of {OWN_ROWS_VARIANTS}.")
  words = name.split("_")  # by word: "_c" is also in "_chunked"
  return "c" in words, {"chunked": "chunked" in words,
                        "scheduler": "cutlass" if "scheduler" in words else "fused",
                        "schedule": "pingpong" if "pingpong" in words else "cooperative",
                        "transpose_w": "kmajor" in words}


__all__ = ["gemm", "gemm_own_rows"]
