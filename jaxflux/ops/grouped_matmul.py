"""Grouped GEMM, the expert matmul of a mixture-of-experts layer: the rows of x are sorted by
group (expert), and each group's rows are multiplied by that group's weight.

  x [M, K]             tokens sorted by group: group 0's rows first, then group 1's, ...
  w [G, K, N]          one weight per group ([G, N, K] with transpose_w)
  group_sizes [G]      rows per group (integer), summing to at most M
  y [M, N]             y[i] = x[i] @ w[g] for row i of group g; rows past sum(group_sizes) are 0

The semantics are those of `jax.lax.ragged_dot`. The XLA path is `lax.ragged_dot_general`,
which contracts a weight given as [G, N, K] (transpose_w) over its last axis in place, with no
transposed copy. Its differentiation is ragged_dot's own: dx and dw are ragged dots too, zero
for rows past the sum and for empty groups.

impl="fused" runs jaxflux's grouped GEMM kernel (CUTLASS's sm90 ptr-array grouped GEMM, bf16
or fp16 with fp32 accumulation, _grouped_kernel): group_sizes stays on the device, an empty
group costs nothing, and the backward is the same kernel (dx) and its K-grouped form (dw).
It raises FusedKernelUnavailableError where the kernel can't run (no Hopper GPU, a build
without CUDA, other dtypes); impl="auto" runs the kernel where it can run, by the tuning
table's rule for grouped_matmul (measured ahead of ragged_dot on every row), else XLA.

The op communicates nothing, so in expert parallelism it runs inside `jax.shard_map` on each
device's own experts (w, group_sizes) and the rows routed to them (x).

FP8 (x and w float8 with x_scale and w_scale, _grouped_fp8): forward-only, bfloat16 out by
default; the kernel takes e4m3 x and w with w given [G, N, K] (transpose_w=True) and applies
both scales in its epilogue. impl="auto" takes XLA for FP8 (no timing of the FP8 kernel
against XLA backs a rule yet).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxflux import tuning
from jaxflux.ops import _common, _dispatch, _grouped_fp8, _grouped_kernel, _plan, _platform

_OP = "grouped_matmul"


def grouped_matmul(x, w, group_sizes, *, impl: str = "auto", preferred_element_type=None,
                   transpose_w: bool = False, precision=None, x_scale=None, w_scale=None):
  """Multiplies each group of rows of `x` by its group's weight in `w`.

  Equivalent to `jax.lax.ragged_dot(x, w, group_sizes)` (with transpose_w, to ragged_dot by
  `w.swapaxes(1, 2)`, without materializing it).

  Args:
    x: [M, K] rows sorted by group: the first group_sizes[0] rows belong to group 0, the next
      group_sizes[1] to group 1, and so on.
    w: [G, K, N] one weight per group ([G, N, K] with transpose_w).
    group_sizes: [G] integer row counts (any integer dtype; cast to int32), each >= 0, summing
      to at most M: checked where the counts are known at trace time (ValueError); traced
      counts are, as in ragged_dot, the caller's responsibility.
    impl: "auto" (the kernel where it runs and the tuning table's rule takes it, else XLA),
      "fused" (the grouped GEMM kernel, or
      FusedKernelUnavailableError saying why it can't run) or "xla"
      (`lax.ragged_dot_general`).
    preferred_element_type: the output dtype, a floating dtype; default is the promoted dtype
      of x and w.
    transpose_w: w is given K-major, [G, N, K]; the op multiplies by each w[g]ᵀ in place. A
      static Python bool.
    precision: `lax.Precision` for the XLA path, as in `lax.ragged_dot`.
    x_scale: FP8 only: float32 dequantization scale of x, shape () or (1,) (per tensor) or
      (M, 1) (per row).
    w_scale: FP8 only: float32 dequantization scale of w, shape () or (1,) (per tensor) or
      (G, 1, N) (per output column of each group's weight, whichever layout w has).

  FP8: x and w each float8_e4m3fn or float8_e5m2 (both FP8 or neither), with both scales;
  y[i] = (x[i].astype(f32) * x_scale[i]) @ (w[g].astype(f32) * w_scale[g]) in float32, cast to
  preferred_element_type (default bfloat16). Forward-only: differentiating it raises a
  TypeError. The kernel takes e4m3 x and w with w given [G, N, K] (transpose_w=True), K a
  multiple of 16 and a bfloat16 output; impl="fused" takes it there, impl="auto" takes XLA.

  Returns:
    y [M, N] in preferred_element_type; rows past sum(group_sizes) are zeros.
  """
  _plan.check_impl(_OP, impl)
  transpose_w = _plan.static_bool(_OP, "transpose_w", transpose_w)
  if _plan.fp8_operands(_OP, x, w, x_scale, w_scale):
    return _fp8_call(x, w, group_sizes, x_scale, w_scale, impl=impl, transpose_w=transpose_w,
                     preferred_element_type=preferred_element_type, precision=precision)
  group_sizes = _check_operands(x, w, group_sizes, transpose_w)
  out_dtype = _out_dtype(x, w, preferred_element_type)
  kernel = _dispatch.decide(_OP, impl, lambda: _kernel_reason(x, w, out_dtype, transpose_w),
                            tp=1, rows=x.shape[0], k=x.shape[1], fix="")
  if kernel == "fused":
    return _grouped_kernel.grouped_matmul(x, w, group_sizes, transpose_w, forced_tile())
  return lax.ragged_dot_general(x, w, group_sizes, _dimension_numbers(transpose_w),
                                precision=precision, preferred_element_type=out_dtype)


def _fp8_call(x, w, group_sizes, x_scale, w_scale, *, impl, transpose_w, preferred_element_type,
              precision):
  """The FP8 grouped matmul (_grouped_fp8), forward-only."""
  group_sizes = _check_operands(x, w, group_sizes, transpose_w)
  rows, cols = _grouped_fp8.scales(x, w, x_scale, w_scale, transpose_w)
  out_dtype = _out_dtype(x, w, preferred_element_type or _common.FP8_OUT_DTYPE)
  kernel = _dispatch.decide(
      _OP, impl, lambda: (_grouped_fp8.kernel_reason(x, w, out_dtype, transpose_w)
                          or _platform.platform_reason()),
      tp=1, rows=x.shape[0], k=x.shape[1], fp8=True, fix="")
  if kernel == "fused":
    return _grouped_fp8.forward_only(functools.partial(_grouped_fp8.kernel, tile=forced_tile()),
                                     x, w, group_sizes, rows, cols)
  forward = lambda *a: _grouped_fp8.reference(  # noqa: E731
      *a, out_dtype, transpose_w, _dimension_numbers(transpose_w), precision)
  return _grouped_fp8.forward_only(forward, x, w, group_sizes, rows, cols)


def forced_tile() -> str | None:
  """The grouped GEMM tile an override block forces on this call (None: tuned per GEMM), for
  grouped_matmul and the MoE ops. Read where the op is called and passed into its custom_vjp
  as an argument: JAX caches the traces of a custom_vjp by its arguments, so a tile chosen
  inside it could outlive the block."""
  return tuning.overrides(_OP).get("tile")


def _kernel_reason(x, w, out_dtype, transpose_w: bool) -> str | None:
  """Why the grouped GEMM kernel can't run these operands here, or None."""
  n = w.shape[1] if transpose_w else w.shape[2]
  return (_grouped_kernel.supported(x, w, out_dtype, x.shape[1], n)
          or _platform.platform_reason())


def _dimension_numbers(transpose_w: bool) -> lax.RaggedDotDimensionNumbers:
  """x's rows (axis 0) are ragged over w's groups (axis 0); K is w's axis 1, or 2 when w is
  given [G, N, K]."""
  return lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((1,), (2 if transpose_w else 1,)), ((), ())),
      lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))


def check_rows_and_weights(op: str, name: str, x, w, transpose_w: bool, *, x_layout: str,
                           w_holds: str, w_rank_fix: str) -> None:
  """The checks every grouped GEMM's operands share: x (called `name`) [rows, K], w [G, K, N]
  ([G, N, K] with transpose_w) with x's K, both floating. x_layout and w_holds describe the
  operands in the messages; w_rank_fix says how to fix a w of the wrong rank."""
  if jnp.ndim(x) != 2:
    raise ValueError(f"{op}: {name} must have rank 2 ({x_layout}); got shape {jnp.shape(x)}. "
                     f"Flatten the token axes, e.g. {name}.reshape(-1, {name}.shape[-1]).")
  layout = "[G, N, K]" if transpose_w else "[G, K, N]"
  if jnp.ndim(w) != 3:
    raise ValueError(f"{op}: w must have rank 3 ({layout}, {w_holds}); got shape "
                     f"{jnp.shape(w)}. {w_rank_fix}")
  w_k = w.shape[2] if transpose_w else w.shape[1]
  if x.shape[1] != w_k:
    fix = ("With transpose_w=True w is [G, N, K]; pass transpose_w=False if it is stored "
           "[G, K, N]." if transpose_w else
           "Pass w as [G, K, N], or pass transpose_w=True if it is stored [G, N, K].")
    raise ValueError(f"{op}: contraction sizes differ: {name} has K={x.shape[1]} ({name}.shape="
                     f"{x.shape}) but w has K={w_k} (w.shape={w.shape}, transpose_w="
                     f"{transpose_w}). {fix}")
  for arg, a in ((name, x), ("w", w)):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise TypeError(f"{op}: {arg} must be a floating-point array; got dtype {a.dtype}. "
                      f"Cast it, e.g. {arg}.astype(jnp.bfloat16).")


def _check_operands(x, w, group_sizes, transpose_w: bool):
  """Ranks, contraction size and dtypes of x, w and group_sizes (static facts only; FP8 pairs
  and their scales are checked before); returns group_sizes as int32."""
  check_rows_and_weights(
      _OP, "x", x, w, transpose_w, x_layout="[M, K], rows sorted by group",
      w_holds="one weight per group",
      w_rank_fix=("For a single group pass w[None] (with group_sizes of length 1)."
                  if jnp.ndim(w) == 2 else "Stack the groups' weights along axis 0."))
  if not hasattr(group_sizes, "dtype"):
    group_sizes = jnp.asarray(group_sizes)
  num_groups = w.shape[0]
  if jnp.ndim(group_sizes) != 1 or group_sizes.shape[0] != num_groups:
    raise ValueError(f"{_OP}: group_sizes must have shape (G,) = ({num_groups},), one row count "
                     f"per group of w (w.shape={w.shape}); got shape {jnp.shape(group_sizes)}.")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise TypeError(f"{_OP}: group_sizes must have an integer dtype (row counts); got "
                    f"{group_sizes.dtype}. Pass group_sizes.astype(jnp.int32).")
  _check_known_sizes(group_sizes, x.shape[0])
  return group_sizes.astype(jnp.int32)


def _check_known_sizes(group_sizes, rows: int) -> None:
  """Row counts known at trace time (not traced) must be >= 0 and sum to at most M: the kernel
  clamps bad counts and XLA's ragged_dot does not, so they would give different results."""
  if isinstance(group_sizes, jax.core.Tracer) or not getattr(group_sizes, "is_fully_addressable",
                                                              True):
    return
  sizes = np.asarray(group_sizes)
  if (sizes < 0).any():
    raise ValueError(f"{_OP}: group_sizes={sizes.tolist()} has negative row counts; each "
                     "group's count must be >= 0.")
  if sizes.sum() > rows:
    raise ValueError(f"{_OP}: group_sizes={sizes.tolist()} sums to {int(sizes.sum())}, more "
                     f"than x's {rows} rows: the counts must sum to at most M.")


def _out_dtype(x, w, preferred_element_type):
  dtype = _common.result_dtype(x, w, preferred_element_type)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{_OP}: preferred_element_type={dtype} is not a floating dtype. Pass "
                    "jnp.float32 or jnp.bfloat16, or None for the promoted dtype of x and w "
                    f"({jnp.result_type(x.dtype, w.dtype)}).")
  return dtype
