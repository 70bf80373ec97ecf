"""The mixture-of-experts MLP shared by `jaxflux.MoE` (Linen) and `jaxflux.nnx.MoE` (NNX).

Shapes (T tokens, H hidden, E experts, k experts per token, I intermediate size per expert):

  x [..., H]   gate [H, E]   wi_0, wi_1 (swiglu) or wi (gelu) [E, H, I]   wo [E, I, H]

Each token's router probabilities (softmax of float32 logits) pick its top k experts. Each of
the T * k (token, expert) pairs is a row; sorted by expert, the rows go through the expert MLP
as two grouped matmuls (`jaxflux.grouped_matmul`), come back in token order, and are weighted
by the routing weights and summed over the k experts.

Under a mesh, the mesh axes that wi's partitioning puts its expert dimension on (expert
parallelism) and its intermediate dimension on (expert tensor parallelism) split the expert
MLP, in a shard_map manual over those axes and the mesh's Explicit axes. Each device routes its
own tokens, multiplies by its own slice of the experts only, and the partial outputs are summed
over those axes (all-reduce). Where such an axis also shards the tokens, the tokens are
all-gathered over it after routing and the outputs reduce-scattered back, with two exceptions:
where one axis alone splits the intermediate dimension and the tokens (tensor parallelism with
sequence-parallel tokens), that gather, the grouped matmuls and the reduce-scatter are the
fused MoE ops (`all_gather_grouped_matmul`, `grouped_matmul_reduce_scatter`); where one axis
alone splits the experts and the tokens (expert parallelism), each (token, expert) row goes to
its expert's device and back by a ragged all-to-all (`expert_parallel_experts`). Otherwise a device
keeps all T * k rows of the tokens it sees, the static worst case: rows routed to other
devices' experts sort past its groups, where grouped_matmul gives zeros.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

from jaxflux.layers import _layer_mesh as lm
from jaxflux.ops import (_fused_sum, all_gather_grouped_matmul, grouped_matmul,
                         grouped_matmul_reduce_scatter, moe_routing)
from jaxflux.ops._ragged_exchange import ragged_all_to_all
from jaxflux.ops.moe_routing import sort_by_expert

ACTIVATIONS = ("swiglu", "gelu")
IMPLS = lm.IMPLS
# MaxText's logical names: the router kernel [H, E], the expert kernels [E, H, I] and [E, I, H].
GATE_AXES = ("embed", None)
WI_AXES = ("exp", "embed", "mlp")
WO_AXES = ("exp", "mlp", "embed")
# Fan-in scaling per expert: the expert dimension is a batch dimension of the initializer.
default_kernel_init = jax.nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
default_router_init = jax.nn.initializers.lecun_normal()


def expert_param_names(activation: str) -> tuple[str, ...]:
  """The input-projection params: gate and up projections for swiglu, one for gelu."""
  return ("wi_0", "wi_1") if activation == "swiglu" else ("wi",)


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def check_config(layer: str, *, num_experts, num_experts_per_tok, intermediate_size, activation,
                 norm_topk_prob, dtype, impl, gate_axes, wi_axes, wo_axes) -> None:
  """Checks the static options; raises ValueError naming the argument and the fix."""
  for name, value in (("num_experts", num_experts), ("intermediate_size", intermediate_size)):
    if not _is_int(value) or value < 1:
      raise ValueError(f"{layer}: {name}={value!r} must be a positive int.")
  k = num_experts_per_tok
  if not _is_int(k) or not 1 <= k <= num_experts:
    raise ValueError(
      f"{layer}: num_experts_per_tok={k!r} must be an int from 1 to num_experts="
      f"{num_experts}: each token is routed to that many distinct experts.")
  if activation not in ACTIVATIONS:
    raise ValueError(
      f"{layer}: activation={activation!r} is not one of {ACTIVATIONS}: 'swiglu' "
      "(silu(x @ wi_0) * (x @ wi_1)) or 'gelu' (gelu(x @ wi)).")
  if norm_topk_prob is not None and not isinstance(norm_topk_prob, bool):
    raise ValueError(f"{layer}: norm_topk_prob={norm_topk_prob!r} must be a bool, or None "
                     "(renormalize when num_experts_per_tok > 1).")
  if norm_topk_prob and k == 1:
    warnings.warn(
      f"{layer}: norm_topk_prob=True with num_experts_per_tok=1 makes every routing weight 1, "
      "so the router gets no gradient from the task loss (only from the load-balancing "
      "loss). Leave norm_topk_prob=None (the default) or pass False to weight each token's "
      "expert by its router probability, as the Switch Transformer does.", stacklevel=3)
  if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
      f"{layer}: dtype={dtype!r} is not a floating dtype. Pass e.g. jnp.bfloat16, or None "
      "for the promoted dtype of the input and the params.")
  if impl not in IMPLS:
    raise ValueError(f"{layer}: impl={impl!r} is not one of {IMPLS}.")
  for name, axes, params in (("gate_axes", gate_axes, "gate [hidden, num_experts]"),
                             ("wi_axes", wi_axes, "wi [num_experts, hidden, intermediate]"),
                             ("wo_axes", wo_axes, "wo [num_experts, intermediate, hidden]")):
    rank = params.count(",") + 1
    if (not isinstance(axes, (tuple, list)) or len(axes) != rank
        or not all(a is None or isinstance(a, str) for a in axes)):
      raise ValueError(
        f"{layer}: {name}={axes!r} must be a tuple of {rank} logical axis names (str or "
        f"None), one per dimension of {params}.")


def check_hidden(layer: str, x, hidden: int | None) -> int:
  """The input is a floating [..., hidden] array (any hidden when None); returns its hidden."""
  if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(
      f"{layer}: the input must be a floating-point array [..., hidden]; got dtype "
      f"{getattr(x, 'dtype', type(x).__name__)}. Cast it (token ids go through an embedding "
      "first).")
  if jnp.ndim(x) < 1:
    raise ValueError(f"{layer}: the input must be [..., hidden]; got a scalar.")
  if hidden is not None and x.shape[-1] != hidden:
    raise ValueError(
      f"{layer}: the input has shape {x.shape}, but the layer's hidden size (the last "
      f"dimension of its input, the first of its gate kernel) is {hidden}. Pass "
      f"[..., {hidden}] inputs, or build the layer for this hidden size.")
  return x.shape[-1]


@dataclasses.dataclass(frozen=True)
class _Plan:
  """How the expert MLP splits over the mesh (module docstring)."""
  manual: frozenset        # the shard_map's manual axes
  explicit: frozenset      # the mesh's Explicit axes
  lead: tuple              # per leading (token) dimension of x, its Explicit axes
  experts: tuple           # mesh axes of the expert dimension
  mlp: tuple               # mesh axes of the intermediate dimension
  tokens: tuple            # the Explicit axes sharding the tokens
  gather: tuple            # axes sharding both the tokens and the experts' work
  reduce: tuple            # axes sharding the experts' work only

  @property
  def tensor_parallel_axis(self) -> str | None:
    """The one axis that splits the experts' intermediate dimension and the tokens (and nothing
    else splits the experts): the split the fused MoE ops run. None for any other split."""
    if not self.experts and len(self.mlp) == 1 and self.gather == self.mlp and not self.reduce:
      return self.mlp[0]
    return None

  @property
  def expert_parallel_axis(self) -> str | None:
    """The one axis that splits the experts and the tokens (and nothing splits the intermediate
    dimension): the split whose rows go to their experts' devices (an all-to-all dispatch).
    None for any other split."""
    if len(self.experts) == 1 and not self.mlp and self.gather == self.experts and not self.reduce:
      return self.experts[0]
    return None


def check_split(layer: str, mesh, wi_spec, num_experts: int, intermediate: int) -> tuple:
  """The mesh axes of wi's expert and intermediate dimensions, checked: axes of the mesh, not
  manual, and an even split. Called before the params are made, where an uneven split fails
  less clearly."""
  if mesh.empty:
    return (), ()
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  spec = tuple(wi_spec or ()) + (None,) * 3
  split = (("num_experts", lm.axes(spec[0]), num_experts, 0),
           ("intermediate_size", lm.axes(spec[2]), intermediate, 2))
  for what, axes, size, dim in split:
    for axis in axes:
      if axis not in types:
        raise ValueError(
          f"{layer}: the partitioning of wi (wi_axes[{dim}] through the logical axis rules) "
          f"names mesh axis {axis!r}, which the mesh {tuple(mesh.axis_names)} lacks. Map "
          "the logical axis to an axis of the mesh.")
      if types[axis] == AxisType.Manual:
        raise ValueError(
          f"{layer}: mesh axis {axis!r}, which the partitioning of wi (wi_axes[{dim}]) names, "
          "is manual here (the layer is called inside a shard_map over it). Call the layer "
          "outside the shard_map, or map that logical axis to no mesh axis.")
    n = math.prod(mesh.shape[a] for a in axes)
    if size % n:
      raise ValueError(
        f"{layer}: {what}={size} is not divisible by {n}, the size of mesh axes {axes} that "
        f"wi_axes[{dim}] maps to through the logical axis rules. Pick {what} as a multiple of "
        "it, or map that logical axis to fewer mesh axes.")
  return split[0][1], split[1][1]


def _plan(layer: str, mesh, x, wi_spec, num_experts: int, intermediate: int) -> _Plan | None:
  """The split of the expert MLP over `mesh` (None: no shard_map needed)."""
  if mesh.empty:
    return None
  experts, mlp = check_split(layer, mesh, wi_spec, num_experts, intermediate)
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  explicit = frozenset(a for a, t in types.items() if t == AxisType.Explicit)
  manual = explicit | set(experts) | set(mlp)
  if not manual:
    return None
  lead = tuple(tuple(a for a in d if a in explicit) for d in lm.type_dims(x)[:-1])
  tokens = [a for d in lead for a in d]
  gather = tuple(a for a in tokens if a in experts + mlp)
  reduce = tuple(a for a in experts + mlp if a not in gather)
  return _Plan(frozenset(manual), explicit, lead, experts, mlp, tuple(tokens), gather,
               reduce)


def renormalizes(norm_topk_prob: bool | None, num_experts_per_tok: int) -> bool:
  """Whether the top-k probabilities are renormalized to sum to 1. None: when k > 1 (Mixtral,
  Qwen3); at k = 1 the weight stays the router probability (Switch Transformer): renormalized it
  would be 1 and give the router no gradient."""
  return num_experts_per_tok > 1 if norm_topk_prob is None else norm_topk_prob


def route(x, gate, num_experts_per_tok: int, norm_topk_prob: bool | None, precision):
  """Top-k routing of the rows of x [R, H] in float32: weights [R, k], experts [R, k] (int32),
  and the sums over the rows that the load-balancing loss takes (`load_balancing_loss`):
  (token, expert) pairs per expert [E] and router probabilities per expert [E]."""
  logits = jnp.dot(x.astype(jnp.float32), gate.astype(jnp.float32), precision=precision)
  probs = jax.nn.softmax(logits, axis=-1)
  weights, experts = lax.top_k(probs, num_experts_per_tok)
  if renormalizes(norm_topk_prob, num_experts_per_tok):
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  pairs = jnp.sum(jax.nn.one_hot(experts, gate.shape[1], dtype=jnp.float32), axis=(0, 1))
  return weights, experts, pairs, jnp.sum(probs, axis=0)


def load_balancing_loss(pairs, probs, tokens: int, num_experts_per_tok: int):
  """Switch Transformer's E * sum_e f_e * P_e: f_e the fraction of the T * k (token, expert)
  pairs routed to expert e, P_e the mean router probability of e, from `route`'s sums over all
  T tokens. 1 when both are uniform, up to E when one expert takes everything; only P_e has a
  gradient."""
  tokens = max(tokens, 1)
  return pairs.shape[0] * jnp.sum(pairs / (tokens * num_experts_per_tok) * probs / tokens)


def expert_mlp(x, weights, experts, wi, wo, *, activation: str, impl: str, precision, dtype):
  """sum_j weights[t, j] * MLP_{experts[t, j]}(x[t]) for rows t: x [R, H], weights (float32) and
  experts [R, k], wi (one or two) [E, H, I], wo [E, I, H] -> [R, H] in dtype.

  Expert ids outside [0, E) (another device's experts) contribute nothing: their rows sort
  after every group, where grouped_matmul gives zeros (and zero gradients).
  """
  rows, k = experts.shape
  sizes, order, places, _ = sort_by_expert(experts.reshape(1, -1), wo.shape[0])
  xs = jnp.take(x, order[0] // k, axis=0)
  matmul = functools.partial(grouped_matmul, group_sizes=sizes[0], impl=impl,
                             precision=precision)
  ys = matmul(_activation(activation, [matmul(xs, w) for w in wi]), wo)
  # Back to (token, expert) order: each pair's sorted place.
  pairs = jnp.take(ys, places[0], axis=0).reshape(rows, k, ys.shape[-1])
  # The weighted sum in float32, like the routing weights; one rounding to dtype at the end.
  y = jnp.einsum("rkh,rk->rh", pairs.astype(jnp.float32), weights, precision=precision)
  return y.astype(dtype)


def _activation(activation: str, h: list):
  """The expert MLP's activation of its first matmul(s): swiglu's two, gelu's one."""
  if activation == "swiglu":
    return jax.nn.silu(h[0]) * h[1]
  return jax.nn.gelu(h[0])


def expert_parallel_experts(x, weights, experts, wi, wo, *, axis: str, activation: str,
                            impl: str, precision, dtype):
  """expert_mlp for this device's tokens with the experts split over `axis` and the tokens too:
  each (token, expert) pair's row goes to its expert's device (a ragged all-to-all), through
  that device's experts, and back (a second one), then the top k are combined here. Dropless:
  each device keeps a slot of m*k rows per sender, the static worst case; on GPUs only the
  rows sent travel (jaxflux.ops._ragged_exchange). x [m, H], weights (float32) and experts
  [m, k] (global ids) -> [m, H]."""
  ranks, local = lax.axis_size(axis), wo.shape[0]
  m, k = experts.shape
  pairs = m * k
  flat = experts.reshape(-1)
  valid = (flat >= 0) & (flat < ranks * local)
  dest = jnp.where(valid, flat // local, ranks)  # ranks: routed nowhere, sent nowhere
  # The pairs sorted by destination (the expert sort, with devices for experts): device p's
  # rows are sorted[starts[p] : starts[p] + sizes[p]], the pairs routed nowhere last.
  sizes, order, sorted_place, _ = (a[0] for a in sort_by_expert(dest[None], ranks))
  starts = jnp.cumsum(sizes) - sizes
  rows = jnp.take(x.astype(dtype), order // k, axis=0)
  ids = jnp.take(flat - dest * local, order).astype(jnp.int32)  # the receiver's local expert
  # Sender p's rows land in slot p (rows p*pairs onward) of each receiver; unused places hold
  # zeros and `local` (no expert), which the experts skip.
  received = lax.all_to_all(sizes, axis, 0, 0, tiled=True)  # [p]: rows p sends here
  slots = jnp.arange(ranks, dtype=jnp.int32) * pairs
  mine = jnp.broadcast_to(lax.axis_index(axis).astype(jnp.int32) * pairs, (ranks,))
  exchange = functools.partial(ragged_all_to_all, input_offsets=starts, send_sizes=sizes,
                               output_offsets=mine, recv_sizes=received, axis=axis)
  recv = exchange(rows, jnp.zeros((ranks * pairs, x.shape[-1]), dtype))
  recv_ids = exchange(ids, jnp.full((ranks * pairs,), local, jnp.int32))
  ones = jnp.ones((ranks * pairs, 1), jnp.float32)
  done = expert_mlp(recv, ones, recv_ids[:, None], wi, wo, activation=activation, impl=impl,
                    precision=precision, dtype=dtype)
  # Back to each sender's destination-sorted order: slot p's rows to device p, where this
  # device's rows started (a pair routed nowhere reads a zero).
  back = ragged_all_to_all(done, jnp.zeros((pairs, done.shape[-1]), done.dtype), slots,
                           received, lax.all_to_all(starts, axis, 0, 0, tiled=True), sizes,
                           axis=axis)
  # Each pair's row, weighted and summed over its top k in float32, like expert_mlp.
  picked = jnp.take(back, sorted_place, axis=0).reshape(m, k, -1)
  y = jnp.einsum("mkh,mk->mh", picked.astype(jnp.float32), weights, precision=precision)
  return y.astype(dtype)


def tensor_parallel_experts(x, weights, experts, wi, wo, *, axis: str, activation: str,
                            impl: str, precision, dtype):
  """expert_mlp for this device's tokens, sequence-parallel over `axis`, with every expert's
  intermediate dimension split over it: the fused MoE ops (all_gather_grouped_matmul ->
  activation -> grouped_matmul_reduce_scatter, which gathers the tokens, multiplies, sums over
  the intermediate shards, scatters back and combines the top k in one pass), with no XLA
  collective on the tokens' path. x [m, H], weights (float32) and experts [m, k] -> [m, H]."""
  # impl="fused": the ids too go through jaxflux's all-gather (no XLA collective on this path).
  routing = moe_routing(experts, wo.shape[0], axis, impl="fused" if impl == "fused" else "xla")
  x = x.astype(dtype)
  h = _activation(activation, [all_gather_grouped_matmul(x, w, routing, axis_name=axis, impl=impl,
                                                         precision=precision) for w in wi])
  return grouped_matmul_reduce_scatter(h, wo, routing, weights, axis_name=axis, impl=impl,
                                       precision=precision)


def moe_mlp(layer: str, x, gate, wi: tuple, wo, *, num_experts_per_tok: int,
            norm_topk_prob: bool | None, activation: str, impl: str, precision, dtype,
            wi_spec):
  """The MoE MLP on x [..., H] (global view): (y [..., H] in the compute dtype, the
  load-balancing loss, the expert load: float32 [E], the (token, expert) pairs routed to each
  expert over all tokens).

  Args:
    gate, wi, wo: the params (module docstring), laid out as stored.
    dtype: the compute dtype; None: promoted from x and the expert params.
    wi_spec: wi's partitioning as mesh axes (a PartitionSpec, or None: unsharded); its expert
      and intermediate dimensions decide the split over the ambient mesh.
  """
  hidden, num_experts = gate.shape
  check_hidden(layer, x, hidden)
  intermediate = wo.shape[1]
  want = {**{f"wi[{i}]": (w, (num_experts, hidden, intermediate)) for i, w in enumerate(wi)},
          "wo": (wo, (num_experts, intermediate, hidden))}
  for name, (w, shape) in want.items():
    if w.shape != shape:
      raise ValueError(f"{layer}: param {name} has shape {w.shape}; with gate {gate.shape} "
                       f"and wo {wo.shape} it must be {shape}.")
  if dtype is None:
    dtype = jnp.result_type(x.dtype, *(w.dtype for w in wi), wo.dtype)
  k = num_experts_per_tok
  plan = _plan(layer, jax.sharding.get_abstract_mesh(), x, wi_spec, num_experts, intermediate)
  run_experts = functools.partial(expert_mlp, activation=activation, impl=impl,
                                  precision=precision, dtype=dtype)

  # On the fused tensor-parallel path the router's gradient and the load-balancing sums over
  # the tokens' axis go through jaxflux's all-gather too: that axis then has no XLA collective.
  fused_axis = plan.tensor_parallel_axis if plan and impl == "fused" else None

  def local(x, gate, *params):
    """The layer on this device's tokens and experts (all of them without a plan)."""
    *wi, wo = params
    lead = x.shape[:-1]
    x = x.reshape(-1, hidden)
    if fused_axis:
      gate = _fused_sum.broadcast(gate, fused_axis)
    weights, experts, pairs, probs = route(x, gate, k, norm_topk_prob, precision)
    if plan and plan.tokens:
      if fused_axis in plan.tokens:
        pairs, probs = (_fused_sum.psum(a, fused_axis) for a in (pairs, probs))
      others = tuple(a for a in plan.tokens if a != fused_axis)
      if others:
        pairs, probs = lax.psum((pairs, probs), others)
    if plan and (plan.tensor_parallel_axis or plan.expert_parallel_axis):
      split = (tensor_parallel_experts if plan.tensor_parallel_axis else expert_parallel_experts)
      y = split(x, weights, experts, tuple(wi), wo, activation=activation, impl=impl,
                precision=precision, dtype=dtype,
                axis=plan.tensor_parallel_axis or plan.expert_parallel_axis)
      return y.reshape(*lead, hidden), pairs, probs
    rows = [x.astype(dtype), weights, experts]
    if plan and plan.gather:
      rows = [lax.all_gather(a, plan.gather, axis=0, tiled=True) for a in rows]
    x, weights, experts = rows
    if plan and plan.experts:  # This device has experts [first, first + E_local).
      experts = experts - lax.axis_index(plan.experts) * wo.shape[0]
    y = run_experts(x, weights, experts, tuple(wi), wo)
    if plan and plan.reduce:
      y = lax.psum(y, plan.reduce)
    if plan and plan.gather:
      y = lax.psum_scatter(y, plan.gather, scatter_dimension=0, tiled=True)
    return y.reshape(*lead, hidden), pairs, probs

  # Cast before any resharding: the gathers move the compute dtype.
  params = [*(w.astype(dtype) for w in wi), wo.astype(dtype)]
  if plan is None:
    y, pairs, probs = local(x, gate, *params)
  else:
    token_dims = (*plan.lead, ())
    dims = [token_dims, ((), ())] + [(plan.experts, (), plan.mlp)] * len(wi)
    dims.append((plan.experts, plan.mlp, ()))
    mesh = jax.sharding.get_abstract_mesh()
    args = [lm.reshard(a, lm.spec(d, plan.explicit), mesh)
            for a, d in zip([x, gate, *params], dims)]
    spec = lambda d: lm.spec(d, plan.manual)
    y, pairs, probs = jax.shard_map(
      local, in_specs=tuple(map(spec, dims)), out_specs=(spec(token_dims), P(), P()),
      axis_names=set(plan.manual))(*args)
  return y, load_balancing_loss(pairs, probs, math.prod(x.shape[:-1]), k), pairs
