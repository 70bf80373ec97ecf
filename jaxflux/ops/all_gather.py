"""Internal op: tiled all-gather along axis -2 driven by copy engines (per-device view).

`all_gather(x, "tp")` inside `jax.shard_map` equals
`lax.all_gather(x, "tp", axis=x.ndim - 2, tiled=True)`: x [..., m, k] -> [..., tp*m, k].
It is the communication half of AllGather+GEMM and the proving ground of the GPU runtime
(docs/runtime.md): symmetric workspace, epoch flags, bounded waits and rank discovery.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxflux import _knobs, _runtime
from jaxflux.ops import _common

IMPLS = ("fused", "xla")


def _other_manual_axes(axis_name: str) -> list[tuple[str, int]]:
  """(name, size) of the manual mesh axes other than `axis_name`, in mesh order. The ops'
  platform check (`_common.non_manual_axis_reason`) has ruled out other non-manual axes of
  size > 1 before a fused call gets here; this raises if one still does."""
  reason = _common.non_manual_axis_reason(axis_name)
  if reason is not None:
    raise NotImplementedError(f"all_gather(impl='fused'): {reason}")
  mesh = jax.sharding.get_abstract_mesh()
  names = tuple(getattr(mesh, "axis_names", ()) or ())
  if not names:
    return []
  manual = set(getattr(mesh, "manual_axes", names) or ())
  return [(name, size) for name, size in zip(names, mesh.axis_sizes)
          if name != axis_name and name in manual]


def rank_info(axis_name: str) -> tuple[jax.Array, int]:
  """This device's [rank along axis_name, group index over the other manual axes] (int32) and
  the number of groups. The group index is the row-major index over the other axes' positions,
  so two devices are in the same group iff they agree on every other axis."""
  group = jnp.int32(0)
  num_groups = 1
  for name, size in _other_manual_axes(axis_name):
    group = group * size + lax.axis_index(name).astype(jnp.int32)
    num_groups *= size
  info = jnp.stack([lax.axis_index(axis_name).astype(jnp.int32), jnp.asarray(group, jnp.int32)])
  if _runtime.multi_process():
    info = jnp.concatenate([info, _group_slot_words(axis_name, group, num_groups)])
  return info, num_groups


def slot_bytes(nbytes: int) -> int:
  """A workspace slot holding `nbytes`: 256-byte aligned, since peers write into it."""
  return -(-nbytes // 256) * 256


def call_group_op(op: str, out_types, operands: tuple, axis_name: str, workspace_bytes: int,
                  **attrs):
  """Calls the communicating FFI target of `op` (xla_ffi/ffi/) for this device's group on
  `axis_name`: makes the workspace hold `workspace_bytes` (at trace time), appends the rank
  operand to `operands`, and passes the attributes every such handler takes (tp, num_groups,
  site, generation) plus `attrs` (int64). A bad measurement knob in the environment fails here,
  at trace time (jaxflux/_knobs.py)."""
  _knobs.check_environment(op)
  info, num_groups = rank_info(axis_name)
  generation = _runtime.ensure_workspace(workspace_bytes)
  call = jax.ffi.ffi_call(_runtime.target_name(op), out_types)
  return call(*operands, info,
              tp=np.int64(lax.axis_size(axis_name)),
              num_groups=np.int64(num_groups),
              site=np.int64(_runtime.new_site_id()),
              generation=np.int64(generation),
              **{name: np.int64(value) for name, value in attrs.items()})


def _group_slot_words(axis_name: str, group, num_groups: int) -> jax.Array:
  """[tp] int32: the slot word (host << 8 | host slot) of every rank of this device's group, in
  rank order. With one process per GPU the handlers learn their peers from it, since no host
  rendezvous can span processes.

  Under `jax.set_mesh(mesh)` the concrete mesh is known at trace time and the table is a
  constant. Otherwise (`shard_map(mesh=...)` alone) each device writes its own word
  (jaxflux_device_slot) and an all-gather over the axis collects them: an XLA collective in the
  program, which a dead peer leaves hanging (NCCL has no timeout), unlike jaxflux's own waits.
  """
  tp = lax.axis_size(axis_name)
  mesh = concrete_mesh()
  if mesh is not None and axis_name in mesh.axis_names:
    table = slot_word_table(mesh, axis_name, num_groups, _runtime.host_slots().slot_word)
    return jnp.asarray(table)[group]
  _runtime.register_targets()
  call = jax.ffi.ffi_call("jaxflux_device_slot", jax.ShapeDtypeStruct((2,), jnp.int32))
  word = call()[:1]  # {word, 0}: written as one 64-bit stream memory op
  axes = {axis_name} | {name for name, _ in _other_manual_axes(axis_name)}
  words = lax.all_gather(_common.mark_varying(word, axes), axis_name, tiled=True)
  assert words.shape == (tp,)
  return words


def concrete_mesh():
  """The mesh of `jax.set_mesh`, if any (shard_map's own mesh= argument is not visible here)."""
  try:
    from jax._src import mesh as mesh_lib
    mesh = mesh_lib.get_concrete_mesh()
  except (ImportError, AttributeError):
    return None
  return mesh if mesh is not None and getattr(mesh, "devices", np.empty(0)).size else None


def slot_word_table(mesh, axis_name: str, num_groups: int, slot_word) -> np.ndarray:
  """[num_groups, tp] int32: slot_word(device) at [group, rank], with rank and group as
  `rank_info` computes them (see expected_rank_info)."""
  table = np.full((num_groups, mesh.shape[axis_name]), -1, np.int32)
  by_id = {d.id: d for d in mesh.devices.flat}
  for device_id, (rank, group) in expected_rank_info(mesh, axis_name).items():
    table[group, rank] = slot_word(by_id[device_id])
  return table


def expected_rank_info(mesh: jax.sharding.Mesh, axis_name: str) -> dict[int, tuple[int, int]]:
  """Host-side reference of `rank_info` for a concrete mesh: device id -> (rank, group)."""
  names = list(mesh.axis_names)
  t = names.index(axis_name)
  others = [i for i in range(len(names)) if i != t]
  result = {}
  for pos in np.ndindex(*mesh.devices.shape):
    group = 0
    for i in others:
      group = group * mesh.devices.shape[i] + pos[i]
    result[int(mesh.devices[pos].id)] = (pos[t], group)
  return result


def all_gather(x, axis_name: str, *, impl: str = "fused", _debug_skip_signal_rank: int = -1):
  """Gathers x [..., m, k] over `axis_name` along axis -2: returns [..., tp*m, k].

  Args:
    x: local shard, rank >= 2, any dtype (the fused path copies bytes).
    axis_name: a manual mesh axis of the enclosing `jax.shard_map`.
    impl: "fused" (copy engines, needs jaxflux.has_cuda()) or "xla" (lax.all_gather).
    _debug_skip_signal_rank: test hook; that rank never signals, so its peers time out.
  """
  if impl not in IMPLS:
    raise ValueError(f"all_gather: impl={impl!r} is not one of {IMPLS}.")
  if not isinstance(axis_name, str):
    raise TypeError(f"all_gather: axis_name must be one mesh axis name (str), got {axis_name!r}.")
  if jnp.ndim(x) < 2:
    raise ValueError(f"all_gather: x must have rank >= 2 ([..., m, k]); got shape {jnp.shape(x)}.")
  if impl == "xla":
    return lax.all_gather(x, axis_name, axis=x.ndim - 2, tiled=True)
  tp = _common.axis_size("all_gather", axis_name)
  if tp == 1:
    return x
  reason = _common.platform_reason(axis_name)
  if reason is not None:
    raise _common.FusedKernelUnavailableError(f"all_gather(impl='fused'): {reason} Use "
                                              "impl='xla'.")
  shard_bytes = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
  out_shape = x.shape[:-2] + (tp * x.shape[-2], x.shape[-1])
  # Receive slots [epoch parity][source rank] (peers push into them).
  return call_group_op("all_gather", jax.ShapeDtypeStruct(out_shape, x.dtype), (x,), axis_name,
                       2 * tp * slot_bytes(shard_bytes),
                       debug_skip_rank=_debug_skip_signal_rank)
