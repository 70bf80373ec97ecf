"""A ragged all-to-all that runs on every backend: XLA's `lax.ragged_all_to_all` in a program
lowered for GPUs (only the rows each device sends travel), and elsewhere, where XLA lacks it
(its CPU backend: UNIMPLEMENTED), an equivalent that moves a worst-case buffer through
`lax.all_to_all`. The choice is made when the program is lowered (`lax.platform_dependent`),
so one traced program runs on either. Expert parallelism moves its rows with it.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from jaxflux.ops import _common


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                      axis: str):
  """`lax.ragged_all_to_all` over mesh axis `axis` (call it inside `jax.shard_map`): this
  device's rows operand[input_offsets[j] : input_offsets[j] + send_sizes[j]] go to device j,
  where they land at output[output_offsets[j] : output_offsets[j] + send_sizes[j]];
  recv_sizes[i] is the row count device i sends here. Returns `output` with every received
  row written, its other rows as given. Offsets and sizes are int32 [axis size]."""
  # Typed as varying where the rows do: both branches' results must agree with the operand's.
  output = _common.mark_varying(output, _common.vma(operand) | {axis})
  return lax.platform_dependent(
      operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
      cpu=functools.partial(_through_all_to_all, axis=axis),
      default=functools.partial(lax.ragged_all_to_all, axis_name=axis))


def _through_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                        *, axis: str):
  """ragged_all_to_all's result from one all_to_all of [ranks, n] rows (each destination's
  rows first, zeros after: the static worst case, n = operand's rows) and one of the offsets."""
  ranks, n = lax.axis_size(axis), operand.shape[0]
  place = jnp.arange(n, dtype=jnp.int32)[None, :]
  rows = jnp.take(operand, jnp.clip(input_offsets[:, None] + place, 0, n - 1), axis=0)
  sent = place < send_sizes[:, None]
  send = jnp.where(sent.reshape(ranks, n, *(1,) * (operand.ndim - 1)), rows, 0)
  received = lax.all_to_all(send, axis, 0, 0)  # [i]: device i's rows for this device
  starts = lax.all_to_all(output_offsets, axis, 0, 0, tiled=True)  # [i]: where they land here
  target = jnp.where(place < recv_sizes[:, None], starts[:, None] + place, output.shape[0])
  return output.at[target.reshape(-1)].set(received.reshape(ranks * n, *operand.shape[1:]),
                                           mode="drop")
