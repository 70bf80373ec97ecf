"""What the dense (`_tensor_parallel`) and MoE (`_moe`) layers share: their `impl` names, and how
they read mesh axes off an array's type and write them back as a PartitionSpec or a reshard."""
from __future__ import annotations

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

IMPLS = ("auto", "fused", "xla")


def axis_types(mesh) -> dict[str, AxisType]:
  return dict(zip(mesh.axis_names, mesh.axis_types))


def axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


def typed_mesh(x: jax.Array):
  """The mesh of x's type (empty for an array that no mesh types)."""
  return getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)


def type_dims(x: jax.Array) -> list[tuple[str, ...]]:
  """Per dimension of x, the mesh axes that its type shards it over (Explicit ones)."""
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or ()
  return [axes(e) for e in spec] + [()] * (x.ndim - len(spec))


def explicit_dims(x: jax.Array, keep) -> list[tuple[str, ...]]:
  """Per dimension of x, the axes in `keep` that its type shards it over."""
  return [tuple(n for n in names if n in keep) for names in type_dims(x)]


def spec(dims, keep) -> P:
  """PartitionSpec from per-dimension axis tuples, keeping only axes in `keep`."""
  entries = []
  for names in dims:
    names = tuple(n for n in names if n in keep)
    entries.append(None if not names else names[0] if len(names) == 1 else names)
  return P(*entries)


def reshard(x: jax.Array, target: P, mesh) -> jax.Array:
  """Reshards x to `target` over the Explicit axes of `mesh` (skipped when it already is).

  The type's mesh counts, not only its spec: a replicated row bias laid out over the layer's
  own mesh without `jax.set_mesh` is typed over an all-Auto view of it (apply_partitioning),
  and entering shard_map under that type gives it a cotangent typed over the Explicit mesh,
  which the backward pass rejects ("Expected cotangent type float32[N] but got float32[N]").
  """
  wanted = [axes(e) for e in target] + [()] * (x.ndim - len(target))
  abstract = mesh.abstract_mesh if isinstance(mesh, jax.sharding.Mesh) else mesh
  if type_dims(x) == wanted and typed_mesh(x) == abstract:
    return x
  # A concrete mesh (the layer's `mesh` field) may be the only mesh around.
  return jax.sharding.reshard(
    x, NamedSharding(mesh, target) if isinstance(mesh, jax.sharding.Mesh) else target)
