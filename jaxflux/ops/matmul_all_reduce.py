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
"""
from __future__ import annotations

from jaxflux.ops import _differentiable, _plan


def matmul_all_reduce(x, w, axis_name: str, *, impl: str = "auto", preferred_element_type=None,
                      precision=None, transpose_w: bool = False):
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
    preferred_element_type: output dtype; default is the promoted input dtype.
    precision: `lax.Precision` for the XLA path, as in `lax.dot_general`.
    transpose_w: w is given as its transpose, [N, k] (K-major, the layout the kernels read
      natively); the op multiplies by wᵀ without materializing a transpose. A static Python
      bool.

  FP8 operands are refused (TypeError): all_gather_matmul and matmul_reduce_scatter take them.

  Returns:
    y [..., M, N].
  """
  plan, _ = _plan.plan("matmul_all_reduce", x, w, axis_name, impl=impl,
                       preferred_element_type=preferred_element_type, precision=precision,
                       transpose_w=transpose_w)
  return _differentiable.matmul_all_reduce(x, w, plan)
