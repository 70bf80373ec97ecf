"""GEMM+AllReduce: y = psum(x @ w), the row-parallel matmul of tensor parallelism without
sequence parallelism (every rank holds all tokens before and after the layer).

Per-device view inside `jax.shard_map`:
  x [..., M, k]      all tokens, this device's slice of the contraction dim
  w [k, N]           this device's row shard of the weight ([N, k] with transpose_w)
  y [..., M, N]      the summed output, the same on every device

Backward, with no communication (dY arrives whole on every device, like y):
  dx = dY · wᵀ       [..., M, k]   contracted against w in place: no transposed copy
  dw = xᵀ · dY       [k, N]

impl="auto" takes XLA's psum for this op everywhere: no two-GPU timing of the fused kernel
against XLA exists yet, and the tuning table's AUTO_RULES take a kernel only where one was
measured ahead.

FP8 operands (with x_scale and w_scale) run forward-only (ops/_fp8.py).
"""
from __future__ import annotations

from jaxflux.ops import _differentiable, _fp8, _plan


def matmul_all_reduce(x, w, axis_name: str, *, impl: str = "auto", preferred_element_type=None,
                      precision=None, x_scale=None, w_scale=None, transpose_w: bool = False):
  """Multiplies `x` by `w`, then sums the products over `axis_name`.

  Equivalent to `lax.psum(x @ w, axis_name)`, with the all-reduce fused with the GEMM when the
  fused kernel runs. Call it inside `jax.shard_map`; the result is invariant over `axis_name`
  (replicated, like psum's), so an `out_specs` without `axis_name` fits it.

  Args:
    x: [..., M, k] all tokens, local slice of the contraction dim.
    w: [k, N] local row shard of the weight ([N, k] with transpose_w).
    axis_name: the tensor-parallel mesh axis (size tp).
    impl: "auto" (XLA for this op, for now), "fused" (fused kernel or an error) or "xla"
      (pure-JAX reference).
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
  rank's partial (x.astype(f32) * x_scale) @ (w.astype(f32) * w_scale) is summed over the
  ranks, then cast to preferred_element_type. The XLA reference sums float32 partials; the
  fused kernel sums bfloat16 partials (one more rounding per rank). FP8 calls are
  forward-only: differentiating one raises a TypeError (the layer recipe,
  jaxflux.Dense(..., dot_general_cls=flax.linen.Fp8DirectDotGeneralOp), trains in FP8).
  impl="auto" takes XLA for FP8 (at tp=1 on an H100 it takes the measured decode GEMM up to
  128 rows); impl="fused" needs (x, w) in (e4m3, e4m3) or (e5m2, e4m3),
  transpose_w=True, bfloat16 output, k and N multiples of 16 and tp <= 8.

  Returns:
    y [..., M, N].
  """
  plan, scales = _plan.plan("matmul_all_reduce", x, w, axis_name, impl=impl,
                            preferred_element_type=preferred_element_type, precision=precision,
                            transpose_w=transpose_w, x_scale=x_scale, w_scale=w_scale)
  if plan.fp8:
    return _fp8.matmul_all_reduce(x, w, *scales, plan)
  return _differentiable.matmul_all_reduce(x, w, plan)
