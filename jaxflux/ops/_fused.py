"""The fused FFI calls of the ops (per-device view, inside shard_map): output types, workspace
bytes, and the kernel configuration (`config`: the op plan's, chosen and encoded as the
target's attributes once by _config), passed on as it is.

Every result is typed like the XLA path's (its varying mesh axes), which a custom_vjp's
backward needs. At tp=1 there is nothing to gather or reduce: the op is its GEMM alone, the
GEMM-only target (ops/gemm.py) tuned as GEMM+AllReduce tunes its GEMM (by rows: the swap-AB
decode GEMM for few rows, CUTLASS's persistent GEMM for many), typed the same way."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxflux.ops import _common, _config, _group_call, gemm


def all_gather_matmul(x, w, axis_name: str, want_gathered: bool, *,
                      config: _config.KernelConfig, debug_skip_rank: int = -1):
  """(y, x_full or None) from the jaxflux_all_gather_matmul target (xla_ffi/ffi/ag_gemm.cc).

  With config.transpose_w, w is [n, K] and the kernel multiplies by wᵀ, reading w K-major.
  debug_skip_rank: test hook; that rank never signals its peers, so they time out.
  """
  tp = lax.axis_size(axis_name)
  # Typed like the XLA path's results: varying along the gathered axis and wherever x, w vary.
  axes = _common.vma(x) | _common.vma(w) | {axis_name}
  if tp == 1:
    y = gemm.call(x, w, attributes=config.attrs(), out_dtype=x.dtype)
    return _common.mark_varying(y, axes), (_common.mark_varying(x, axes) if want_gathered
                                           else None)
  shard_bytes = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
  m, k = x.shape[-2:]
  n = w.shape[0] if config.transpose_w else w.shape[1]
  out_types = [jax.ShapeDtypeStruct(x.shape[:-2] + (tp * m, n), x.dtype)]
  if want_gathered:
    out_types.append(jax.ShapeDtypeStruct(x.shape[:-2] + (tp * m, k), x.dtype))
  outs = _group_call.call(
      "all_gather_matmul", out_types, (x, w), axis_name, item_bytes=shard_bytes,
      debug_skip_rank=debug_skip_rank, **config.attrs())
  outs = [_common.mark_varying(o, axes) for o in outs]
  return outs[0], (outs[1] if want_gathered else None)


def matmul_reduce_scatter(x, w, axis_name: str, *, config: _config.KernelConfig,
                          debug_skip_rank: int = -1):
  """z from the jaxflux_matmul_reduce_scatter target (xla_ffi/ffi/gemm_rs.cc).

  With config.transpose_w, w is [N, k] and the kernel multiplies by wᵀ, reading w K-major.
  debug_skip_rank: test hook; that rank never signals its peers, so they time out.
  """
  tp = lax.axis_size(axis_name)
  # Typed like the XLA path's result: varying along the scattered axis and wherever x, w vary.
  axes = _common.vma(x) | _common.vma(w) | {axis_name}
  if tp == 1:
    z = gemm.call(x, w, attributes=config.attrs(), out_dtype=x.dtype)
    return _common.mark_varying(z, axes)
  m = x.shape[-2] // tp
  n = w.shape[0] if config.transpose_w else w.shape[1]
  batch = math.prod(x.shape[:-2])
  itemsize = jnp.dtype(x.dtype).itemsize
  z = _group_call.call(
      "matmul_reduce_scatter", jax.ShapeDtypeStruct(x.shape[:-2] + (m, n), x.dtype), (x, w),
      axis_name, item_bytes=batch * m * n * itemsize,  # one partial of this rank's rows
      debug_skip_rank=debug_skip_rank, **config.attrs())
  return _common.mark_varying(z, axes)


def matmul_all_reduce(x, w, axis_name: str, *, config: _config.KernelConfig,
                      debug_skip_rank: int = -1):
  """y = psum(x @ w) from the jaxflux_matmul_all_reduce target: each rank's partial product goes
  to its peers' receive slots, and every rank ends with the same sum.

  With config.transpose_w, w is [N, k] and the kernel multiplies by wᵀ, reading w K-major.
  debug_skip_rank: test hook; that rank never signals its peers, so they time out.
  """
  tp = lax.axis_size(axis_name)
  # Typed like the XLA path's psum: invariant along the summed axis, varying wherever else x or
  # w vary.
  axes = (_common.vma(x) | _common.vma(w)) - {axis_name}
  if tp == 1:
    y = gemm.call(x, w, attributes=config.attrs(), out_dtype=x.dtype)
    return _common.mark_varying(y, axes)
  m, k = x.shape[-2:]
  n = w.shape[0] if config.transpose_w else w.shape[1]
  batch = math.prod(x.shape[:-2])
  itemsize = jnp.dtype(x.dtype).itemsize
  y = _group_call.call(
      "matmul_all_reduce", jax.ShapeDtypeStruct(x.shape[:-1] + (n,), x.dtype), (x, w),
      axis_name, item_bytes=batch * m * n * itemsize,  # one rank's whole partial [..., M, N]
      debug_skip_rank=debug_skip_rank, **config.attrs())
  return _common.mark_varying(y, axes)


# --- FP8 ---------------------------------------------------------------------------------------
# The same targets with FP8 x (e4m3/e5m2) and w (e4m3, always given K-major as [n, K]): the
# scales come as two more operands after the rank operand, x's one per row and w's one per
# output column (float32), applied in the GEMMs' epilogues; outputs are bfloat16.

def _fp8_scales(x_scale_rows, w_scale_cols) -> tuple:
  return (x_scale_rows.astype(jnp.float32).reshape(-1),
          w_scale_cols.astype(jnp.float32).reshape(-1))


def all_gather_matmul_fp8(x, w, x_scale_rows, w_scale_cols, axis_name: str,
                          want_gathered: bool, *, out_dtype,
                          config: _config.KernelConfig, debug_skip_rank: int = -1):
  """(y, x_full or None) for FP8 x [..., m, K] and w [n, K] (K-major): y = all_gather(x ·
  x_scale_rows) · (w · w_scale_cols)ᵀ in out_dtype (bfloat16); x_full in x's dtype. The row
  scales [..., m, 1] travel with x (the kernel gathers them beside it)."""
  tp = lax.axis_size(axis_name)
  axes = (_common.vma(x) | _common.vma(w) | _common.vma(x_scale_rows) | _common.vma(w_scale_cols)
          | {axis_name})
  if tp == 1:
    y = _fp8_gemm(x, w, x_scale_rows, w_scale_cols, out_dtype, config)
    return _common.mark_varying(y, axes), (_common.mark_varying(x, axes) if want_gathered
                                           else None)
  m, k = x.shape[-2:]
  n = w.shape[0]
  batch = math.prod(x.shape[:-2])
  shard_bytes = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
  out_types = [jax.ShapeDtypeStruct(x.shape[:-2] + (tp * m, n), jnp.dtype(out_dtype))]
  if want_gathered:
    out_types.append(jax.ShapeDtypeStruct(x.shape[:-2] + (tp * m, k), x.dtype))
  outs = _group_call.call(
      "all_gather_matmul", out_types, (x, w), axis_name, item_bytes=shard_bytes,
      scale_bytes=batch * m * 4,  # the shard's float32 row scales travel with it
      scales=_fp8_scales(x_scale_rows, w_scale_cols), debug_skip_rank=debug_skip_rank,
      **config.attrs())
  outs = [_common.mark_varying(o, axes) for o in outs]
  return outs[0], (outs[1] if want_gathered else None)


def matmul_reduce_scatter_fp8(x, w, x_scale_rows, w_scale_cols, axis_name: str, *, out_dtype,
                              config: _config.KernelConfig,
                              debug_skip_rank: int = -1):
  """z = reduce_scatter((x · x_scale_rows) · (w · w_scale_cols)ᵀ) for FP8 x [..., M, k] and w
  [N, k] (K-major), in out_dtype (bfloat16); the partials pushed and summed are bfloat16."""
  tp = lax.axis_size(axis_name)
  axes = (_common.vma(x) | _common.vma(w) | _common.vma(x_scale_rows) | _common.vma(w_scale_cols)
          | {axis_name})
  if tp == 1:
    y = _fp8_gemm(x, w, x_scale_rows, w_scale_cols, out_dtype, config)
    return _common.mark_varying(y, axes)
  m = x.shape[-2] // tp
  n = w.shape[0]
  batch = math.prod(x.shape[:-2])
  out_itemsize = jnp.dtype(out_dtype).itemsize  # the partials' element
  z = _group_call.call(
      "matmul_reduce_scatter", jax.ShapeDtypeStruct(x.shape[:-2] + (m, n), jnp.dtype(out_dtype)),
      (x, w), axis_name, item_bytes=batch * m * n * out_itemsize,
      scales=_fp8_scales(x_scale_rows, w_scale_cols), debug_skip_rank=debug_skip_rank,
      **config.attrs())
  return _common.mark_varying(z, axes)


def matmul_all_reduce_fp8(x, w, x_scale_rows, w_scale_cols, axis_name: str, *, out_dtype,
                          config: _config.KernelConfig, debug_skip_rank: int = -1):
  """y = psum((x · x_scale_rows) · (w · w_scale_cols)ᵀ) for FP8 x [..., M, k] and w [N, k]
  (K-major), in out_dtype (bfloat16), the same on every rank; the partials pushed and summed
  are bfloat16."""
  tp = lax.axis_size(axis_name)
  # Typed like the XLA path's psum: invariant along the summed axis.
  axes = (_common.vma(x) | _common.vma(w) | _common.vma(x_scale_rows)
          | _common.vma(w_scale_cols)) - {axis_name}
  if tp == 1:
    y = _fp8_gemm(x, w, x_scale_rows, w_scale_cols, out_dtype, config)
    return _common.mark_varying(y, axes)
  m, k = x.shape[-2:]
  n = w.shape[0]
  batch = math.prod(x.shape[:-2])
  out_itemsize = jnp.dtype(out_dtype).itemsize  # the partials' element
  y = _group_call.call(
      "matmul_all_reduce", jax.ShapeDtypeStruct(x.shape[:-1] + (n,), jnp.dtype(out_dtype)),
      (x, w), axis_name, item_bytes=batch * m * n * out_itemsize,  # one rank's whole partial
      scales=_fp8_scales(x_scale_rows, w_scale_cols), debug_skip_rank=debug_skip_rank,
      **config.attrs())
  return _common.mark_varying(y, axes)


def _fp8_gemm(x, w, x_scale_rows, w_scale_cols, out_dtype, config):
  """An FP8 op at tp=1: the GEMM-only target on w [n, K], accumulating as the fused FP8
  kernels do."""
  fast = gemm.FP8_ACCUMULATE[jnp.dtype(x.dtype).name] == "fast"
  return gemm.call(x, w, attributes=config.attrs(), out_dtype=out_dtype,
                   scales=(x_scale_rows, w_scale_cols), fast_accum=int(fast))
