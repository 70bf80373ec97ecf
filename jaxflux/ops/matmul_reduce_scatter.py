"""GEMM+ReduceScatter: z = reduce_scatter(x @ w, axis=-2), the row-parallel matmul of tensor
parallelism.

Per-device view inside `jax.shard_map`:
  x [..., M, k]      all tokens, this device's slice of the contraction dim
  w [k, N]           this device's row shard of the weight
  z [..., M/tp, N]   this device's token shard of the summed output

Backward (the pair closes under differentiation):
  dx, dz_full = all_gather_matmul(dz, wᵀ, return_gathered=True)   [..., M, k]
  dw = xᵀ · dz_full                                                [k, N]
The backward hands w over as is with transpose_w (the kernels read it K-major), so no transposed
copy of the weight is made; the partner op's backward does the same with its weight.
"""
from __future__ import annotations

from jaxflux.ops import _common, _differentiable


def matmul_reduce_scatter(x, w, axis_name: str, *, impl: str = "auto",
                          preferred_element_type=None, precision=None):
  """Multiplies `x` by `w`, then sums over `axis_name` and scatters along the token axis (-2).

  Equivalent to `lax.psum_scatter(x @ w, axis_name, scatter_dimension=x.ndim - 2, tiled=True)`,
  with the reduce-scatter hidden inside the GEMM when the fused kernel runs. Call it inside
  `jax.shard_map`.

  Args:
    x: [..., M, k] all tokens, local slice of the contraction dim; M must divide by tp.
    w: [k, N] local row shard of the weight.
    axis_name: the tensor-parallel mesh axis (size tp).
    impl: "auto", "fused" (fused kernel or an error) or "xla" (pure-JAX reference).
    preferred_element_type: output dtype; default is the promoted input dtype.
    precision: `lax.Precision` for the XLA path, as in `lax.dot_general`.

  Returns:
    z [..., M/tp, N].
  """
  op = "matmul_reduce_scatter"
  _common.check_impl(op, impl)
  _common.check_operands(op, x, w)
  tp = _common.axis_size(op, axis_name)
  tokens = x.shape[-2]
  if tokens % tp:
    raise ValueError(
        f"{op}: the token axis of x (axis -2, size {tokens}, x.shape={x.shape}) must divide by "
        f"the size of mesh axis {axis_name!r} (tp={tp}) to be scattered. Pad the tokens to a "
        f"multiple of {tp} or use a tp that divides {tokens}.")
  return _differentiable.matmul_reduce_scatter(x, w, axis_name, impl, preferred_element_type,
                                               precision, transpose_w=False)
