"""Sums over a mesh axis through jaxflux's copy-engine all-gather instead of XLA's all-reduce,
for programs that must hold no XLA collective: the fused MoE layer's load-balancing sums and its
router's gradient, so that the whole layer runs where NCCL can't (ranks sharing a GPU).

Both gather every rank's value and add them in rank order on each rank: the same bits
everywhere, at the cost of tp copies of a small value (the layer's E probabilities, its H x E
router kernel). Call them inside `jax.shard_map` over `axis`; the fused all-gather needs
jaxflux.has_cuda() (FusedKernelUnavailableError otherwise). Over an axis of size 1 they are
lax.psum and the plain broadcast, which communicate nothing.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxflux.ops import _common, all_gather


def _gathered_sum(v, axis: str):
  """Every rank's v, summed in rank order: typed as invariant over `axis` (an FFI result), and
  varying over the other axes v varies over."""
  tp = lax.axis_size(axis)
  rows = all_gather.all_gather(v.reshape(1, -1), axis, impl="fused")  # [tp, v.size]
  total = jnp.sum(rows.reshape(tp, *v.shape), axis=0)
  return _common.cast_to_vma(total, _common.vma(v) - {axis})


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def psum(v, axis: str):
  """lax.psum(v, axis) without XLA's all-reduce; its gradient is the cotangent on every rank."""
  if lax.axis_size(axis) == 1:
    return lax.psum(v, axis)
  return _gathered_sum(v, axis)


def _psum_fwd(v, axis):
  return psum(v, axis), None


def _psum_bwd(axis, _, ct):
  # psum's transpose: each rank's term gets the (replicated) cotangent.
  return (_common.mark_varying(ct, {axis}),)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def broadcast(w, axis: str):
  """w, a value the same on every rank of `axis`, typed as varying over it for use with per-rank
  data; its gradient, the sum of every rank's cotangent, goes through the fused all-gather
  instead of the all-reduce that the implicit broadcast's transpose would be."""
  return _common.mark_varying(w, {axis})


def _broadcast_fwd(w, axis):
  return broadcast(w, axis), None


def _broadcast_bwd(axis, _, ct):
  if lax.axis_size(axis) == 1:
    return (_common.cast_to_vma(ct, _common.vma(ct) - {axis}),)
  return (_gathered_sum(ct, axis),)


psum.defvjp(_psum_fwd, _psum_bwd)
broadcast.defvjp(_broadcast_fwd, _broadcast_bwd)
