"""The routing of the tensor-parallel MoE ops (moe_matmul.py): where each (token, expert) pair
of every rank's tokens sits in the rows those ops multiply.

Per-device view inside `jax.shard_map` over the tensor-parallel axis (size tp); tokens are
sequence-parallel, each rank holds m of them and has chosen topk experts for each:

  expert_ids [m, topk]      this rank's tokens' experts; pair q = t*topk + k is (token t, k)
  s = m*topk                rows per segment: segment p holds rank p's pairs, sorted by expert
  group_sizes [tp, G]       segment p's rows per expert
  pair_index [tp, s]        the pair at segment p's sorted row j (token pair_index // topk)
  row_index [m, topk]       the row of this rank's pair (t, k) within this rank's segment
  expert_order [tp*s]       all segments' rows (row p*s + j) in expert-major order: expert 0's
                            rows of segment 0, of segment 1, ..., then expert 1's, ...

Every rank computes the same group_sizes, pair_index and expert_order (from the all-gathered
expert ids); row_index is its own. Expert ids outside [0, G) count in no group and sort after
every expert, where the grouped GEMMs give zero rows: such a pair contributes nothing.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxflux.ops import _common, _plan, all_gather

_OP = "moe_routing"


class MoeRouting(NamedTuple):
  """The routing of `all_gather_grouped_matmul` and `grouped_matmul_reduce_scatter` (module
  docstring), all int32; a pytree of its four arrays."""
  group_sizes: jax.Array   # [tp, G]
  pair_index: jax.Array    # [tp, s]
  row_index: jax.Array     # [m, topk]
  expert_order: jax.Array  # [tp*s]

  @property
  def topk(self) -> int:
    """Experts per token (static)."""
    return self.row_index.shape[1]

  @property
  def num_experts(self) -> int:
    """G, the number of experts (static)."""
    return self.group_sizes.shape[1]

  @property
  def segment_rows(self) -> int:
    """s = m*topk, the rows of one rank's segment (static)."""
    return self.pair_index.shape[1]

  @property
  def token_index(self) -> jax.Array:
    """[tp, s]: the token (within rank p's m tokens) of segment p's row j."""
    return self.pair_index // self.topk


def moe_routing(expert_ids, num_experts: int, axis_name: str, *, gathered: bool = False,
                impl: str = "xla") -> MoeRouting:
  """The routing of every rank's (token, expert) pairs into expert-sorted segments.

  Call it inside `jax.shard_map` over the tensor-parallel axis, on this rank's tokens' experts,
  and pass the result to both MoE ops of a layer (it is the same for every weight). The sort is
  stable: within an expert, a segment's rows keep the pairs' order (token, then k).

  Args:
    expert_ids: [m, topk] integer, the experts chosen for this rank's m tokens (e.g. from
      `lax.top_k` of the router's probabilities). An id outside [0, num_experts) routes its
      pair nowhere: it counts in no group and contributes zero.
    num_experts: G, the number of experts (a positive Python int).
    axis_name: the tensor-parallel mesh axis (size tp) over which the tokens are sharded.
    gathered: expert_ids is every rank's, [tp, m, topk] (rank p's tokens' experts at [p]), the
      same on every rank, and nothing is communicated. By default it is this rank's, and the
      ids are all-gathered over axis_name (tp*m*topk integers).
    impl: how the ids are gathered: "xla" (`lax.all_gather`) or "fused" (jaxflux's copy-engine
      all-gather, a program with no XLA collective, as the fused MoE ops are: where NCCL
      can't run, e.g. ranks sharing a GPU; FusedKernelUnavailableError where it can't run).

  Returns:
    MoeRouting(group_sizes [tp, G], pair_index [tp, s], row_index [m, topk],
    expert_order [tp*s]), int32, s = m*topk (module docstring).
  """
  gathered = _plan.static_bool(_OP, "gathered", gathered)
  if impl not in ("xla", "fused"):
    raise ValueError(f"{_OP}: impl={impl!r} is not one of ('xla', 'fused'): how the expert ids "
                     "are gathered, lax.all_gather or jaxflux's copy-engine all-gather.")
  tp = _plan.axis_size(_OP, axis_name)
  expert_ids = _check(expert_ids, num_experts, tp if gathered else None)
  m, topk = expert_ids.shape[-2:]
  s = m * topk
  axes = _common.vma(expert_ids) | {axis_name}
  expert_ids = _common.mark_varying(expert_ids, axes)
  if not gathered and impl == "fused":
    expert_ids = _common.mark_varying(
        all_gather.all_gather(expert_ids, axis_name, impl="fused").reshape(tp, m, topk), axes)
  elif not gathered:
    expert_ids = lax.all_gather(expert_ids, axis_name)
  group_sizes, pair_index, rows, sorted_keys = sort_by_expert(expert_ids.reshape(tp, s),
                                                              num_experts, axes)
  row_index = rows[lax.axis_index(axis_name)].reshape(m, topk)  # this rank's pairs' rows
  # Segment-major rows in expert-major order; expert g's rows of segment 0 come first.
  _, expert_order = _common.stable_argsort(sorted_keys.reshape(-1), axes)
  return MoeRouting(*(_common.mark_varying(a.astype(jnp.int32), axes)
                      for a in (group_sizes, pair_index, row_index, expert_order)))


def sort_by_expert(expert_ids, num_experts: int, axes=None) -> tuple:
  """Each segment (row) of expert_ids [S, n] sorted by expert, stably; ids outside
  [0, num_experts) count in no group and sort last. Returns, int32: (group_sizes [S, G], order
  [S, n] (the pair at each sorted place), rows [S, n] (each pair's sorted place, order's
  inverse), sorted keys [S, n] (G for the ids of no expert)), typed varying over `axes` (default:
  the axes expert_ids varies over). moe_routing and the MoE layer's expert MLP share it."""
  segments, n = expert_ids.shape
  keys = jnp.where((expert_ids >= 0) & (expert_ids < num_experts), expert_ids, num_experts)
  sorted_keys, order = _common.stable_argsort(keys, axes)
  # Counts per (segment, group) as one bincount over segment-offset keys.
  offsets = jnp.arange(segments, dtype=jnp.int32)[:, None] * (num_experts + 1)
  counts = jnp.bincount((keys + offsets).reshape(-1), length=segments * (num_experts + 1))
  group_sizes = counts.reshape(segments, num_experts + 1)[:, :num_experts].astype(jnp.int32)
  iota = _common.mark_varying(jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (segments, n)),
                              _common.vma(order))
  rows = jnp.zeros_like(order).at[jnp.arange(segments)[:, None], order].set(iota)
  return group_sizes, order, rows, sorted_keys


def _check(expert_ids, num_experts, tp: int | None):
  """expert_ids checked: [m, topk] integer ([tp, m, topk] when gathered, tp given)."""
  if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
    raise ValueError(f"{_OP}: num_experts={num_experts!r} must be a positive Python int (the "
                     "number of experts G, w.shape[0] of the ops' expert weights).")
  if not hasattr(expert_ids, "dtype"):
    expert_ids = jnp.asarray(expert_ids)
  if tp is not None:
    if jnp.ndim(expert_ids) != 3 or expert_ids.shape[0] != tp:
      raise ValueError(f"{_OP}: with gathered=True expert_ids must be [tp, m, topk] = [{tp}, m, "
                       f"topk] (every rank's tokens' chosen experts); got shape "
                       f"{jnp.shape(expert_ids)}. Pass this rank's [m, topk] with "
                       "gathered=False.")
  elif jnp.ndim(expert_ids) != 2:
    raise ValueError(f"{_OP}: expert_ids must have rank 2 ([m, topk]: this rank's tokens' chosen "
                     f"experts); got shape {jnp.shape(expert_ids)}. For one expert per token "
                     "pass expert_ids[:, None]; flatten leading token axes first (or pass every "
                     "rank's [tp, m, topk] with gathered=True).")
  if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
    raise TypeError(f"{_OP}: expert_ids must have an integer dtype (expert numbers); got "
                    f"{expert_ids.dtype}. Pass the indices of lax.top_k, or "
                    "expert_ids.astype(jnp.int32).")
  return expert_ids
