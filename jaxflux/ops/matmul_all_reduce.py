"""GEMM+AllReduce: y = psum(x @ w), the row-parallel matmul of tensor parallelism without
sequence parallelism (every rank holds all tokens before and after the layer).

Per-device view inside `jax.shard_map`:
  x [..., M, k]      all tokens, this device's slice of the contraction dim
  w [k, N]           this device's row shard of the weight
  y [..., M, N]      the summed output, the same on every device

Backward, with no communication (dY arrives whole on every device, like y):
  dx = dY · wᵀ       [..., M, k]   contracted against w in place: no transposed copy
  dw = xᵀ · dY       [k, N]

impl="auto" takes XLA's psum for this op everywhere: no two-GPU timing of the fused kernel
against XLA exists yet, and the tuning table's AUTO_RULES take a kernel only where one was
measured ahead.
"""
from __future__ import annotations

from jaxflux.ops import _common, _differentiable


def matmul_all_reduce(x, w, axis_name: str, *, impl: str = "auto", preferred_element_type=None,
                      precision=None):
  """Multiplies `x` by `w`, then sums the products over `axis_name`.

  Equivalent to `lax.psum(x @ w, axis_name)`, with the all-reduce fused with the GEMM when the
  fused kernel runs. Call it inside `jax.shard_map`; the result is invariant over `axis_name`
  (replicated, like psum's), so an `out_specs` without `axis_name` fits it.

  Args:
    x: [..., M, k] all tokens, local slice of the contraction dim.
    w: [k, N] local row shard of the weight.
    axis_name: the tensor-parallel mesh axis (size tp).
    impl: "auto" (XLA for this op, for now), "fused" (fused kernel or an error) or "xla"
      (pure-JAX reference).
    preferred_element_type: output dtype; default is the promoted input dtype.
    precision: `lax.Precision` for the XLA path, as in `lax.dot_general`.

  FP8 operands are refused (TypeError): all_gather_matmul and matmul_reduce_scatter take them.

  Returns:
    y [..., M, N].
  """
  op = "matmul_all_reduce"
  _common.check_impl(op, impl)
  _common.check_operands(op, x, w)
  for name, a in (("x", x), ("w", w)):
    if _common.is_narrow_float(a.dtype):
      raise TypeError(
          f"{op}: {name}.dtype={a.dtype}: matmul_all_reduce does not take FP8 operands. FP8 runs "
          "through all_gather_matmul and matmul_reduce_scatter (x_scale=, w_scale=), i.e. "
          "tensor parallelism with sequence parallelism (jaxflux.Dense(..., "
          "sequence_parallel=True)); here pass x and w in bfloat16 or float16.")
  _common.axis_size(op, axis_name)
  return _differentiable.matmul_all_reduce(x, w, axis_name, impl, preferred_element_type,
                                           precision, transpose_w=False)
