"""The grouped GEMM kernel (the jaxflux_grouped_gemm FFI target) as a differentiable function.

  forward      y [M, N] = x [M, K] · w[g] per group's rows    (kind 0)
  dx           dy · w[g]ᵀ: the forward kernel with w read in the other layout, no copy
  dw           dw[g] = x[rows of g]ᵀ · dy[rows of g]            (kind 1, K-grouped)

group_sizes stays on the device throughout: the kernel's setup step turns it into per-group
problem shapes, so a traced routing costs no host sync. Callers (grouped_matmul) check the
operands first; this module only builds the calls.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxflux import _runtime, tuning
from jaxflux.ops import _attributes, _common, _plan

_TARGET = "jaxflux_grouped_gemm"
_FORWARD, _WEIGHT_GRAD = 0, 1


def _call(a, b, group_sizes, out_shape, *, kind: int, transpose_w: bool, group_rows: float,
          tile: str | None, scales: tuple = (), out_dtype=None):
  _runtime.register_targets()
  if tile is None:
    tile = tuning.choose_grouped_matmul(group_rows=group_rows, n=out_shape[-1])
  attrs = dict(kind=kind, transpose_w=int(transpose_w),
               tile=_attributes.encode("grouped_tile", tile))
  # The workspace (per-group arguments, tensor maps) is a second result, sized here: the handler
  # allocates nothing (XLA assigns it like any buffer).
  workspace = _runtime.grouped_gemm_workspace_bytes(a.dtype, a.shape[0], out_shape[-1],
                                                    a.shape[1], group_sizes.shape[0], attrs)
  call = jax.ffi.ffi_call(_TARGET, (jax.ShapeDtypeStruct(out_shape, out_dtype or a.dtype),
                                    jax.ShapeDtypeStruct((workspace,), jnp.uint8)))
  out, _ = call(a, b, group_sizes, *scales,
                **{name: np.int64(value) for name, value in attrs.items()})
  # Inside shard_map the FFI result comes back unvarying; it varies as its operands do.
  axes = _common.vma(a) | _common.vma(b) | _common.vma(group_sizes)
  for s in scales:
    axes |= _common.vma(s)
  return _common.mark_varying(out, axes)


def forward_fp8(x, w, group_sizes, row_scale, col_scale, tile: str | None = None):
  """The FP8 forward: x [M, K] and w [G, N, K] float8_e4m3fn, row_scale [M] and col_scale
  [G, N] float32 -> y [M, N] bfloat16, y[i] = (x[i] · w[g]ᵀ) · row_scale[i] · col_scale[g]."""
  return _call(x, w, group_sizes, (x.shape[0], w.shape[1]), kind=_FORWARD, transpose_w=True,
               group_rows=x.shape[0] / max(w.shape[0], 1), tile=tile,
               scales=(row_scale.astype(jnp.float32), col_scale.astype(jnp.float32)),
               out_dtype=jnp.bfloat16)


def _forward(x, w, group_sizes, transpose_w: bool, tile: str | None):
  """x [M, K] · w [G, K, N] ([G, N, K] with transpose_w) per group -> [M, N]."""
  n = w.shape[1] if transpose_w else w.shape[2]
  return _call(x, w, group_sizes, (x.shape[0], n), kind=_FORWARD, transpose_w=transpose_w,
               group_rows=x.shape[0] / max(w.shape[0], 1), tile=tile)


def _weight_grad(a, b, group_sizes, tile: str | None):
  """dw [G, Ka, Nb]: dw[g] = a[rows of g]ᵀ · b[rows of g], a [M, Ka], b [M, Nb]. The tile's M
  side runs over Ka, the same for every group."""
  groups = group_sizes.shape[0]
  return _call(a, b, group_sizes, (groups, a.shape[1], b.shape[1]), kind=_WEIGHT_GRAD,
               transpose_w=False, group_rows=a.shape[1], tile=tile)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def grouped_matmul(x, w, group_sizes, transpose_w: bool, tile: str | None = None):
  """The fused grouped GEMM: x [M, K], w [G, K, N] (or [G, N, K]), group_sizes [G] int32, one
  16-bit dtype; y [M, N] in that dtype (fp32 accumulation). tile: one of
  tuning.GROUPED_TILES for every call of the forward and backward, None for the tuned ones."""
  return _forward(x, w, group_sizes, transpose_w, tile)


def _fwd(x, w, group_sizes, transpose_w, tile):
  _plan.refuse_forward_mode("grouped_matmul", x, w)
  return _forward(x, w, group_sizes, transpose_w, tile), (x, w, group_sizes)


def _bwd(transpose_w, tile, residuals, dy):
  x, w, group_sizes = residuals
  dy = dy.astype(x.dtype)
  # dx = dy · w[g]ᵀ: w read in the other layout. dw in w's own layout: [G, K, N] is xᵀ·dy per
  # group, [G, N, K] is dyᵀ·x.
  dx = _forward(dy, w, group_sizes, not transpose_w, tile)
  dw = (_weight_grad(dy, x, group_sizes, tile) if transpose_w
        else _weight_grad(x, dy, group_sizes, tile))
  # Typed like the primals, as a custom_vjp's cotangents must be: summed over the axes the
  # operand was broadcast along (e.g. a weight shared by every token shard).
  return (_common.match_vma(dx, x), _common.match_vma(dw.astype(w.dtype), w),
          np.zeros(group_sizes.shape, jax.dtypes.float0))


grouped_matmul.defvjp(_fwd, _bwd)


def supported(x, w, out_dtype, k: int, n: int) -> str | None:
  """Why the kernel can't take these operands (a sentence for impl='fused'), or None."""
  for name, a in (("x", x), ("w", w)):
    if a.dtype not in (jnp.bfloat16, jnp.float16):
      return (f"{name}.dtype={a.dtype}: the grouped GEMM kernel takes bfloat16 or float16 "
              "(fp32 accumulation). Cast the operands, or use impl='auto'/'xla'.")
  if x.dtype != w.dtype:
    return f"x.dtype={x.dtype} and w.dtype={w.dtype} differ; the kernel needs one dtype."
  if out_dtype != x.dtype:
    return (f"preferred_element_type={out_dtype}: the kernel writes its input dtype "
            f"({x.dtype}). Pass preferred_element_type=None, or use impl='xla'.")
  if k % 8 or n % 8:
    return (f"K={k} and N={n} must be multiples of 8 (16-byte rows for TMA). Pad the "
            "weights, or use impl='xla'.")
  return None
