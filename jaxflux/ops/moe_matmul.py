"""The tensor-parallel mixture-of-experts matmuls: AllGather+grouped GEMM (the expert MLP's first
matmul, column-parallel) and grouped GEMM+ReduceScatter with the top-k combine (its second,
row-parallel): FLUX's moe_ag_scatter and moe_gather_rs.

Per-device view inside `jax.shard_map` over the tensor-parallel axis (size tp). Tokens are
sequence-parallel (each rank holds m of them), expert weights are split over the ranks along
the intermediate dimension, and `moe_routing` (moe_routing.py) lays every rank's (token,
expert) pairs out as tp segments of s = m*topk rows, each sorted by expert:

  all_gather_grouped_matmul      x [m, K], w [G, K, n]  ->  y [tp*s, n]
      rows[p*s + j] = x of rank p [token_index[p, j]]
      y[segment p]  = rows[segment p] · w[g] for the rows of each expert g (group_sizes[p])
  grouped_matmul_reduce_scatter  h [tp*s, k], w [G, k, N], weights [m, topk]  ->  z [m, N]
      y_rows        = Σ over ranks of (h[segment r] · w[g] per group), r this rank
      z[t]          = Σ_k weights[t, k] · y_rows[row_index[t, k]]

so that, with an activation between them, grouped_matmul_reduce_scatter(act(
all_gather_grouped_matmul(x, w1)), w2) is each token's Σ_k weights[t, k] · MLP_{e_tk}(x[t]) for
the expert MLPs split column/row-parallel over the ranks. A segment holds one rank's tokens
only, so the fused kernels hide the communication of one segment behind the grouped GEMM of
another.

Backward (each op's is the other op, so one pair of fused kernels serves both passes):
  all_gather_grouped_matmul       dx = grouped GEMM+ReduceScatter of dy by wᵀ, unit weights
                                  dw = rowsᵀ·dy per expert, rows reordered expert-major
  grouped_matmul_reduce_scatter   dh = AllGather+grouped GEMM of dz by wᵀ, each row scaled by
                                       its pair's weight (the gathered dz rows: d_rows)
                                  dw = hᵀ·d_rows per expert; dweights[t, k] = dz[t]·y_rows[row]
The backward hands w over as is with transpose_w flipped (no transposed copy), and the weight
gradients are grouped GEMMs over all segments' rows in expert-major order
(`MoeRouting.expert_order`).

impl="xla" is the reference: `lax.all_gather` / `lax.psum_scatter` around
`grouped_matmul(impl="xla")` per segment. impl="fused" runs the fused kernels (_moe_fused;
at tp=1 the grouped GEMM kernel alone), bf16 or fp16 with fp32 accumulation, and raises
FusedKernelUnavailableError where they can't run; impl="auto" runs them where they can and the
tuning table's rule takes them (any tp: the reference multiplies with ragged_dot), else the
reference.
"""
from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxflux.ops import _common, _dispatch, _grouped_kernel, _moe_fused, _plan, all_gather
from jaxflux.ops.grouped_matmul import check_rows_and_weights, forced_tile, grouped_matmul
from jaxflux.ops.moe_routing import MoeRouting

_AG_OP = "all_gather_grouped_matmul"
_RS_OP = "grouped_matmul_reduce_scatter"
_F32 = jnp.dtype(jnp.float32)


class _Products(NamedTuple):
  """How an op's grouped GEMMs multiply, read where the op is called and held static through
  its custom_vjp: the kernel's tile (None: tuned per call; `override("grouped_matmul",
  tile=...)`) and the XLA path's `lax.Precision`."""
  tile: Any
  precision: Any


def all_gather_grouped_matmul(x, w, routing: MoeRouting, *, axis_name: str, impl: str = "auto",
                              transpose_w: bool = False, precision=None):
  """All-gathers every rank's tokens into expert-sorted segments and multiplies each row by its
  expert's weight (the first matmul of a tensor-parallel MoE MLP).

  Equivalent to: x_full = lax.all_gather(x, axis_name, tiled=True); for each segment p,
  rows_p = x_full[p*m + routing.token_index[p]] and y[p*s:(p+1)*s] =
  grouped_matmul(rows_p, w, routing.group_sizes[p]). Call it inside `jax.shard_map`.

  Args:
    x: [m, K] this rank's tokens.
    w: [G, K, n] this rank's column shard of every expert's weight ([G, n, K] with
      transpose_w).
    routing: `moe_routing(expert_ids, G, axis_name)` of the tokens' chosen experts.
    axis_name: the tensor-parallel mesh axis (size tp) that shards the tokens and w's n.
    impl: "auto" (the fused kernel where it runs, else XLA), "fused" (the fused kernel or
      FusedKernelUnavailableError saying why it can't run) or "xla" (the pure-JAX reference).
      The fused kernel takes bfloat16/float16 x and w of one dtype, K and n multiples of 8.
    transpose_w: w is given K-major, [G, n, K]; the op multiplies by each w[g]ᵀ in place. A
      static Python bool.
    precision: `lax.Precision` for the XLA path's products, forward and backward, as in
      `lax.ragged_dot` (the fused kernel always multiplies bf16/fp16 inputs with fp32
      accumulation).

  Returns:
    y [tp*s, n] in x.dtype, s = m*topk: segment p holds rank p's (token, expert) pairs sorted
    by expert; rows of pairs routed to no expert (ids outside [0, G)) are zeros.
  """
  _plan.refuse_forward_mode(_AG_OP, x, w)
  _plan.check_impl(_AG_OP, impl)
  transpose_w = _plan.static_bool(_AG_OP, "transpose_w", transpose_w)
  tp = _plan.axis_size(_AG_OP, axis_name)
  _check_operands(_AG_OP, "x", x, w, transpose_w)
  _check_routing(_AG_OP, routing, tp, w)
  if x.shape[0] != routing.row_index.shape[0]:
    raise ValueError(
        f"{_AG_OP}: x has {x.shape[0]} tokens (x.shape={x.shape}) but the routing was made for "
        f"{routing.row_index.shape[0]} (routing.row_index.shape={routing.row_index.shape}). "
        "Pass moe_routing of this rank's tokens' expert ids, one row per row of x.")
  kernel = _resolve(_AG_OP, impl, x, w, tp, axis_name)
  return _all_gather_grouped_matmul(x, w, routing, kernel, axis_name, transpose_w,
                                    _Products(forced_tile(), precision))


def grouped_matmul_reduce_scatter(h, w, routing: MoeRouting, weights, *, axis_name: str,
                                  impl: str = "auto", transpose_w: bool = False, precision=None):
  """Multiplies every segment's rows by their experts' weights, reduce-scatters the segments
  over the ranks and combines each of this rank's tokens' top-k rows with the router weights
  (the second matmul of a tensor-parallel MoE MLP).

  Equivalent to: partial[p] = grouped_matmul(h[p*s:(p+1)*s], w, routing.group_sizes[p]);
  y_rows = lax.psum_scatter(partial, axis_name, scatter_dimension=0) (this rank's segment,
  summed over the ranks' K shards); z[t] = Σ_k weights[t, k] · y_rows[routing.row_index[t, k]]
  in float32. Call it inside `jax.shard_map`.

  Args:
    h: [tp*s, k] every segment's rows (all_gather_grouped_matmul's layout), this rank's shard
      k of the contraction dimension.
    w: [G, k, N] this rank's row shard of every expert's weight ([G, N, k] with transpose_w).
    routing: the `moe_routing` the rows of h were laid out by.
    weights: [m, topk] floating, the router's combine weights of this rank's tokens (used in
      float32); the gradient w.r.t. them is returned in their dtype.
    axis_name: the tensor-parallel mesh axis (size tp) that shards k and the tokens.
    impl: "auto", "fused" or "xla", as for all_gather_grouped_matmul.
    transpose_w: w is given K-major, [G, N, k]. A static Python bool.
    precision: `lax.Precision` for the XLA path's products, as for all_gather_grouped_matmul.

  Returns:
    z [m, N] in h.dtype: this rank's tokens, summed over their top-k experts.
  """
  _plan.refuse_forward_mode(_RS_OP, h, w, weights)
  _plan.check_impl(_RS_OP, impl)
  transpose_w = _plan.static_bool(_RS_OP, "transpose_w", transpose_w)
  tp = _plan.axis_size(_RS_OP, axis_name)
  _check_operands(_RS_OP, "h", h, w, transpose_w)
  _check_routing(_RS_OP, routing, tp, w)
  s = routing.segment_rows
  if h.shape[0] != tp * s:
    raise ValueError(
        f"{_RS_OP}: h must hold tp*s = {tp}*{s} = {tp * s} rows (every segment of the routing: "
        f"tp={tp} ranks of s = m*topk = {s} rows); got h.shape={h.shape}. Pass the output of "
        "all_gather_grouped_matmul with the same routing (after the activation).")
  if jnp.shape(weights) != routing.row_index.shape:
    raise ValueError(
        f"{_RS_OP}: weights must have shape [m, topk] = {routing.row_index.shape}, one combine "
        f"weight per (token, expert) pair of this rank, like the expert ids the routing was made "
        f"from; got shape {jnp.shape(weights)}.")
  if not jnp.issubdtype(weights.dtype, jnp.floating):
    raise TypeError(f"{_RS_OP}: weights must be a floating-point array (router combine "
                    f"weights); got dtype {weights.dtype}. Pass weights.astype(jnp.float32).")
  kernel = _resolve(_RS_OP, impl, h, w, tp, axis_name)
  return _grouped_matmul_reduce_scatter(h, w, weights, routing, kernel, axis_name, transpose_w,
                                        _Products(forced_tile(), precision))


# --- the forward of each op, per kernel ---------------------------------------------------------

def _ag_forward(kernel, x, w, group_sizes, token_index, row_scale, axis_name, transpose_w,
                products):
  """(y [tp*s, n], rows [tp*s, K]): rows[p*s + j] = row_scale[p, j] · x of rank p
  [token_index[p, j]] in x.dtype (a zero row for an index outside [0, m); row_scale None: 1),
  y[segment p] = rows[segment p] · w[g] per expert group of group_sizes[p]. products: how the
  grouped GEMMs multiply (_Products)."""
  tp = lax.axis_size(axis_name)
  if kernel == "fused" and tp > 1:
    if row_scale is None:
      row_scale = jnp.ones(token_index.shape, jnp.float32)
    return _moe_fused.all_gather_grouped(x, w, group_sizes, token_index, row_scale, axis_name,
                                         transpose_w=transpose_w, tile=products.tile)
  m = x.shape[0]
  s = token_index.shape[1]
  x_full = lax.all_gather(_common.mark_varying(x, {axis_name}), axis_name, tiled=True)
  valid = ((token_index >= 0) & (token_index < m)).reshape(-1, 1)
  first = jnp.arange(tp, dtype=jnp.int32)[:, None] * m
  rows = jnp.take(x_full, (first + jnp.clip(token_index, 0, m - 1)).reshape(-1), axis=0)
  if row_scale is not None:
    acc = jnp.promote_types(x.dtype, _F32)
    rows = rows.astype(acc) * row_scale.reshape(-1, 1).astype(acc)
  rows = jnp.where(valid, rows, 0).astype(x.dtype)
  y = jnp.concatenate([_segment_matmul(kernel, rows[p * s:(p + 1) * s], w, group_sizes[p],
                                       transpose_w, products) for p in range(tp)])
  axes = _axes(axis_name, x, w, group_sizes, token_index, row_scale)
  return _common.mark_varying(y, axes), _common.mark_varying(rows, axes)


def _rs_forward(kernel, h, w, group_sizes, row_index, weights, axis_name, transpose_w,
                products):
  """(z [m, N], y_rows [s, N]): y_rows = Σ over ranks of h[segment r] · w[g] per expert group,
  r this rank; z[t] = Σ_k weights[t, k] · y_rows[row_index[t, k]] in float32, in h.dtype (an
  index outside [0, s) adds nothing)."""
  tp = lax.axis_size(axis_name)
  if kernel == "fused" and tp > 1:
    return _moe_fused.grouped_reduce_scatter(h, w, group_sizes, row_index, weights, axis_name,
                                             transpose_w=transpose_w, tile=products.tile)
  s = h.shape[0] // tp
  partials = jnp.stack([_segment_matmul(kernel, h[p * s:(p + 1) * s], w, group_sizes[p],
                                        transpose_w, products) for p in range(tp)])
  y_rows = lax.psum_scatter(_common.mark_varying(partials, {axis_name}), axis_name,
                            scatter_dimension=0, tiled=False)
  acc = jnp.promote_types(h.dtype, _F32)
  picked, valid = _pick_rows(y_rows, row_index)
  # Elementwise products summed over k: float32 throughout (a dot could run in TF32 on GPUs).
  scale = jnp.where(valid, weights.astype(acc), 0)
  z = jnp.sum(picked.astype(acc) * scale[..., None], axis=1).astype(h.dtype)
  axes = _axes(axis_name, h, w, group_sizes, row_index, weights)
  return _common.mark_varying(z, axes), _common.mark_varying(y_rows, axes)


def _segment_matmul(kernel, rows, w, group_sizes, transpose_w, products):
  """One segment's grouped GEMM in the rows' dtype: the kernel (the fused ops at tp=1), or the
  reference accumulating in float32 at least."""
  if kernel == "fused":
    return _grouped_kernel.grouped_matmul(rows, w, group_sizes, transpose_w, products.tile)
  acc = jnp.promote_types(jnp.result_type(rows.dtype, w.dtype), _F32)
  return grouped_matmul(rows, w, group_sizes, impl="xla", transpose_w=transpose_w,
                        preferred_element_type=acc,
                        precision=products.precision).astype(rows.dtype)


def _pick_rows(y_rows, row_index):
  """(y_rows[row_index] [m, topk, N], valid [m, topk]): each pair's row; an index outside
  [0, s) picks row 0 and is marked invalid."""
  s = y_rows.shape[0]
  valid = (row_index >= 0) & (row_index < s)
  return jnp.take(y_rows, jnp.clip(row_index, 0, max(s - 1, 0)), axis=0), valid


def _axes(axis_name, *operands) -> frozenset:
  """What the results vary along: the mesh axis, and every axis an operand varies along."""
  axes = {axis_name}
  for a in operands:
    if a is not None:
      axes |= _common.vma(a)
  return frozenset(axes)


# --- the custom_vjps --------------------------------------------------------------------------

@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _all_gather_grouped_matmul(x, w, routing, kernel, axis_name, transpose_w, products):
  return _ag_forward(kernel, x, w, routing.group_sizes, routing.token_index, None, axis_name,
                     transpose_w, products)[0]


def _ag_fwd(x, w, routing, kernel, axis_name, transpose_w, products):
  _plan.refuse_forward_mode(_AG_OP, x, w)  # forward-over-reverse (jax.hessian) lands here
  y, rows = _ag_forward(kernel, x, w, routing.group_sizes, routing.token_index, None, axis_name,
                        transpose_w, products)
  # x itself is kept only for its type (varying mesh axes); rows carry the values.
  return y, (x, w, routing, rows)


def _ag_bwd(kernel, axis_name, transpose_w, products, residuals, dy):
  x, w, routing, rows = residuals
  dy = dy.astype(x.dtype)
  # dx: dy · w[g]ᵀ per segment, reduce-scattered, each token's top-k rows summed: the
  # partner's forward with unit weights and w read in the other layout.
  ones = jnp.ones(routing.row_index.shape, jnp.float32)
  dx, _ = _rs_forward(kernel, dy, w, routing.group_sizes, routing.row_index, ones, axis_name,
                      not transpose_w, products)
  dw = _weight_grad(kernel, rows, dy, w, routing, transpose_w, products)
  return (_common.match_vma(dx.astype(x.dtype), x), _common.match_vma(dw, w),
          _no_cotangent(routing))


_all_gather_grouped_matmul.defvjp(_ag_fwd, _ag_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _grouped_matmul_reduce_scatter(h, w, weights, routing, kernel, axis_name, transpose_w,
                                   products):
  return _rs_forward(kernel, h, w, routing.group_sizes, routing.row_index, weights, axis_name,
                     transpose_w, products)[0]


def _rs_fwd(h, w, weights, routing, kernel, axis_name, transpose_w, products):
  _plan.refuse_forward_mode(_RS_OP, h, w, weights)
  z, y_rows = _rs_forward(kernel, h, w, routing.group_sizes, routing.row_index, weights,
                          axis_name, transpose_w, products)
  return z, (h, w, weights, routing, y_rows)


def _rs_bwd(kernel, axis_name, transpose_w, products, residuals, dz):
  h, w, weights, routing, y_rows = residuals
  # dweights[t, k] = dz[t] · y_rows[row_index[t, k]], in float32.
  picked, valid = _pick_rows(y_rows, routing.row_index)
  acc = jnp.promote_types(h.dtype, _F32)
  dweights = jnp.sum(picked.astype(acc) * dz.astype(acc)[:, None, :], axis=-1)
  dweights = jnp.where(valid, dweights, 0).astype(weights.dtype)
  # dh: every rank's dz gathered into its segment's rows, each scaled by its pair's weight,
  # times w[g]ᵀ: the partner's forward with w read in the other layout.
  tp = lax.axis_size(axis_name)
  weights_all = _gather_weights(kernel, weights, axis_name).reshape(tp, -1)
  row_scale = jnp.take_along_axis(weights_all, routing.pair_index, axis=1)
  dh, d_rows = _ag_forward(kernel, dz.astype(h.dtype), w, routing.group_sizes,
                           routing.token_index, row_scale, axis_name, not transpose_w, products)
  dw = _weight_grad(kernel, h, d_rows, w, routing, transpose_w, products)
  return (_common.match_vma(dh.astype(h.dtype), h), _common.match_vma(dw, w),
          _common.match_vma(dweights, weights), _no_cotangent(routing))


_grouped_matmul_reduce_scatter.defvjp(_rs_fwd, _rs_bwd)


def _gather_weights(kernel, weights, axis_name):
  """Every rank's combine weights [tp*m, topk] (float32): with the fused kernels through the
  copy-engine all-gather, so that a fused program has no XLA collective."""
  weights = _common.mark_varying(weights.astype(jnp.float32), {axis_name})
  if kernel == "fused" and lax.axis_size(axis_name) > 1:
    return _common.mark_varying(all_gather.all_gather(weights, axis_name, impl="fused"),
                                _common.vma(weights))
  return lax.all_gather(weights, axis_name, tiled=True)


def _weight_grad(kernel, a, d, w, routing, transpose_w, products):
  """dw[g] = Σ over every segment's rows i of expert g: a[i]ᵀ · d[i] (a [tp*s, K], d [tp*s, n]),
  laid out like w: the weight cotangent of one grouped GEMM over the rows in expert-major
  order (rows routed to no expert sort last, past every group)."""
  a = jnp.take(a, routing.expert_order, axis=0)
  d = jnp.take(d, routing.expert_order, axis=0)
  sizes = jnp.sum(routing.group_sizes, axis=0)

  def forward(w):
    if kernel == "fused":
      return _grouped_kernel.grouped_matmul(a, w, sizes.astype(jnp.int32), transpose_w,
                                            products.tile)
    return grouped_matmul(a, w, sizes, impl="xla", transpose_w=transpose_w,
                          precision=products.precision)

  y, vjp = jax.vjp(forward, w)
  (dw,) = vjp(d.astype(y.dtype))
  return dw.astype(w.dtype)


def _no_cotangent(routing):
  """The routing's (integer arrays') cotangent: float0 zeros."""
  return type(routing)(*(np.zeros(a.shape, jax.dtypes.float0) for a in routing))


# --- checks -----------------------------------------------------------------------------------

def _resolve(op: str, impl: str, x, w, tp: int, axis_name: str) -> str:
  """"fused" or "xla", once per call, by the rule every op family shares (ops/_dispatch.py)."""
  return _dispatch.decide(op, impl, lambda: _moe_fused.reason(x, w, tp, axis_name), tp=tp,
                          rows=x.shape[0], k=x.shape[1], fix="")


def _check_operands(op: str, name: str, x, w, transpose_w: bool) -> None:
  """Ranks, contraction size and dtypes of the rows operand `name` [rows, K] and w [G, K, N]
  ([G, N, K] with transpose_w)."""
  check_rows_and_weights(op, name, x, w, transpose_w, x_layout="[rows, K]",
                         w_holds="one weight shard per expert",
                         w_rank_fix="Stack the experts' weights along axis 0.")
  for arg, a in ((name, x), ("w", w)):
    if _common.is_narrow_float(a.dtype):
      raise TypeError(f"{op}: {arg}.dtype={a.dtype}: FP8 (1-byte float) operands are not "
                      f"supported (no scales). Dequantize {arg} to bfloat16 or float32.")


def _check_routing(op: str, routing, tp: int, w) -> None:
  """The routing is a MoeRouting of consistent shapes for tp ranks and w's G experts."""
  if not isinstance(routing, MoeRouting):
    raise TypeError(f"{op}: routing must be the MoeRouting of moe_routing(expert_ids, "
                    f"num_experts, axis_name); got {type(routing).__name__}.")
  for field, a in zip(routing._fields, routing):
    if not hasattr(a, "dtype") or not jnp.issubdtype(a.dtype, jnp.integer):
      raise TypeError(f"{op}: routing.{field} must be an integer array; got "
                      f"{getattr(a, 'dtype', type(a).__name__)}. Build the routing with "
                      "moe_routing.")
  sizes = routing.group_sizes.shape
  if len(sizes) != 2 or sizes[0] != tp:
    raise ValueError(f"{op}: routing.group_sizes has shape {sizes}, but the mesh axis has tp="
                     f"{tp} ranks: it must be [tp, G]. Make the routing with moe_routing over "
                     "the same axis_name.")
  if w.shape[0] != sizes[1]:
    raise ValueError(f"{op}: w has G={w.shape[0]} experts (w.shape={w.shape}) but the routing "
                     f"counts rows for {sizes[1]} (routing.group_sizes.shape={sizes}). Pass "
                     f"num_experts={w.shape[0]} to moe_routing, or every expert's weight shard "
                     "in w.")
  if jnp.ndim(routing.row_index) != 2:
    raise ValueError(f"{op}: routing.row_index must be [m, topk]; got shape "
                     f"{routing.row_index.shape}. Build the routing with moe_routing.")
  m, topk = routing.row_index.shape
  s = m * topk
  want = {"pair_index": (tp, s), "expert_order": (tp * s,)}
  for field, shape in want.items():
    got = getattr(routing, field).shape
    if got != shape:
      raise ValueError(f"{op}: routing.{field} has shape {got}; with routing.row_index "
                       f"[m, topk] = {routing.row_index.shape} and tp={tp} it must be {shape}. "
                       "Build the routing with moe_routing.")
