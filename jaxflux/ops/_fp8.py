"""FP8 operands of all_gather_matmul and matmul_reduce_scatter: the dtype and scale checks, the
scales' normalization to rows and columns, the reference (XLA) math, and the forward-only
custom_vjp around both.

An FP8 call multiplies `x.astype(f32) * x_scale` by `w.astype(f32) * w_scale`. The scales are
normalized to what the fused kernels take: x_scale to float32 rows [..., rows, 1] (a per-tensor
scale broadcast over x's rows, so that all_gather_matmul gathers it with x and each rank's own
scale stays with its shard), w_scale to float32 columns [1, N]. A row scale commutes with the
sum over K, a column scale too, so the reference is one dot of the FP8 values accumulated in
float32 (exact products on any platform; on Hopper XLA runs it as cuBLASLt's FP8 GEMM, with fast
accumulation at the default precision) with both scales applied to the float32 product.

An FP8 call is forward-only: the gradient of an FP8 matmul quantizes the cotangent with scales
of its own, which only a training recipe can keep (Flax's FP8 recipe, run by jaxflux's layers,
calls these ops in its own custom_vjp, forward and backward, and differentiates nothing here).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxflux.ops import _common, _dispatch, _fused
from jaxflux.ops._differentiable import refuse_forward_mode

LAYER_RECIPE = ("jaxflux.Dense(..., tensor_parallel=..., "
                "dot_general_cls=flax.linen.Fp8DirectDotGeneralOp)")
_F32 = jnp.dtype(jnp.float32)


# --- checks ----------------------------------------------------------------------------------

def is_fp8_call(op: str, x, w, x_scale, w_scale) -> bool:
  """True when x and w are FP8 (then the scales are checked by `scales`); False for a call
  without FP8 and without scales. Raises TypeError for a 1-byte float other than the two FP8
  formats, for one FP8 operand without the other, and for a scale without FP8 operands."""
  for name, a in (("x", x), ("w", w)):
    if _common.is_narrow_float(a.dtype) and not _common.is_fp8(a.dtype):
      raise TypeError(
          f"{op}: {name}.dtype={a.dtype} is not an FP8 format jaxflux takes; the ops take "
          f"float8_e4m3fn and float8_e5m2 (with x_scale and w_scale). Quantize {name} to one of "
          "them.")
  x_fp8, w_fp8 = _common.is_fp8(x.dtype), _common.is_fp8(w.dtype)
  if x_fp8 != w_fp8:
    fp8, other = ("x", "w") if x_fp8 else ("w", "x")
    raise TypeError(
        f"{op}: x.dtype={x.dtype} and w.dtype={w.dtype}: {fp8} is FP8 and {other} is not. "
        "Both operands are FP8 (each float8_e4m3fn or float8_e5m2, with x_scale and w_scale) or "
        f"neither: quantize {other} to FP8 as well, or pass {fp8} in a wider dtype.")
  if not x_fp8:
    for name, scale in (("x_scale", x_scale), ("w_scale", w_scale)):
      if scale is not None:
        raise TypeError(
            f"{op}: {name} was given, but x.dtype={x.dtype} and w.dtype={w.dtype} are not FP8; "
            f"scales apply to float8 operands only. Drop {name}, or pass x and w quantized to "
            "float8_e4m3fn / float8_e5m2.")
  return x_fp8


def scales(op: str, x, w, x_scale, w_scale, *, transpose_w: bool):
  """(x_scale_rows float32 [..., rows, 1], w_scale_cols float32 [1, N]) from per-tensor or
  row-wise scales; TypeError for a missing or non-float32 scale, ValueError for another
  shape."""
  n = w.shape[0] if transpose_w else w.shape[1]
  rows = _scale(op, "x_scale", "x", x, x_scale, tuple(x.shape[:-1]) + (1,),
                "x.shape[:-1] + (1,), one per row of x")
  cols = _scale(op, "w_scale", "w", w, w_scale, (1, n),
                f"(1, N), one per output column (N = w.shape[{0 if transpose_w else 1}])")
  return rows, cols


def _scale(op: str, name: str, operand: str, a, scale, per_row: tuple, per_row_what: str):
  accepted = f"() or (1,) (one scale for {operand}) or {per_row} = {per_row_what}"
  if scale is None:
    raise TypeError(
        f"{op}: {operand} is FP8 ({a.dtype}) and needs {name}, its dequantization scale "
        f"({operand} as float32 = {operand}.astype(float32) * {name}): a float32 array of shape "
        f"{accepted}.")
  dtype = getattr(scale, "dtype", None)
  if dtype is None or not hasattr(scale, "shape"):
    raise TypeError(f"{op}: {name} must be a float32 array; got {type(scale).__name__}. Pass "
                    f"jnp.asarray({name}, jnp.float32).")
  if jnp.dtype(dtype) != _F32:
    raise TypeError(f"{op}: {name}.dtype={dtype}; scales must be float32. Pass "
                    f"{name}.astype(jnp.float32).")
  shape = tuple(scale.shape)
  if shape in ((), (1,)):
    return jnp.broadcast_to(jnp.reshape(scale, ()), per_row)
  if shape == per_row:
    return scale
  raise ValueError(f"{op}: {name} has shape {shape}, which is neither accepted shape: {accepted} "
                   f"({operand}.shape={a.shape}).")


def out_dtype(op: str, preferred_element_type):
  """The output dtype of an FP8 call: preferred_element_type, default bfloat16."""
  if preferred_element_type is None:
    return _common.FP8_OUT_DTYPE
  dtype = jnp.dtype(preferred_element_type)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{op}: preferred_element_type={dtype} is not a floating dtype; an FP8 call "
                    "writes bfloat16 by default (pass jnp.bfloat16 or jnp.float32).")
  return dtype


# --- the ops ---------------------------------------------------------------------------------

def all_gather_matmul(x, w, x_scale, w_scale, axis_name: str, *, return_gathered: bool,
                      impl: str, preferred_element_type, precision, transpose_w: bool):
  """The FP8 all_gather_matmul on checked FP8 operands: (y, x_full) or y."""
  op = "all_gather_matmul"
  rows, cols, dtype, resolved = _prepare(op, x, w, x_scale, w_scale, axis_name, impl,
                                         preferred_element_type, transpose_w)

  def forward(x, w, rows, cols):
    y, x_full = _ag_forward(x, w, rows, cols, axis_name, bool(return_gathered), resolved, dtype,
                            precision, transpose_w)
    return (y, x_full) if return_gathered else y

  return _forward_only(op, forward, x, w, rows, cols)


def matmul_reduce_scatter(x, w, x_scale, w_scale, axis_name: str, *, impl: str,
                          preferred_element_type, precision, transpose_w: bool):
  """The FP8 matmul_reduce_scatter on checked FP8 operands: z."""
  op = "matmul_reduce_scatter"
  rows, cols, dtype, resolved = _prepare(op, x, w, x_scale, w_scale, axis_name, impl,
                                         preferred_element_type, transpose_w)

  def forward(x, w, rows, cols):
    return _rs_forward(x, w, rows, cols, axis_name, resolved, dtype, precision, transpose_w)

  return _forward_only(op, forward, x, w, rows, cols)


def _prepare(op, x, w, x_scale, w_scale, axis_name, impl, preferred_element_type, transpose_w):
  """What both FP8 ops settle before running: (x_scale rows, w_scale columns, output dtype,
  "fused" or "xla")."""
  refuse_forward_mode(op, x, w, x_scale, w_scale)
  rows, cols = scales(op, x, w, x_scale, w_scale, transpose_w=transpose_w)
  dtype = out_dtype(op, preferred_element_type)
  return rows, cols, dtype, _dispatch.resolve(op, impl, x, w, dtype, axis_name, transpose_w)


def _ag_forward(x, w, rows, cols, axis_name, want_gathered, resolved, dtype, precision,
                transpose_w):
  """(y, x_full); x_full is None when not wanted and the fused kernel runs."""
  if resolved == "fused":
    # Dispatch only resolves "fused" with transpose_w: the kernel's w is [n, K], K-major.
    return _fused.all_gather_matmul_fp8(x, w, rows, cols, axis_name, want_gathered,
                                        out_dtype=dtype)
  axis = x.ndim - 2
  x_full = lax.all_gather(x, axis_name, axis=axis, tiled=True)
  # The scales travel with their rows: each rank's shard keeps the scale it was quantized with.
  rows_full = lax.all_gather(rows, axis_name, axis=axis, tiled=True)
  y = scaled_matmul(x_full, w, rows_full, cols, precision=precision, transpose_w=transpose_w)
  return y.astype(dtype), x_full


def _rs_forward(x, w, rows, cols, axis_name, resolved, dtype, precision, transpose_w):
  if resolved == "fused":
    return _fused.matmul_reduce_scatter_fp8(x, w, rows, cols, axis_name, out_dtype=dtype)
  partial = scaled_matmul(x, w, rows, cols, precision=precision, transpose_w=transpose_w)
  # The reference sums the float32 partials; the fused kernel sums bfloat16 partials.
  z = lax.psum_scatter(partial, axis_name, scatter_dimension=x.ndim - 2, tiled=True)
  return z.astype(dtype)


def scaled_matmul(x, w, x_scale_rows, w_scale_cols, *, precision=None, transpose_w=False):
  """float32 (x * x_scale_rows) @ (w * w_scale_cols), or @ (w * ...)ᵀ with transpose_w (w then
  [N, K], contracted in place): one dot of the FP8 values themselves accumulated in float32
  (XLA's FP8 GEMM on Hopper, not a float32 GEMM of upcast copies), the scales applied to the
  float32 product (a row scale and a column scale commute with the sum over K)."""
  product = _common.matmul(x, w, precision=precision, preferred_element_type=_F32,
                           transpose_w=transpose_w)
  return product * x_scale_rows * w_scale_cols


# --- forward only ----------------------------------------------------------------------------

def _forward_only(op: str, forward, *operands):
  """forward(*operands) as a custom_vjp whose backward raises: differentiating an FP8 call
  fails at trace time with a TypeError naming the op and the layer recipe, instead of
  differentiating through casts to FP8 with no scaling of the cotangent."""

  @jax.custom_vjp
  def call(*operands):
    return forward(*operands)

  def fwd(*operands):
    return forward(*operands), None

  def bwd(residuals, cotangent):
    del residuals, cotangent
    raise TypeError(not_differentiable_message(op))

  call.defvjp(fwd, bwd)
  return call(*operands)


def not_differentiable_message(op: str) -> str:
  return (f"jaxflux.{op}: an FP8 call (float8 x and w with x_scale and w_scale) is forward-only: "
          "its gradient needs the cotangent quantized to FP8 with scales of its own, which a "
          f"training recipe keeps. Train through the layer recipe, {LAYER_RECIPE}, which runs "
          "this op forward-only in both passes; or keep the op's inputs out of the "
          "differentiation (jax.lax.stop_gradient).")
