"""FP8 operands of the three ops: the reference (XLA) math and the forward-only custom_vjp around
each, over a Plan whose checks normalized the scales (_plan).

An FP8 call multiplies `x.astype(f32) * x_scale` by `w.astype(f32) * w_scale`. The plan gives
the scales as the fused kernels take them: x's as float32 rows [..., rows, 1], w's as float32
columns [1, N]. A row scale commutes with the sum over K, a column scale too, so the reference
is one dot of the FP8 values accumulated in float32 (exact products on any platform; on Hopper
XLA runs it as cuBLASLt's FP8 GEMM, with fast accumulation at the default precision) with both
scales applied to the float32 product.

An FP8 call is forward-only: the gradient of an FP8 matmul quantizes the cotangent with scales
of its own, which only a training recipe can keep (Flax's FP8 recipe, run by jaxflux's layers,
calls these ops in its own custom_vjp, forward and backward, and differentiates nothing here).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxflux.ops import _common, _fused, _plan

LAYER_RECIPE = ("jaxflux.Dense(..., tensor_parallel=..., "
                "dot_general_cls=flax.linen.Fp8DirectDotGeneralOp)")
_F32 = jnp.dtype(jnp.float32)


# --- the ops ---------------------------------------------------------------------------------

def all_gather_matmul(x, w, rows, cols, plan: _plan.Plan):
  """The FP8 all_gather_matmul of a plan: (y, x_full) or y. rows, cols: the plan's scales."""

  def forward(x, w, rows, cols):
    y, x_full = _ag_forward(x, w, rows, cols, plan, plan.return_gathered)
    return (y, x_full) if plan.return_gathered else y

  return _forward_only(plan.op, forward, x, w, rows, cols)


def matmul_reduce_scatter(x, w, rows, cols, plan: _plan.Plan):
  """The FP8 matmul_reduce_scatter of a plan: z. rows, cols: the plan's scales."""
  return _forward_only(plan.op, lambda *a: _rs_forward(*a, plan), x, w, rows, cols)


def matmul_all_reduce(x, w, rows, cols, plan: _plan.Plan):
  """The FP8 matmul_all_reduce of a plan: y, the same on every rank. rows, cols: the plan's
  scales."""
  return _forward_only(plan.op, lambda *a: _ar_forward(*a, plan), x, w, rows, cols)


def _ag_forward(x, w, rows, cols, plan, want_gathered):
  """(y, x_full); x_full is None when not wanted and the fused kernel runs."""
  if plan.kernel == "fused":
    # The plan only resolves "fused" with transpose_w: the kernel's w is [n, K], K-major.
    return _fused.all_gather_matmul_fp8(x, w, rows, cols, plan.axis_name, want_gathered,
                                        out_dtype=plan.out_dtype, config=plan.config)
  axis = x.ndim - 2
  x_full = lax.all_gather(x, plan.axis_name, axis=axis, tiled=True)
  # The scales travel with their rows: each rank's shard keeps the scale it was quantized with.
  rows_full = lax.all_gather(rows, plan.axis_name, axis=axis, tiled=True)
  y = scaled_matmul(x_full, w, rows_full, cols, precision=plan.precision,
                    transpose_w=plan.transpose_w)
  return y.astype(plan.out_dtype), x_full


def _rs_forward(x, w, rows, cols, plan):
  if plan.kernel == "fused":
    return _fused.matmul_reduce_scatter_fp8(x, w, rows, cols, plan.axis_name,
                                            out_dtype=plan.out_dtype, config=plan.config)
  partial = scaled_matmul(x, w, rows, cols, precision=plan.precision,
                          transpose_w=plan.transpose_w)
  # The reference sums the float32 partials; the fused kernel sums bfloat16 partials.
  z = lax.psum_scatter(partial, plan.axis_name, scatter_dimension=x.ndim - 2, tiled=True)
  return z.astype(plan.out_dtype)


def _ar_forward(x, w, rows, cols, plan):
  if plan.kernel == "fused":
    return _fused.matmul_all_reduce_fp8(x, w, rows, cols, plan.axis_name,
                                        out_dtype=plan.out_dtype, config=plan.config)
  partial = scaled_matmul(x, w, rows, cols, precision=plan.precision,
                          transpose_w=plan.transpose_w)
  # As for the reduce-scatter: float32 partials here, bfloat16 partials in the fused kernel.
  return lax.psum(partial, plan.axis_name).astype(plan.out_dtype)


def scaled_matmul(x, w, x_scale_rows, w_scale_cols, *, precision=None, transpose_w=False):
  """float32 (x * x_scale_rows) @ (w * w_scale_cols), or @ (w * ...)ᵀ with transpose_w (w then
  [N, K], contracted in place): one dot of the FP8 values themselves accumulated in float32
  (XLA's FP8 GEMM on Hopper, not a float32 GEMM of upcast copies), the scales applied to the
  float32 product (a row scale and a column scale commute with the sum over K)."""
  product = _common.matmul(x, w, precision=precision, preferred_element_type=_F32,
                           transpose_w=transpose_w)
  return product * x_scale_rows * w_scale_cols


# --- forward only ----------------------------------------------------------------------------

def _forward_only(op: str, forward, *operands, message: str | None = None):
  """forward(*operands) as a custom_vjp whose backward raises: differentiating an FP8 call
  fails at trace time with a TypeError naming the op and the layer recipe (or `message`),
  instead of differentiating through casts to FP8 with no scaling of the cotangent."""

  @jax.custom_vjp
  def call(*operands):
    return forward(*operands)

  def fwd(*operands):
    return forward(*operands), None

  def bwd(residuals, cotangent):
    del residuals, cotangent
    raise TypeError(message or not_differentiable_message(op))

  call.defvjp(fwd, bwd)
  return call(*operands)


def not_differentiable_message(op: str) -> str:
  return (f"jaxflux.{op}: an FP8 call (float8 x and w with x_scale and w_scale) is forward-only: "
          "its gradient needs the cotangent quantized to FP8 with scales of its own, which a "
          f"training recipe keeps. Train through the layer recipe, {LAYER_RECIPE}, which runs "
          "this op forward-only in both passes; or keep the op's inputs out of the "
          "differentiation (jax.lax.stop_gradient).")
