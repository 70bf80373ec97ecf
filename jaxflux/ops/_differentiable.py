"""The ops as custom_vjps over checked operands. AG+GEMM's and GEMM+RS's backward is the other
op (the pair closes under differentiation, so fused kernels serve both passes), handed the
forward weight as is with transpose_w: no transposed copy of a weight is ever made. GEMM+AR's
backward communicates nothing: two local matmuls. The forward runs
the fused call or the XLA reference, as resolved once per call (_dispatch)."""
from __future__ import annotations

from functools import partial

import jax
from jax import lax
from jax.interpreters import ad, partial_eval as pe

from jaxflux.ops import _common, _dispatch, _fused


def refuse_forward_mode(op: str, *operands) -> None:
  """Raises a TypeError naming `op` when an operand carries a forward-mode tangent (jax.jvp,
  jax.jacfwd). A custom_vjp has reverse mode only. Under jit JAX says so itself, but under an
  eager shard_map its error path fails first, with an unrelated `unhashable type` TypeError,
  so the check runs before the custom_vjp is bound."""
  # Reverse mode without direct linearization (jax_use_direct_linearize=False) also runs
  # through jvp tracers, whose tangents are then unknown values of a partial evaluation.
  if any(isinstance(o, ad.JVPTracer) and not isinstance(o.tangent, pe.JaxprTracer)
         for o in operands):
    raise TypeError(
        f"jaxflux.{op}: can't apply forward-mode autodiff (jvp) to it: like any "
        "jax.custom_vjp it is differentiable in reverse mode only. Use jax.grad, jax.vjp or "
        "jax.jacrev instead of jax.jvp or jax.jacfwd.")


def all_gather_matmul(x, w, axis_name, return_gathered, impl, preferred_element_type, precision,
                      *, transpose_w):
  """y (and x_full with return_gathered) = all_gather(x) @ w, or @ wᵀ with transpose_w (w is
  then [n, K]: matmul_reduce_scatter's backward passes its forward weight so)."""
  refuse_forward_mode("all_gather_matmul", x, w)
  resolved = _dispatch.resolve("all_gather_matmul", impl, x, w, preferred_element_type,
                               axis_name, transpose_w)
  return _all_gather_matmul(x, w, axis_name, bool(return_gathered), impl, resolved,
                            _common.static_dtype(preferred_element_type), precision, transpose_w)


def matmul_reduce_scatter(x, w, axis_name, impl, preferred_element_type, precision, *,
                          transpose_w):
  """z = reduce_scatter(x @ w), or of x @ wᵀ with transpose_w (w is then [N, k]:
  all_gather_matmul's backward passes its forward weight so)."""
  refuse_forward_mode("matmul_reduce_scatter", x, w)
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
  dw = _common.weight_grad(x_full, dy, precision=precision, dtype=w.dtype,
                           transpose_w=transpose_w)
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
  dw = _common.weight_grad(x, dz_full, precision=precision, dtype=w.dtype,
                           transpose_w=transpose_w)
  return _common.match_vma(dx, x), _common.match_vma(dw, w)


_matmul_reduce_scatter.defvjp(_rs_fwd, _rs_bwd)


# --- matmul_all_reduce ------------------------------------------------------------------------
# Nondiff: axis_name, resolved, preferred_element_type, precision, transpose_w. The backward
# communicates nothing (dY arrives whole on every rank), so it needs no impl of its own.

def matmul_all_reduce(x, w, axis_name, impl, preferred_element_type, precision, *, transpose_w):
  """y = psum(x @ w) over axis_name, or of x @ wᵀ with transpose_w (w is then [N, k])."""
  refuse_forward_mode("matmul_all_reduce", x, w)
  resolved = _dispatch.resolve("matmul_all_reduce", impl, x, w, preferred_element_type,
                               axis_name, transpose_w)
  return _matmul_all_reduce(x, w, axis_name, resolved,
                            _common.static_dtype(preferred_element_type), precision, transpose_w)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _matmul_all_reduce(x, w, axis_name, resolved, preferred_element_type, precision,
                       transpose_w):
  return _ar_forward(x, w, axis_name, resolved, preferred_element_type, precision, transpose_w)


def _ar_forward(x, w, axis_name, resolved, preferred_element_type, precision, transpose_w):
  if resolved == "fused":
    return _fused.matmul_all_reduce(x, w, axis_name, transpose_w=transpose_w)
  partial_sum = _common.matmul(x, w, precision=precision,
                               preferred_element_type=preferred_element_type,
                               transpose_w=transpose_w)
  return lax.psum(partial_sum, axis_name)


def _ar_fwd(x, w, axis_name, resolved, preferred_element_type, precision, transpose_w):
  out = _ar_forward(x, w, axis_name, resolved, preferred_element_type, precision, transpose_w)
  return out, (x, w)


def _ar_bwd(axis_name, resolved, preferred_element_type, precision, transpose_w, residuals, dy):
  del resolved, preferred_element_type
  x, w = residuals
  # dY is invariant over axis_name, like y; it is the cotangent of every rank's partial product,
  # which varied over axis_name (the transpose of psum). Typed so, the psum match_vma applies
  # for an x or w replicated over axis_name sums their cotangents over the ranks.
  dy = _common.mark_varying(dy.astype(_common.result_dtype(x, w, None)), {axis_name})
  # dX = dY · W_effᵀ, contracted against w in place (no transposed copy): N is w's axis 1, or
  # its axis 0 when w came transposed.
  dx = _common.matmul(dy, w, precision=precision, preferred_element_type=None,
                      transpose_w=not transpose_w).astype(x.dtype)
  # dW_eff = xᵀ · dY; w holds its transpose when transpose_w.
  dw = _common.weight_grad(x, dy, precision=precision, dtype=w.dtype, transpose_w=transpose_w)
  return _common.match_vma(dx, x), _common.match_vma(dw, w)


_matmul_all_reduce.defvjp(_ar_fwd, _ar_bwd)
