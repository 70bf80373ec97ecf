"""AllGather+GEMM: y = all_gather(x, axis=-2) @ w, the column-parallel matmul of tensor parallelism.

Per-device view inside `jax.shard_map`:
  x      [..., m, K]      this device's token shard
  w      [K, n]           this device's column shard of the weight ([n, K] with transpose_w)
  y      [..., tp*m, n]   all tokens, this device's output columns
  x_full [..., tp*m, K]   the gathered input (returned with return_gathered=True; the backward
                          pass reuses it for dW)

Backward (the pair closes under differentiation, so fused kernels serve both passes):
  dx = matmul_reduce_scatter(dy, wᵀ)       [..., m, K]
  dw = x_fullᵀ · dy                         [K, n]
The backward hands w over as is with transpose_w (the kernels read it K-major), so no transposed
copy of the weight is made; the partner op's backward does the same with its weight.

FP8 operands (with x_scale and w_scale) run forward-only (ops/_fp8.py).
"""
from __future__ import annotations

from jaxflux.ops import _differentiable, _fp8, _plan


def all_gather_matmul(x, w, axis_name: str, *, return_gathered: bool = False, impl: str = "auto",
                      preferred_element_type=None, precision=None, x_scale=None, w_scale=None,
                      transpose_w: bool = False):
  """All-gathers `x` along its token axis (-2) over `axis_name`, then multiplies by `w`.

  Equivalent to `lax.all_gather(x, axis_name, axis=x.ndim - 2, tiled=True) @ w`, with the
  collective hidden inside the GEMM when the fused kernel runs. Call it inside `jax.shard_map`.

  Args:
    x: [..., m, K] local token shard; leading axes are batch.
    w: [K, n] local column shard of the weight ([n, K] with transpose_w).
    axis_name: the tensor-parallel mesh axis (size tp).
    return_gathered: also return x_full = the gathered x, [..., tp*m, K].
    impl: "auto" (fused kernel where it exists and the benchmark measured it ahead, else XLA),
      "fused" (the fused kernel or an error, never a silent fallback) or "xla" (pure-JAX
      reference). The fused kernel (Hopper GPUs, tp <= 8) takes bfloat16/float16 x and w of one
      dtype, K and N multiples of 8, and writes y in that dtype. Its backward computes dX with
      matmul_reduce_scatter(impl=impl).
    preferred_element_type: output dtype (accumulation is fp32 on the fused path); default is
      the promoted input dtype, bfloat16 for FP8.
    precision: `lax.Precision` for the XLA path, as in `lax.dot_general` (the fused kernel always
      multiplies bf16/fp16 inputs with fp32 accumulation). FP8 on Hopper: DEFAULT lets cuBLASLt
      accumulate fast, HIGHEST asks it for promoted accumulation.
    x_scale: FP8 only: float32 dequantization scale of x, shape () or (1,) (per tensor) or
      x.shape[:-1] + (1,) (per row). It is gathered with x, so each rank's scale stays with its
      own rows.
    w_scale: FP8 only: float32 dequantization scale of w, shape () or (1,) (per tensor) or
      (1, n) (per output column).
    transpose_w: w is given as its transpose, [n, K] (K-major, the layout the kernels read
      natively; required by the fused FP8 kernel); the op multiplies by wᵀ without
      materializing a transpose. A static Python bool.

  FP8: x and w each float8_e4m3fn or float8_e5m2 (both FP8 or neither), with both scales;
  y = (x.astype(f32) * x_scale) @ (w.astype(f32) * w_scale) in float32, cast to
  preferred_element_type. x_full (return_gathered) stays in x's FP8 dtype; the caller has the
  scales. FP8 calls are forward-only: differentiating one raises a TypeError (the layer recipe,
  jaxflux.Dense(..., dot_general_cls=flax.linen.Fp8DirectDotGeneralOp), trains in FP8).
  impl="auto" takes XLA for FP8 (at tp=1 on an H100 it takes the measured decode GEMM up to
  128 rows); impl="fused" needs (x, w) in (e4m3, e4m3) or (e5m2, e4m3),
  transpose_w=True, bfloat16 output, K and n multiples of 16 and tp <= 8.

  Returns:
    y [..., tp*m, n], or (y, x_full) when return_gathered.
  """
  plan, scales = _plan.plan("all_gather_matmul", x, w, axis_name, impl=impl,
                            preferred_element_type=preferred_element_type, precision=precision,
                            transpose_w=transpose_w, return_gathered=return_gathered,
                            x_scale=x_scale, w_scale=w_scale)
  if plan.fp8:
    return _fp8.all_gather_matmul(x, w, *scales, plan)
  return _differentiable.all_gather_matmul(x, w, plan)
