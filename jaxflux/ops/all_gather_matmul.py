"""AllGather+GEMM: y = all_gather(x, axis=-2) @ w, the column-parallel matmul of tensor parallelism.

Per-device view inside `jax.shard_map`:
  x      [..., m, K]      this device's token shard
  w      [K, n]           this device's column shard of the weight
  y      [..., tp*m, n]   all tokens, this device's output columns
  x_full [..., tp*m, K]   the gathered input (returned with return_gathered=True; the backward
                          pass reuses it for dW)

Backward (the pair closes under differentiation, so fused kernels serve both passes):
  dx = matmul_reduce_scatter(dy, wᵀ)       [..., m, K]
  dw = x_fullᵀ · dy                         [K, n]
"""
from __future__ import annotations

from functools import partial

import jax
from jax import lax

from jaxflux.ops import _common


def all_gather_matmul(x, w, axis_name: str, *, return_gathered: bool = False, impl: str = "auto",
                      preferred_element_type=None, precision=None):
  """All-gathers `x` along its token axis (-2) over `axis_name`, then multiplies by `w`.

  Equivalent to `lax.all_gather(x, axis_name, axis=x.ndim - 2, tiled=True) @ w`, with the
  collective hidden inside the GEMM when the fused kernel runs. Call it inside `jax.shard_map`.

  Args:
    x: [..., m, K] local token shard; leading axes are batch.
    w: [K, n] local column shard of the weight.
    axis_name: the tensor-parallel mesh axis (size tp).
    return_gathered: also return x_full = the gathered x, [..., tp*m, K].
    impl: "auto" (fused kernel where it exists and wins, else XLA), "fused" (the fused kernel or
      an error, never a silent fallback) or "xla" (pure-JAX reference).
    preferred_element_type: output dtype (accumulation is fp32 on the fused path); default is
      the promoted input dtype.
    precision: `lax.Precision` for the XLA path, as in `lax.dot_general`.

  Returns:
    y [..., tp*m, n], or (y, x_full) when return_gathered.
  """
  op = "all_gather_matmul"
  _common.check_impl(op, impl)
  _common.check_operands(op, x, w)
  _common.axis_size(op, axis_name)
  _common.resolve_impl(op, impl, x, w, _fused_unsupported_reason)
  return _all_gather_matmul(x, w, axis_name, bool(return_gathered), impl,
                            _common.static_dtype(preferred_element_type), precision)


def _fused_unsupported_reason(x, w) -> str | None:
  """Why the fused AllGather+GEMM kernel cannot run on these operands here, or None."""
  reason = _common.platform_reason()
  if reason is not None:
    return reason
  return "the fused AllGather+GEMM kernel is not part of this jaxflux version yet."


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _all_gather_matmul(x, w, axis_name, return_gathered, impl, preferred_element_type, precision):
  y, x_full = _forward(x, w, axis_name, impl, preferred_element_type, precision)
  return (y, x_full) if return_gathered else y


def _forward(x, w, axis_name, impl, preferred_element_type, precision):
  chosen = _common.resolve_impl("all_gather_matmul", impl, x, w, _fused_unsupported_reason)
  if chosen == "fused":  # Unreachable until the fused kernel lands: resolve_impl raised already.
    raise NotImplementedError("fused AllGather+GEMM")
  x_full = lax.all_gather(x, axis_name, axis=x.ndim - 2, tiled=True)
  y = _common.matmul(x_full, w, precision=precision,
                     preferred_element_type=preferred_element_type)
  return y, x_full


def _fwd(x, w, axis_name, return_gathered, impl, preferred_element_type, precision):
  y, x_full = _forward(x, w, axis_name, impl, preferred_element_type, precision)
  out = (y, x_full) if return_gathered else y
  # x itself is kept only for its type (varying mesh axes); x_full carries the values.
  return out, (x, x_full, w)


def _bwd(axis_name, return_gathered, impl, preferred_element_type, precision, residuals, ct):
  from jaxflux.ops.matmul_reduce_scatter import matmul_reduce_scatter  # the pair: avoid a cycle

  x, x_full, w = residuals
  dy, dx_full = ct if return_gathered else (ct, None)
  compute_dtype = _common.result_dtype(x, w, None)
  dy = dy.astype(compute_dtype)
  dx = matmul_reduce_scatter(dy, w.T, axis_name, impl=impl, preferred_element_type=x.dtype,
                             precision=precision)
  if dx_full is not None:
    dx = dx + lax.psum_scatter(dx_full, axis_name, scatter_dimension=x.ndim - 2,
                               tiled=True).astype(x.dtype)
  dw = _common.weight_grad(x_full, dy, precision=precision, dtype=w.dtype)
  return _common.match_vma(dx, x), _common.match_vma(dw, w)


_all_gather_matmul.defvjp(_fwd, _bwd)
