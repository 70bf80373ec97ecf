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

import importlib
import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jaxflux.ops import _common

# The partner op's module (jaxflux.ops re-exports its function under the same name).
ag = importlib.import_module("jaxflux.ops.all_gather_matmul")


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
  return apply(x, w, axis_name, impl, preferred_element_type, precision, transpose_w=False)


def apply(x, w, axis_name, impl, preferred_element_type, precision, *, transpose_w):
  """matmul_reduce_scatter of checked operands, by w or, with transpose_w, by wᵀ (w is then
  [N, k]: all_gather_matmul's backward passes its forward weight so)."""
  _resolve(impl, x, w, preferred_element_type, axis_name, transpose_w)
  return _matmul_reduce_scatter(x, w, axis_name, impl,
                                _common.static_dtype(preferred_element_type), precision,
                                transpose_w)


# impl="auto" runs the fused kernel inside the region where it was measured ahead of XLA by more
# than the run-to-run noise (benchmarks/README.md, 2xH200, tp=2): from M = 2048 rows up, unless
# the per-device GEMM is so long that the communication it hides is a few percent of it and the
# kernel's own costs (two half-height GEMMs, one reduction pass) eat the gain. Rows past the cap
# measured 0.99x-1.04x XLA (GPT-3 FC2 at M=8192 and 16384, Llama-70B FC2 at M=16384, with the
# same kernel timed 7% apart in one run); every row under it with M >= 2048 won by >= 1.05x.
AUTO_FUSED_TP = (2,)
AUTO_FUSED_MIN_ROWS = 2048          # rows of x (all tokens, times batch) before the scatter
AUTO_FUSED_MAX_ROWS_TIMES_K = 2**27  # rows * (K / tp), the per-device GEMM's M * K


def _auto_prefers_fused(x, w, tp: int) -> bool:
  """impl="auto": fused only inside the measured winning region (see AUTO_FUSED_*)."""
  del w
  rows = x.size // x.shape[-1]
  return (tp in AUTO_FUSED_TP and rows >= AUTO_FUSED_MIN_ROWS
          and rows * x.shape[-1] <= AUTO_FUSED_MAX_ROWS_TIMES_K)


def _resolve(impl, x, w, preferred_element_type, axis_name, transpose_w=False) -> str:
  return _common.resolve_on_axis("matmul_reduce_scatter", impl, x, w, preferred_element_type,
                                 axis_name, _auto_prefers_fused, transpose_w)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _matmul_reduce_scatter(x, w, axis_name, impl, preferred_element_type, precision, transpose_w):
  return _forward(x, w, axis_name, impl, preferred_element_type, precision, transpose_w)


def _forward(x, w, axis_name, impl, preferred_element_type, precision, transpose_w):
  if _resolve(impl, x, w, preferred_element_type, axis_name, transpose_w) == "fused":
    return _fused(x, w, axis_name, transpose_w=transpose_w)
  partial_sum = _common.matmul(x, w, precision=precision,
                               preferred_element_type=preferred_element_type,
                               transpose_w=transpose_w)
  return lax.psum_scatter(partial_sum, axis_name, scatter_dimension=x.ndim - 2, tiled=True)


# Where the fused kernel sums the partials (tests, tuning): None lets it choose (at tp=2 the
# own-rows GEMM's epilogue when the peer's partial is small for its K, else a separate pass;
# docs/design.md gives the rule); "pass" forces the separate wait+reduce kernel; "epilogue"
# requires the epilogue reduction (tp=2 only).
REDUCE_MODES = {None: 0, "pass": 1, "epilogue": 2}


def _fused(x, w, axis_name, debug_skip_rank=-1, reduce=None, transpose_w=False):
  """The fused kernel (jaxflux_matmul_reduce_scatter FFI target, xla_ffi/ffi/gemm_rs.cc).

  debug_skip_rank: test hook; that rank never signals its peers, so they time out.
  reduce: one of REDUCE_MODES (tests, tuning).
  transpose_w: w is [N, k] and the kernel multiplies by wᵀ, reading w K-major.
  """
  from jaxflux.ops import all_gather as all_gather_module  # rank_info lives with the runtime op
  from jaxflux.ops import gemm as gemm_module

  if reduce not in REDUCE_MODES:
    raise ValueError(f"matmul_reduce_scatter: reduce={reduce!r}; use one of "
                     f"{list(REDUCE_MODES)}")
  tp = lax.axis_size(axis_name)
  if reduce == "epilogue" and tp != 2:
    raise ValueError(f"matmul_reduce_scatter: reduce='epilogue' needs tp=2 (here tp={tp}); "
                     "use reduce=None")
  if tp == 1:  # nothing to reduce
    return gemm_module.gemm(x, w.T if transpose_w else w)
  m = x.shape[-2] // tp
  n = w.shape[0] if transpose_w else w.shape[1]
  partial_bytes = math.prod(x.shape[:-2]) * m * n * jnp.dtype(x.dtype).itemsize
  # Two parities of [tp receive slots, tp staging slots].
  z = all_gather_module.call_group_op(
      "matmul_reduce_scatter", jax.ShapeDtypeStruct(x.shape[:-2] + (m, n), x.dtype), (x, w),
      axis_name, 2 * 2 * tp * all_gather_module.slot_bytes(partial_bytes),
      debug_skip_rank=debug_skip_rank, reduce=REDUCE_MODES[reduce], transpose_w=int(transpose_w))
  # Typed like the XLA path's result: varying along the scattered axis and wherever x, w vary.
  return _common.mark_varying(z, _common.vma(x) | _common.vma(w) | {axis_name})


def _fwd(x, w, axis_name, impl, preferred_element_type, precision, transpose_w):
  out = _forward(x, w, axis_name, impl, preferred_element_type, precision, transpose_w)
  return out, (x, w)


def _bwd(axis_name, impl, preferred_element_type, precision, transpose_w, residuals, dz):
  x, w = residuals
  dz = dz.astype(_common.result_dtype(x, w, None))
  # dX = all_gather(dz) · W_effᵀ through the fused AllGather+GEMM, with the same w flipped:
  # W_effᵀ is w itself when w came transposed, else w read K-major.
  dx, dz_full = ag.apply(dz, w, axis_name, True, impl, x.dtype, precision,
                         transpose_w=not transpose_w)
  # dW_eff = xᵀ · dz_full; w holds its transpose when transpose_w.
  dw = (_common.weight_grad(dz_full, x, precision=precision, dtype=w.dtype) if transpose_w
        else _common.weight_grad(x, dz_full, precision=precision, dtype=w.dtype))
  return _common.match_vma(dx, x), _common.match_vma(dw, w)


_matmul_reduce_scatter.defvjp(_fwd, _bwd)
