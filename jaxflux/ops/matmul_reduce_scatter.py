"""GEMM+ReduceScatter: z = reduce_scatter(x @ w, axis=-2), the row-parallel matmul of tensor
parallelism.

Per-device view inside `jax.shard_map`:
  x [..., M, k]      all tokens, this device's slice of the contraction dim
  w [k, N]           this device's row shard of the weight ([N, k] with transpose_w)
  z [..., M/tp, N]   this device's token shard of the summed output

Backward (the pair closes under differentiation):
  dx, dz_full = all_gather_matmul(dz, wᵀ, return_gathered=True)   [..., M, k]
  dw = xᵀ · dz_full                                                [k, N]
The backward hands w over as is with transpose_w (the kernels read it K-major), so no transposed
copy of the weight is made; the partner op's backward does the same with its weight.

FP8 operands (with x_scale and w_scale) run forward-only (ops/_fp8.py).
"""
from __future__ import annotations

from jaxflux.ops import _differentiable, _fp8, _plan


def matmul_reduce_scatter(x, w, axis_name: str, *, impl: str = "auto",
                          preferred_element_type=None, precision=None, x_scale=None,
                          w_scale=None, transpose_w: bool = False):
  """Multiplies `x` by `w`, then sums over `axis_name` and scatters along the token axis (-2).

  Equivalent to `lax.psum_scatter(x @ w, axis_name, scatter_dimension=x.ndim - 2, tiled=True)`,
  with the reduce-scatter hidden inside the GEMM when the fused kernel runs. Call it inside
  `jax.shard_map`.

  Args:
    x: [..., M, k] all tokens, local slice of the contraction dim; M must divide by tp.
    w: [k, N] local row shard of the weight ([N, k] with transpose_w).
    axis_name: the tensor-parallel mesh axis (size tp).
    impl: "auto", "fused" (fused kernel or an error) or "xla" (pure-JAX reference).
    preferred_element_type: output dtype; default is the promoted input dtype, bfloat16 for FP8.
    precision: `lax.Precision` for the XLA path, as in `lax.dot_general`. FP8 on Hopper:
      DEFAULT lets cuBLASLt accumulate fast, HIGHEST asks it for promoted accumulation.
    x_scale: FP8 only: float32 dequantization scale of x, shape () or (1,) (per tensor) or
      x.shape[:-1] + (1,) (per row).
    w_scale: FP8 only: float32 dequantization scale of w, shape () or (1,) (per tensor) or
      (1, N) (per output column).
    transpose_w: w is given as its transpose, [N, k] (K-major, the layout the kernels read
      natively; required by the fused FP8 kernel); the op multiplies by wᵀ without
      materializing a transpose. A static Python bool.

  FP8: x and w each float8_e4m3fn or float8_e5m2 (both FP8 or neither), with both scales; each
  rank's partial (x.astype(f32) * x_scale) @ (w.astype(f32) * w_scale) is summed and scattered,
  then cast to preferred_element_type. The XLA reference sums float32 partials; the fused
  kernel sums bfloat16 partials (one more rounding per rank). FP8 calls are forward-only:
  differentiating one raises a TypeError (the layer recipe,
  jaxflux.Dense(..., dot_general_cls=flax.linen.Fp8DirectDotGeneralOp), trains in FP8).
  impl="auto" takes XLA for FP8 (at tp=1 on an H100 it takes the measured decode GEMM up to
  128 rows); impl="fused" needs (x, w) in (e4m3, e4m3) or (e5m2, e4m3),
  transpose_w=True, bfloat16 output, k and N multiples of 16 and tp <= 8.

  Returns:
    z [..., M/tp, N].
  """
  plan, scales = _plan.plan("matmul_reduce_scatter", x, w, axis_name, impl=impl,
                            preferred_element_type=preferred_element_type, precision=precision,
                            transpose_w=transpose_w, x_scale=x_scale, w_scale=w_scale)
  if plan.fp8:
    return _fp8.matmul_reduce_scatter(x, w, *scales, plan)
  return _differentiable.matmul_reduce_scatter(x, w, plan)
