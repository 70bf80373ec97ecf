"""The fused FFI calls of the tensor-parallel MoE ops (per-device view, inside shard_map, tp >= 2):
output types, workspace bytes and the grouped GEMM tile (jaxflux.tuning) as attributes.

Rows are laid out by segment: segment p (rows [p*s, (p+1)*s)) holds the (token, expert) pairs of
rank p's token shard, sorted by expert, and group_sizes[p] counts them per expert. A segment's
tiles read one rank's tokens only, which is what lets the communication of one segment hide
behind the grouped GEMM of another (xla_ffi/ffi/moe_gemm.cc says how).

  all_gather_grouped     rows[p*s + j] = row_scale[p, j] · x of rank p [token_index[p, j]]
                         y[segment p]  = rows[segment p] · w[g] per expert group g of segment p
  grouped_reduce_scatter y_rows        = Σ over ranks of (h[segment r] · w[g] per group), r this
                                         rank: its segment, reduced over the K shards
                         z[t]          = Σ_k weights[t, k] · y_rows[row_index[t, k]]
An index outside its range (token_index outside [0, m), row_index outside [0, s)) stands for a
zero row. Callers (ops/moe_matmul.py) check the operands first.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxflux import tuning
from jaxflux.ops import _attributes, _common, _group_call

_AG_OP = "all_gather_grouped_matmul"
_RS_OP = "grouped_matmul_reduce_scatter"


def _tile(tile: str | None, rows_per_group: float, n: int) -> int:
  """The tile attribute: `tile` (an override's), else the tuned one."""
  if tile is None:
    tile = tuning.choose_grouped_matmul(group_rows=rows_per_group, n=n)
  return _attributes.encode("grouped_tile", tile)


def all_gather_grouped(x, w, group_sizes, token_index, row_scale, axis_name: str, *,
                       transpose_w: bool, tile: str | None = None, debug_skip_rank: int = -1):
  """(y [tp*s, n], rows [tp*s, K]) from the jaxflux_all_gather_grouped_matmul target.

  x [m, K] this rank's tokens; w [G, K, n] ([G, n, K] with transpose_w); group_sizes [tp, G],
  token_index [tp, s] int32 and row_scale [tp, s] float32, the same on every rank. rows (the
  gathered, scaled, sorted A operand) is the weight gradient's operand.
  debug_skip_rank: test hook; that rank never signals its peers, so they time out.
  """
  tp = lax.axis_size(axis_name)
  m, k = x.shape
  s = token_index.shape[1]
  groups = w.shape[0]
  n = w.shape[1] if transpose_w else w.shape[2]
  axes = (_common.vma(x) | _common.vma(w) | _common.vma(group_sizes) | _common.vma(token_index)
          | _common.vma(row_scale) | {axis_name})
  itemsize = jnp.dtype(x.dtype).itemsize
  out_types = [jax.ShapeDtypeStruct((tp * s, n), x.dtype),
               jax.ShapeDtypeStruct((tp * s, k), x.dtype)]
  y, rows = _group_call.call(
      _AG_OP, out_types,
      (x, w, group_sizes.astype(jnp.int32), token_index.astype(jnp.int32),
       row_scale.astype(jnp.float32)),
      axis_name, item_bytes=m * k * itemsize,  # this rank's token shard
      debug_skip_rank=debug_skip_rank, transpose_w=int(transpose_w),
      tile=_tile(tile, s / max(groups, 1), n))
  return _common.mark_varying(y, axes), _common.mark_varying(rows, axes)


def grouped_reduce_scatter(h, w, group_sizes, row_index, weights, axis_name: str, *,
                           transpose_w: bool, tile: str | None = None,
                           debug_skip_rank: int = -1):
  """(z [m, N], y_rows [s, N]) from the jaxflux_grouped_matmul_reduce_scatter target.

  h [tp*s, k] every segment's rows (this rank's K shard); w [G, k, N] ([G, N, k] with
  transpose_w); group_sizes [tp, G] int32, the same on every rank; row_index [m, topk] int32 and
  weights [m, topk] float32 for this rank's tokens. y_rows (this rank's segment, reduced over
  the ranks) is the router weights' gradient operand.
  """
  tp = lax.axis_size(axis_name)
  s = h.shape[0] // tp
  m = row_index.shape[0]
  groups = w.shape[0]
  n = w.shape[1] if transpose_w else w.shape[2]
  axes = (_common.vma(h) | _common.vma(w) | _common.vma(group_sizes) | _common.vma(row_index)
          | _common.vma(weights) | {axis_name})
  itemsize = jnp.dtype(h.dtype).itemsize
  out_types = [jax.ShapeDtypeStruct((m, n), h.dtype), jax.ShapeDtypeStruct((s, n), h.dtype)]
  z, y_rows = _group_call.call(
      _RS_OP, out_types,
      (h, w, group_sizes.astype(jnp.int32), row_index.astype(jnp.int32),
       weights.astype(jnp.float32)),
      axis_name, item_bytes=s * n * itemsize,  # one segment's partial
      debug_skip_rank=debug_skip_rank, transpose_w=int(transpose_w),
      tile=_tile(tile, s / max(groups, 1), n))
  return _common.mark_varying(z, axes), _common.mark_varying(y_rows, axes)


def reason(x, w, tp: int, axis_name: str) -> str | None:
  """Why the fused MoE kernels can't take these operands here, or None."""
  from jaxflux.ops import _grouped_kernel, _platform  # noqa: PLC0415 (keeps this module light)
  n_or_k = (w.shape[1], w.shape[2])
  return (_grouped_kernel.supported(x, w, x.dtype, *n_or_k)
          or _platform.platform_reason(axis_name)
          or _platform.group_reason(tp))

