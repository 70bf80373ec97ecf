"""Mesh geometry of the communicating ops: the concrete mesh, the manual axes other than the
tensor-parallel one, and the host-side map from devices to (rank, group)."""
from __future__ import annotations

import jax
import numpy as np


def concrete_mesh():
  """The mesh of `jax.set_mesh`, if any (shard_map's own mesh= argument is not visible here)."""
  try:
    from jax._src import mesh as mesh_lib
    mesh = mesh_lib.get_concrete_mesh()
  except (ImportError, AttributeError):
    return None
  return mesh if mesh is not None and getattr(mesh, "devices", np.empty(0)).size else None


def abstract_axes() -> list[tuple[str, int, bool]]:
  """(name, size, manual) of every axis of the current abstract mesh, in mesh order."""
  mesh = jax.sharding.get_abstract_mesh()
  names = tuple(getattr(mesh, "axis_names", ()) or ())
  if not names:
    return []
  manual = set(getattr(mesh, "manual_axes", names) or ())
  return [(name, size, name in manual)
          for name, size in zip(names, getattr(mesh, "axis_sizes", ()) or ())]


def other_manual_axes(axis_name: str) -> list[tuple[str, int]]:
  """(name, size) of the manual mesh axes other than `axis_name`, in mesh order."""
  return [(name, size) for name, size, manual in abstract_axes()
          if name != axis_name and manual]


def expected_rank_info(mesh: jax.sharding.Mesh, axis_name: str) -> dict[int, tuple[int, int]]:
  """Host-side reference of the ops' rank_info for a concrete mesh: device id -> (rank, group).
  The group is the row-major index over the other axes' positions."""
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


def slot_word_table(mesh, axis_name: str, num_groups: int, slot_word) -> np.ndarray:
  """[num_groups, tp] int32: slot_word(device) at [group, rank], with rank and group as
  expected_rank_info computes them."""
  table = np.full((num_groups, mesh.shape[axis_name]), -1, np.int32)
  by_id = {d.id: d for d in mesh.devices.flat}
  for device_id, (rank, group) in expected_rank_info(mesh, axis_name).items():
    table[group, rank] = slot_word(by_id[device_id])
  return table
