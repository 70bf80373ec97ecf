"""The GEMM-only target (jaxflux_gemm): the fused kernels' GEMMs on one GPU, no communication.

Two users. `call` is the tp=1 path of every dense op (all_gather_matmul, matmul_reduce_scatter
and matmul_all_reduce with nothing to gather or reduce run their GEMM alone through it, with
the choice their plan made). `gemm(x, w, kernel=...)` runs any of the fused ops' GEMMs with its
communication off, tuned as the op would tune it: timing it against XLA's dot (cuBLAS) on the
same shape says what the fused path's GEMM costs (the benchmark's and `jaxflux.tune`'s GEMM
rows); if it is slower, fusion loses what it hides. `gemm` is not a public API.

FP8 (x float8_e4m3fn or float8_e5m2, w float8_e4m3fn given transposed, [N, K]): the output is
bfloat16 (x @ w) * x_scale * w_scale with x_scale [..., M, 1] and w_scale [1, N] float32, the
scales applied in the epilogue, as the fused FP8 ops run it. `accumulate` picks kernel 0's
accumulation ("fast": wgmma's accumulator; "promoted": fp32 registers every 4 k-blocks); the
fused kernels are built with "fast" (FP8_ACCUMULATE, per x dtype).

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

from jaxflux import _runtime
from jaxflux.tuning import chooser
from jaxflux.ops import _attributes, _common, _plan, _platform

KERNELS = _attributes.GEMM_KERNELS
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
# How the fused FP8 kernels accumulate, per x dtype (xla_ffi/kernels/gemm_sm90.h, kFp8FastAccum).
FP8_ACCUMULATE = {"float8_e4m3fn": "fast", "float8_e5m2": "fast"}


def _check_operands(op: str, x, w) -> tuple[int, int]:
  """The kernels' operand rules at trace time: x [..., M, K] and w [K, N] of one dtype, bf16 or
  fp16, K and N multiples of 8; or FP8 x and an e4m3 w, K and N multiples of 16. Returns
  (K, N)."""
  _plan.check_operands(op, x, w)
  if x.dtype in FP8_DTYPES:
    if w.dtype != jnp.float8_e4m3fn:
      raise TypeError(f"{op}: FP8 x ({x.dtype}) needs a float8_e4m3fn w; got {w.dtype}.")
    k, n = w.shape
    if k % 16 or n % 16:
      raise ValueError(f"{op}: FP8 needs K={k} and N={n} to be multiples of 16 (16-byte rows).")
    return k, n
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


def choose(kernel: str, dtype, rows: int, k: int, n: int, out_itemsize: int | None = None):
  """The tuning choice of `kernel` for an [rows, k] @ [k, n] product (all rows of x), as the
  fused ops tune the same GEMM (transpose_w aside). out_itemsize: bytes of an output element
  (the partials the ops push), default the input's."""
  name = jnp.dtype(dtype).name
  itemsize = jnp.dtype(dtype).itemsize if out_itemsize is None else out_itemsize
  if kernel == "all_gather_matmul":
    return chooser.choose_all_gather_matmul(dtype=name, tp=2, rows=rows, k=k, n=n,
                                           sms=_runtime.sm_count(),
                                           shard_rows=rows // 2 if rows % 2 == 0 else 0).choice
  if kernel == "matmul_all_reduce":
    return chooser.choose_tp1_gemm(dtype=name, rows=rows, k=k, n=n, itemsize=itemsize).choice
  return chooser.choose_own_rows_gemm(dtype=name, rows=rows, k=k, n=n, itemsize=itemsize).choice


def _fp8_scales(op: str, x, x_scale, w_scale, n: int, transpose_w: bool, out_dtype,
                kernel: str, accumulate):
  """The FP8 call's checks; returns (scale operands, out dtype, fast_accum attribute)."""
  if not transpose_w:
    raise ValueError(f"{op}: FP8 kernels read w K-major; pass its transpose [N, K] with "
                     "transpose_w=True.")
  for name, scale, shape in (("x_scale", x_scale, tuple(x.shape[:-1]) + (1,)),
                             ("w_scale", w_scale, (1, n))):
    if scale is None or tuple(scale.shape) != shape or scale.dtype != jnp.float32:
      got = None if scale is None else f"{tuple(scale.shape)} {scale.dtype}"
      raise ValueError(f"{op}: FP8 needs {name} float32 {shape}; got {got}.")
  out_dtype = jnp.dtype(jnp.bfloat16 if out_dtype is None else out_dtype)
  if out_dtype != jnp.bfloat16:
    raise TypeError(f"{op}: FP8 kernels write bfloat16; got out_dtype={out_dtype}.")
  built = FP8_ACCUMULATE[jnp.dtype(x.dtype).name]
  accumulate = built if accumulate is None else accumulate
  if accumulate not in ("fast", "promoted") or (kernel != "cutlass" and accumulate != built):
    raise ValueError(f"{op}: accumulate={accumulate!r}: kernel='cutlass' takes 'fast' or "
                     f"'promoted'; the fused kernels' {x.dtype} build is {built!r}.")
  return (x_scale, w_scale), out_dtype, int(accumulate == "fast")


def gemm(x, w, *, kernel: str = "cutlass", c=None, transpose_w: bool = False, x_scale=None,
         w_scale=None, out_dtype=None, accumulate: str | None = None):
  """x [..., M, K] @ w [K, N] (+ c) -> [..., M, N] in x's dtype (bf16/fp16, fp32 accumulation);
  FP8: bfloat16 (x @ w) * x_scale * w_scale (module docstring).

  kernel: "cutlass", "all_gather_matmul", "own_rows" or "matmul_all_reduce" (module
    docstring).
  c: with kernel="own_rows", the source added to the product ([..., M, N], the output's
    dtype), as the fused op adds the peer's partial; None for the other kernels.
  transpose_w: w is given as [N, K] and read K-major, as the fused ops read it in a backward
    (FP8: always).
  x_scale, w_scale: FP8 only, float32 [..., M, 1] and [1, N].
  out_dtype: FP8 only, bfloat16 (the default).
  accumulate: FP8 only: None (as the fused kernels are built), "fast" or "promoted" (kernel
    "cutlass" only).
  """
  op = "gemm"
  if kernel not in KERNELS:
    raise ValueError(f"{op}: kernel={kernel!r} is not one of {tuple(KERNELS)}.")
  _, n = _check_operands(op, x, _common.weight_for_checks(w, transpose_w))
  fp8 = x.dtype in FP8_DTYPES
  scales, fast_accum, out = (), 0, x.dtype
  if fp8:
    scales, out, fast_accum = _fp8_scales(op, x, x_scale, w_scale, n, transpose_w, out_dtype,
                                          kernel, accumulate)
  elif x_scale is not None or w_scale is not None or out_dtype is not None or accumulate:
    raise ValueError(f"{op}: x_scale, w_scale, out_dtype and accumulate are for FP8 x only.")
  _check_c(op, kernel, c, tuple(x.shape[:-1]) + (n,), out)
  reason = _platform.platform_reason()
  if reason is not None:
    raise _common.FusedKernelUnavailableError(f"{op}(kernel={kernel!r}): {reason}")
  choice = choose(kernel, x.dtype, math.prod(x.shape[:-1]), x.shape[-1], n,
                  out_itemsize=jnp.dtype(out).itemsize)
  attrs = {**_attributes.gemm(kernel, choice), "transpose_w": int(transpose_w)}
  return call(x, w, attributes=attrs, c=c, scales=scales, out_dtype=out, fast_accum=fast_accum)


def call(x, w, *, attributes: dict, out_dtype, c=None, scales: tuple = (), fast_accum: int = 0):
  """The jaxflux_gemm FFI call on operands `gemm` (or an op at tp=1) has checked: x [..., M, K]
  @ w [K, N] ([N, K] with the attribute transpose_w) (+ c), written in out_dtype, run with
  `attributes` (the kernel's, from its op's tuning choice: _attributes.gemm, and transpose_w).
  scales: FP8's x row and w column scales; fast_accum: FP8's accumulation."""
  transpose_w = bool(attributes["transpose_w"])
  n = w.shape[0] if transpose_w else w.shape[1]
  attrs = {**attributes, "fast_accum": int(fast_accum)}
  _runtime.register_targets()
  source = c if c is not None else jnp.zeros((8,), out_dtype)  # not read by kernels 0 and 1
  # The CUTLASS workspace is a second result (sized here, unused after): the handler allocates
  # nothing (XLA assigns it like any buffer).
  workspace = _runtime.gemm_workspace_bytes(x.dtype, math.prod(x.shape[:-1]), n, x.shape[-1],
                                            attrs)
  ffi_call = jax.ffi.ffi_call(
      "jaxflux_gemm", (jax.ShapeDtypeStruct(tuple(x.shape[:-1]) + (n,), out_dtype),
                       jax.ShapeDtypeStruct((workspace,), jnp.uint8)))
  out, _ = ffi_call(x, w, source, *scales,
                    **{name: np.int64(value) for name, value in attrs.items()})
  return out


__all__ = ["KERNELS", "gemm"]
