"""FP8 operands of grouped_matmul: the scales' checks, the reference (XLA) math, the kernel's
rules, and the forward-only wrapper.

An FP8 call multiplies `x.astype(f32) * x_scale` by each `w[g].astype(f32) * w_scale[g]`: x's
scale per tensor or per row [M, 1], w's per tensor or per output column of each expert
[G, 1, N]. Both commute with the sum over K, so the kernel applies them to the fp32 product in
its epilogue, and the reference scales the float32 operands before one ragged dot (exact
products on any platform). Like the tensor-parallel ops' FP8 calls, it is forward-only.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxflux.ops import _fp8, _grouped_kernel, _plan

_OP = "grouped_matmul"
_F32 = jnp.dtype(jnp.float32)
KERNEL_DTYPE = jnp.dtype(jnp.float8_e4m3fn)  # the kernel's x and w (wgmma's e4m3 x e4m3)


def scales(x, w, x_scale, w_scale, transpose_w: bool) -> tuple:
  """(row scales float32 [M, 1], column scales float32 [G, 1, N]) from per-tensor or row- /
  column-wise scales; raises naming the argument and the shapes it takes."""
  groups = w.shape[0]
  n = w.shape[1] if transpose_w else w.shape[2]
  rows = _plan.fp8_scale(_OP, "x_scale", "x", x, x_scale, (x.shape[0], 1),
                         "(M, 1), one per row of x")
  cols = _plan.fp8_scale(_OP, "w_scale", "w", w, w_scale, (groups, 1, n),
                         "(G, 1, N), one per output column of each group's weight")
  return rows, cols


def reference(x, w, group_sizes, rows, cols, out_dtype, transpose_w: bool, dimension_numbers,
              precision):
  """The XLA path: the scaled float32 operands, one ragged dot, cast to out_dtype."""
  xs = x.astype(_F32) * rows
  ws = w.astype(_F32) * (jnp.swapaxes(cols, 1, 2) if transpose_w else cols)
  y = lax.ragged_dot_general(xs, ws, group_sizes, dimension_numbers, precision=precision,
                             preferred_element_type=_F32)
  return y.astype(out_dtype)


def kernel_reason(x, w, out_dtype, transpose_w: bool) -> str | None:
  """Why the FP8 grouped GEMM kernel can't take these operands, or None."""
  if x.dtype != KERNEL_DTYPE or w.dtype != KERNEL_DTYPE:
    return (f"x.dtype={x.dtype}, w.dtype={w.dtype}: the FP8 grouped GEMM kernel takes "
            "float8_e4m3fn x and w. Quantize both to e4m3, or use impl='xla'.")
  if not transpose_w:
    return ("the FP8 grouped GEMM kernel reads w K-major: pass w as [G, N, K] with "
            "transpose_w=True (wgmma takes 8-bit operands K-major only), or use impl='xla'.")
  if jnp.dtype(out_dtype) != jnp.dtype(jnp.bfloat16):
    return (f"preferred_element_type={out_dtype}: the FP8 grouped GEMM kernel writes bfloat16. "
            "Pass preferred_element_type=None (bfloat16), or use impl='xla'.")
  k, n = x.shape[1], w.shape[1]
  if k % 16 or n % 8:
    return (f"K={k} must be a multiple of 16 and N={n} of 8 (16-byte rows for TMA). Pad the "
            "weights, or use impl='xla'.")
  return None


def forward_only(forward, *operands):
  """forward(*operands) as a custom_vjp whose backward raises a TypeError at trace time."""
  return _fp8._forward_only(_OP, forward, *operands, message=(
      f"jaxflux.{_OP}: an FP8 call (float8 x and w with x_scale and w_scale) is forward-only: "
      "its gradient needs the cotangent quantized to FP8 with scales of its own, which a "
      "training recipe keeps. Differentiate a 16-bit call, or keep the FP8 call's inputs out "
      "of the differentiation (jax.lax.stop_gradient)."))


def kernel(x, w, group_sizes, rows, cols, tile: str | None = None):
  """The FP8 grouped GEMM kernel: x [M, K] e4m3, w [G, N, K] e4m3, scales [M, 1] and
  [G, 1, N] -> y [M, N] bfloat16."""
  return _grouped_kernel.forward_fp8(x, w, group_sizes, rows.reshape(-1),
                                     cols.reshape(w.shape[0], -1), tile)

