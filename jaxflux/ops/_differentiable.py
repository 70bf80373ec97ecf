"""The two ops as custom_vjps over checked operands. Each op's backward is the other op (the
pair closes under differentiation, so fused kernels serve both passes), handed the forward
weight as is with transpose_w: no transposed copy of a weight is ever made. The forward runs
the fused call or the XLA reference, as resolved once per call (_dispatch)."""
from __future__ import annotations

from functools import partial

import jax
from jax import lax

from jaxflux.ops import _common, _dispatch, _fused


def all_gather_matmul(x, w, axis_name, return_gathered, impl, preferred_element_type, precision,
                      *, transpose_w):
  """y (and x_full with return_gathered) = all_gather(x) @ w, or @ wᵀ with transpose_w (w is
  then [n, K]: matmul_reduce_scatter's backward passes its forward weight so)."""
  resolved = _dispatch.resolve("all_gather_matmul", impl, x, w, preferred_element_type,
                               axis_name, transpose_w)
  return _all_gather_matmul(x, w, axis_name, bool(return_gathered), impl, resolved,
                            _common.static_dtype(preferred_element_type), precision, transpose_w)


def matmul_reduce_scatter(x, w, axis_name, impl, preferred_element_type, precision, *,
                          transpose_w):
  """z = reduce_scatter(x @ w), or of x @ wᵀ with transpose_w (w is then [N, k]:
  all_gather_matmul's backward passes its forward weight so)."""
  resolved = _dispatch.resolve("matmul_reduce_scatter", impl, x, w, preferred_element_type,
                               axis_name, transpose_w)
  return _matmul_reduce_scatter(x, w, axis_name, impl, resolved,
                                _common.static_dtype(preferred_element_type), precision,
                                transpose_w)


# --- all_gather_matmul ------------------------------------------------------------------------
# Nondiff: axis_name, return_gathered, impl (the caller's, for the backward), resolved (the
# forward's "fused" | "xla"), preferred_element_type, precision, transpose_w.

@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7, 8))
def _all_gather_matmul(x, w, axis_name, return_gathered, impl, resolved, preferred_element_type,
                       precision, transpose_w):
  y, x_full = _ag_forward(x, w, axis_name, resolved, preferred_element_type, precision,
                          return_gathered, transpose_w)
  return (y, x_full) if return_gathered else y


def _ag_forward(x, w, axis_name, resolved, preferred_element_type, precision, want_gathered,
                transpose_w):
  """(y, x_full); x_full is None when not wanted and the fused kernel runs."""
  if resolved == "fused":
    return _fused.all_gather_matmul(x, w, axis_name, want_gathered, transpose_w=transpose_w)
  x_full = lax.all_gather(x, axis_name, axis=x.ndim - 2, tiled=True)
  y = _common.matmul(x_full, w, precision=precision,
                     preferred_element_type=preferred_element_type, transpose_w=transpose_w)
  return y, x_full


def _ag_fwd(x, w, axis_name, return_gathered, impl, resolved, preferred_element_type, precision,
            transpose_w):
  y, x_full = _ag_forward(x, w, axis_name, resolved, preferred_element_type, precision, True,
                          transpose_w)
  out = (y, x_full) if return_gathered else y
  # x itself is kept only for its type (varying mesh axes); x_full carries the values.
  return out, (x, x_full, w)


def _ag_bwd(axis_name, return_gathered, impl, resolved, preferred_element_type, precision,
            transpose_w, residuals, ct):
  del resolved, preferred_element_type
  x, x_full, w = residuals
  dy, dx_full = ct if return_gathered else (ct, None)
  dy = dy.astype(_common.result_dtype(x, w, None))
  # dX = dy · W_effᵀ through GEMM+ReduceScatter with the same w flipped: W_effᵀ is w itself
  # when w came transposed, else w read K-major.
  dx = matmul_reduce_scatter(dy, w, axis_name, impl, x.dtype, precision,
                             transpose_w=not transpose_w)
  if dx_full is not None:
    dx = dx + lax.psum_scatter(dx_full, axis_name, scatter_dimension=x.ndim - 2,
                               tiled=True).astype(x.dtype)
  # dW_eff = x_fullᵀ · dy; w holds its transpose when transpose_w.
  dw = (_common.weight_grad(dy, x_full, precision=precision, dtype=w.dtype) if transpose_w
        else _common.weight_grad(x_full, dy, precision=precision, dtype=w.dtype))
  return _common.match_vma(dx, x), _common.match_vma(dw, w)


_all_gather_matmul.defvjp(_ag_fwd, _ag_bwd)


# --- matmul_reduce_scatter --------------------------------------------------------------------
# Nondiff: axis_name, impl, resolved, preferred_element_type, precision, transpose_w.

@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def _matmul_reduce_scatter(x, w, axis_name, impl, resolved, preferred_element_type, precision,
                           transpose_w):
  return _rs_forward(x, w, axis_name, resolved, preferred_element_type, precision, transpose_w)


def _rs_forward(x, w, axis_name, resolved, preferred_element_type, precision, transpose_w):
  if resolved == "fused":
    return _fused.matmul_reduce_scatter(x, w, axis_name, transpose_w=transpose_w)
  partial_sum = _common.matmul(x, w, precision=precision,
                               preferred_element_type=preferred_element_type,
                               transpose_w=transpose_w)
  return lax.psum_scatter(partial_sum, axis_name, scatter_dimension=x.ndim - 2, tiled=True)


def _rs_fwd(x, w, axis_name, impl, resolved, preferred_element_type, precision, transpose_w):
  out = _rs_forward(x, w, axis_name, resolved, preferred_element_type, precision, transpose_w)
  return out, (x, w)


def _rs_bwd(axis_name, impl, resolved, preferred_element_type, precision, transpose_w,
            residuals, dz):
  del resolved, preferred_element_type
  x, w = residuals
  dz = dz.astype(_common.result_dtype(x, w, None))
  # dX = all_gather(dz) · W_effᵀ through the fused AllGather+GEMM, with the same w flipped:
  # W_effᵀ is w itself when w came transposed, else w read K-major.
  dx, dz_full = all_gather_matmul(dz, w, axis_name, True, impl, x.dtype, precision,
                                  transpose_w=not transpose_w)
  # dW_eff = xᵀ · dz_full; w holds its transpose when transpose_w.
  dw = (_common.weight_grad(dz_full, x, precision=precision, dtype=w.dtype) if transpose_w
        else _common.weight_grad(x, dz_full, precision=precision, dtype=w.dtype))
  return _common.match_vma(dx, x), _common.match_vma(dw, w)


_matmul_reduce_scatter.defvjp(_rs_fwd, _rs_bwd)
