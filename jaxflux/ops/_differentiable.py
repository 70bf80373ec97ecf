"""The 16-bit ops as custom_vjps over a Plan (_plan). AG+GEMM's and GEMM+RS's backward is the
other op (the pair closes under differentiation, so fused kernels serve both passes), handed the
forward weight as is with transpose_w: no transposed copy of a weight is ever made. GEMM+AR's
backward communicates nothing: two local matmuls. The forward runs the fused call or the XLA
reference, as the plan resolved it."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jaxflux.ops import _common, _fused, _plan


def _product(x, w, plan):
  """The reference path's local x @ w (or @ wᵀ) in the plan's precision and output dtype."""
  return _common.matmul(x, w, precision=plan.precision, preferred_element_type=plan.out_dtype,
                        transpose_w=plan.transpose_w)


# --- all_gather_matmul ------------------------------------------------------------------------

@partial(jax.custom_vjp, nondiff_argnums=(2,))
def all_gather_matmul(x, w, plan: _plan.Plan):
  """y (and x_full with plan.return_gathered) = all_gather(x) @ w, or @ wᵀ with transpose_w
  (w is then [n, K]: matmul_reduce_scatter's backward passes its forward weight so)."""
  y, x_full = _ag_forward(x, w, plan, plan.return_gathered)
  return (y, x_full) if plan.return_gathered else y


def _ag_forward(x, w, plan, want_gathered):
  """(y, x_full); x_full is None when not wanted and the fused kernel runs."""
  if plan.kernel == "fused":
    return _fused.all_gather_matmul(x, w, plan.axis_name, want_gathered, config=plan.config)
  x_full = lax.all_gather(x, plan.axis_name, axis=x.ndim - 2, tiled=True)
  return _product(x_full, w, plan), x_full


def _ag_fwd(x, w, plan):
  _plan.refuse_forward_mode(plan.op, x, w)  # forward-over-reverse (jax.hessian) lands here
  y, x_full = _ag_forward(x, w, plan, True)
  out = (y, x_full) if plan.return_gathered else y
  # x itself is kept only for its type (varying mesh axes); x_full carries the values.
  return out, (x, x_full, w)


def _ag_bwd(plan, residuals, ct):
  x, x_full, w = residuals
  dy, dx_full = ct if plan.return_gathered else (ct, None)
  dy = dy.astype(_common.result_dtype(x, w, None))
  # dX = dy · W_effᵀ through GEMM+ReduceScatter with the same w flipped: W_effᵀ is w itself
  # when w came transposed, else w read K-major.
  dx = matmul_reduce_scatter(dy, w, _plan.partner(plan, "matmul_reduce_scatter", dy, w,
                                                  out_dtype=x.dtype,
                                                  transpose_w=not plan.transpose_w))
  if dx_full is not None:
    dx = dx + lax.psum_scatter(dx_full, plan.axis_name, scatter_dimension=x.ndim - 2,
                               tiled=True).astype(x.dtype)
  # dW_eff = x_fullᵀ · dy; w holds its transpose when transpose_w.
  dw = _common.weight_grad(x_full, dy, precision=plan.precision, dtype=w.dtype,
                           transpose_w=plan.transpose_w)
  return _common.match_vma(dx, x), _common.match_vma(dw, w)


all_gather_matmul.defvjp(_ag_fwd, _ag_bwd)


# --- matmul_reduce_scatter --------------------------------------------------------------------

@partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul_reduce_scatter(x, w, plan: _plan.Plan):
  """z = reduce_scatter(x @ w), or of x @ wᵀ with transpose_w (w is then [N, k]:
  all_gather_matmul's backward passes its forward weight so)."""
  return _rs_forward(x, w, plan)


def _rs_forward(x, w, plan):
  if plan.kernel == "fused":
    return _fused.matmul_reduce_scatter(x, w, plan.axis_name, config=plan.config)
  return lax.psum_scatter(_product(x, w, plan), plan.axis_name, scatter_dimension=x.ndim - 2,
                          tiled=True)


def _rs_fwd(x, w, plan):
  _plan.refuse_forward_mode(plan.op, x, w)
  return _rs_forward(x, w, plan), (x, w)


def _rs_bwd(plan, residuals, dz):
  x, w = residuals
  dz = dz.astype(_common.result_dtype(x, w, None))
  # dX = all_gather(dz) · W_effᵀ through the fused AllGather+GEMM, with the same w flipped:
  # W_effᵀ is w itself when w came transposed, else w read K-major.
  dx, dz_full = all_gather_matmul(dz, w, _plan.partner(plan, "all_gather_matmul", dz, w,
                                                       out_dtype=x.dtype,
                                                       transpose_w=not plan.transpose_w,
                                                       return_gathered=True))
  # dW_eff = xᵀ · dz_full; w holds its transpose when transpose_w.
  dw = _common.weight_grad(x, dz_full, precision=plan.precision, dtype=w.dtype,
                           transpose_w=plan.transpose_w)
  return _common.match_vma(dx, x), _common.match_vma(dw, w)


matmul_reduce_scatter.defvjp(_rs_fwd, _rs_bwd)


# --- matmul_all_reduce ------------------------------------------------------------------------
# The backward communicates nothing (dY arrives whole on every rank).

@partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul_all_reduce(x, w, plan: _plan.Plan):
  """y = psum(x @ w) over the plan's axis, or of x @ wᵀ with transpose_w (w is then [N, k])."""
  return _ar_forward(x, w, plan)


def _ar_forward(x, w, plan):
  if plan.kernel == "fused":
    return _fused.matmul_all_reduce(x, w, plan.axis_name, config=plan.config)
  return lax.psum(_product(x, w, plan), plan.axis_name)


def _ar_fwd(x, w, plan):
  _plan.refuse_forward_mode(plan.op, x, w)
  return _ar_forward(x, w, plan), (x, w)


def _ar_bwd(plan, residuals, dy):
  x, w = residuals
  # dY is invariant over the axis, like y; it is the cotangent of every rank's partial product,
  # which varied over the axis (the transpose of psum). Typed so, the psum match_vma applies
  # for an x or w replicated over the axis sums their cotangents over the ranks.
  dy = _common.mark_varying(dy.astype(_common.result_dtype(x, w, None)), {plan.axis_name})
  # dX = dY · W_effᵀ, contracted against w in place (no transposed copy): N is w's axis 1, or
  # its axis 0 when w came transposed. Accumulated in float32 at least, as the fused kernels
  # and weight_grad do: left to its bf16 output type, XLA on an H200 ran the one-row case
  # (decode) as a GEMV that lost precision where terms cancel.
  dx = _common.matmul(dy, w, precision=plan.precision,
                      preferred_element_type=jnp.promote_types(dy.dtype, jnp.float32),
                      transpose_w=not plan.transpose_w).astype(x.dtype)
  # dW_eff = xᵀ · dY; w holds its transpose when transpose_w.
  dw = _common.weight_grad(x, dy, precision=plan.precision, dtype=w.dtype,
                           transpose_w=plan.transpose_w)
  return _common.match_vma(dx, x), _common.match_vma(dw, w)


matmul_all_reduce.defvjp(_ar_fwd, _ar_bwd)
