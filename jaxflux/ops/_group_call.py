"""The FFI call of a communicating op: this device's rank and group operand, the workspace the
call needs (its size the native module's, reserved at trace time), the target's name and the
attributes every such handler takes (tp, num_groups, site, workspace_class, debug_skip_rank).

Every attribute is a pure function of the call (its shapes, axis and settings), never of what
the process traced before, so a program's HLO is the same in every process and every run: a
second process loads it from JAX's persistent compilation cache."""
from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxflux import _runtime
from jaxflux.ops import _common, _mesh, _platform


def _other_manual_axes(op: str, axis_name: str) -> list[tuple[str, int]]:
  """The manual axes other than `axis_name`. The ops' platform check has ruled out other
  non-manual axes of size > 1 before a fused call gets here; this raises if one still does."""
  reason = _platform.non_manual_axis_reason(axis_name)
  if reason is not None:
    raise NotImplementedError(f"{op}(impl='fused'): {reason}")
  return _mesh.other_manual_axes(axis_name)


def rank_info(axis_name: str, op: str = "all_gather") -> tuple[jax.Array, int]:
  """This device's [rank along axis_name, group index over the other manual axes] (int32) and
  the number of groups. The group index is the row-major index over the other axes' positions,
  so two devices are in the same group iff they agree on every other axis."""
  group = jnp.int32(0)
  num_groups = 1
  others = _other_manual_axes(op, axis_name)
  for name, size in others:
    group = group * size + lax.axis_index(name).astype(jnp.int32)
    num_groups *= size
  info = jnp.stack([lax.axis_index(axis_name).astype(jnp.int32), jnp.asarray(group, jnp.int32)])
  if _runtime.multi_process():
    info = jnp.concatenate([info, _group_slot_words(axis_name, others, group, num_groups)])
  return info, num_groups


def call(op: str, out_types, operands: tuple, axis_name: str, *, item_bytes: int,
         scale_bytes: int = 0, scales: tuple = (), debug_skip_rank: int = -1, **attrs):
  """Calls the FFI target of `op` (xla_ffi/ffi/) for this device's group on `axis_name`: makes
  the workspace hold what the op's slot layout needs for `item_bytes` (what one rank sends each
  peer: its shard, or one partial) and `scale_bytes` (an FP8 all_gather_matmul shard's row
  scales), appends the rank operand to `operands`, then `scales` (an FP8 call's x row and w
  column scales), and passes the common attributes plus `attrs` (int64).
  debug_skip_rank: test hook; that rank never signals its peers, so they time out."""
  info, num_groups = rank_info(axis_name, op)
  tp = lax.axis_size(axis_name)
  need = _runtime.group_workspace_bytes(op, tp, item_bytes, scale_bytes)
  common = dict(tp=tp, num_groups=num_groups, workspace_class=_runtime.ensure_workspace(need),
                debug_skip_rank=debug_skip_rank, **attrs)
  ffi_call = jax.ffi.ffi_call(_runtime.target_name(op), out_types)
  site = signature_key(op, (*operands, info, *scales), out_types, common)
  return ffi_call(*operands, info, *scales, site=np.int64(site),
                  **{name: np.int64(value) for name, value in common.items()})


def signature_key(op: str, operands: tuple, out_types, attrs: dict) -> int:
  """A 62-bit key of the call's target, operand and result types and attributes: the `site`
  attribute, which keys the handler's one-process rank discovery. Calls with equal keys meet
  in successive rounds of one rendezvous (docs/runtime.md), so the key need not be unique."""
  types = [(tuple(x.shape), str(x.dtype)) for x in (*operands, *jax.tree.leaves(out_types))]
  text = repr((op, types, sorted((name, int(value)) for name, value in attrs.items())))
  return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def _group_slot_words(axis_name: str, others, group, num_groups: int) -> jax.Array:
  """[tp] int32: the slot word (host << 8 | host slot) of every rank of this device's group, in
  rank order. With one process per GPU the handlers learn their peers from it, since no host
  rendezvous can span processes.

  Under `jax.set_mesh(mesh)` the concrete mesh is known at trace time and the table is a
  constant. Otherwise (`shard_map(mesh=...)` alone) each device writes its own word
  (jaxflux_device_slot) and an all-gather over the axis collects them: an XLA collective in the
  program, which a dead peer leaves hanging (NCCL has no timeout), unlike jaxflux's own waits.
  """
  tp = lax.axis_size(axis_name)
  mesh = _mesh.concrete_mesh()
  if mesh is not None and axis_name in mesh.axis_names:
    table = _mesh.slot_word_table(mesh, axis_name, num_groups, _runtime.host_slots().slot_word)
    return jnp.asarray(table)[group]
  _runtime.register_targets()
  slot_call = jax.ffi.ffi_call("jaxflux_device_slot", jax.ShapeDtypeStruct((2,), jnp.int32))
  word = slot_call()[:1]  # {word, 0}: written as one 64-bit stream memory op
  axes = {axis_name} | {name for name, _ in others}
  words = lax.all_gather(_common.mark_varying(word, axes), axis_name, tiled=True)
  assert words.shape == (tp,)
  return words
