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
The backward hands w over as is with transpose_w (the kernels read it K-major), so no transposed
copy of the weight is made; the partner op's backward does the same with its weight.
"""
from __future__ import annotations

from jaxflux.ops import _common, _differentiable


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
    impl: "auto" (fused kernel where it exists and the benchmark measured it ahead, else XLA),
      "fused" (the fused kernel or an error, never a silent fallback) or "xla" (pure-JAX
      reference). The fused kernel (Hopper GPUs, tp <= 8) takes bfloat16/float16 x and w of one
      dtype, K and N multiples of 8, and writes y in that dtype. Its backward computes dX with
      matmul_reduce_scatter(impl=impl).
    preferred_element_type: output dtype (accumulation is fp32 on the fused path); default is
      the promoted input dtype.
    precision: `lax.Precision` for the XLA path, as in `lax.dot_general` (the fused kernel always
      multiplies bf16/fp16 inputs with fp32 accumulation).

  Returns:
    y [..., tp*m, n], or (y, x_full) when return_gathered.
  """
  op = "all_gather_matmul"
  _common.check_impl(op, impl)
  _common.check_operands(op, x, w)
  _common.axis_size(op, axis_name)
  return _differentiable.all_gather_matmul(x, w, axis_name, return_gathered, impl,
                                          preferred_element_type, precision, transpose_w=False)
