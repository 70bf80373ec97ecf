"""Global-view tensor-parallel matmul shared by `jaxflux.Dense` and `jaxflux.nnx.Linear`.

The layers see global arrays under `jit`; this module wraps the per-device ops
(`jaxflux.all_gather_matmul`, `jaxflux.matmul_reduce_scatter`) in a `jax.shard_map`
that is manual over the tensor-parallel axis, so that other mesh axes (a data-parallel
axis sharding the batch, say) keep their sharding.

Layouts (global shapes, `T` tokens, `K` in features, `N` out features, `tp` axis size):

  column: x [..., T/tp @tp, K]      kernel [K, N/tp @tp]   bias [N/tp @tp]
          -> y [..., T, N/tp @tp]   (all-gather of tokens fused with the matmul)
  row:    x [..., T, K/tp @tp]      kernel [K/tp @tp, N]   bias [N] replicated
          -> y [..., T/tp @tp, N]   (matmul fused with the reduce-scatter of tokens)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxflux import ops

TENSOR_PARALLEL_MODES = (None, "column", "row")
IMPLS = ("auto", "fused", "xla")


def param_partitioning(mode: str, axis_name: str) -> tuple[tuple, tuple]:
  """Logical partitioning of (kernel [in, out], bias [out]) for a mode."""
  if mode == "column":
    return (None, axis_name), (axis_name,)
  return (axis_name, None), (None,)


def check_config(
  layer: str,
  *,
  tensor_parallel: Any,
  axis_name: Any,
  token_axis: Any,
  impl: Any,
) -> None:
  """Checks the static tensor-parallel options; raises ValueError naming the field."""
  if tensor_parallel not in TENSOR_PARALLEL_MODES:
    raise ValueError(
      f"{layer}: tensor_parallel={tensor_parallel!r} is not one of "
      f"{TENSOR_PARALLEL_MODES}. Use 'column' (tokens sharded in, features "
      "sharded out) or 'row' (features sharded in, tokens sharded out)."
    )
  if not isinstance(axis_name, str):
    raise ValueError(
      f"{layer}: axis_name={axis_name!r} must be the name (str) of one mesh axis."
    )
  if not isinstance(token_axis, int) or isinstance(token_axis, bool):
    raise ValueError(f"{layer}: token_axis={token_axis!r} must be an int.")
  if impl not in IMPLS:
    raise ValueError(f"{layer}: impl={impl!r} is not one of {IMPLS}.")


def resolve_mesh(layer: str, mode: str, mesh, axis_name: str):
  """The explicit `mesh` if given, else the ambient one; checks it has `axis_name`."""
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      raise ValueError(
        f"{layer}(tensor_parallel={mode!r}) needs a device mesh with an axis "
        f"{axis_name!r}, and none is set. Pass mesh=<jax.sharding.Mesh> to the "
        "layer, or call it under `with jax.set_mesh(mesh):` (the legacy "
        "`with mesh:` does not set it)."
      )
  if axis_name not in mesh.axis_names:
    raise ValueError(
      f"{layer}(tensor_parallel={mode!r}): the mesh has axes {mesh.axis_names} "
      f"and no axis {axis_name!r}. Set axis_name= to the tensor-parallel axis of "
      "the mesh, or build the mesh with that axis."
    )
  if _axis_types(mesh)[axis_name] == AxisType.Manual:
    raise ValueError(
      f"{layer}(tensor_parallel={mode!r}): mesh axis {axis_name!r} is already "
      "manual (the layer is called inside a shard_map over it). Inside shard_map "
      "call jaxflux.all_gather_matmul / jaxflux.matmul_reduce_scatter directly."
    )
  return mesh


def check_divisible(
  layer: str, mode: str, axis_name: str, tp: int, in_features: int, features: int
) -> None:
  """The sharded feature dimension of the kernel must split evenly over tp."""
  if mode == "column" and features % tp:
    raise ValueError(
      f"{layer}(tensor_parallel='column'): features={features} is not divisible "
      f"by the size {tp} of mesh axis {axis_name!r}; the output features are "
      "sharded over it. Pick features as a multiple of it."
    )
  if mode == "row" and in_features % tp:
    raise ValueError(
      f"{layer}(tensor_parallel='row'): the input's last dimension {in_features} "
      f"is not divisible by the size {tp} of mesh axis {axis_name!r}; the input "
      "features are sharded over it. Pick it as a multiple of it."
    )


def tensor_parallel_matmul(
  layer: str,
  inputs: jax.Array,
  kernel: jax.Array,
  bias: jax.Array | None,
  *,
  mode: str,
  axis_name: str,
  token_axis: int,
  mesh,
  impl: str,
  precision,
  preferred_element_type,
) -> jax.Array:
  """`inputs @ kernel + bias` (global view) with the op of `mode` in a shard_map.

  Args:
    inputs: [..., tokens, in_features] (tokens at `token_axis`), already promoted.
    kernel: [in_features, features]; bias: [features] or None.
    mesh: the layer's `mesh` field (None: use the ambient mesh).

  Returns:
    [..., tokens, features], the same layout as `inputs`.
  """
  mesh = resolve_mesh(layer, mode, mesh, axis_name)
  tp = mesh.shape[axis_name]
  ndim = inputs.ndim
  if ndim < 2:
    raise ValueError(
      f"{layer}(tensor_parallel={mode!r}) needs inputs with a token axis and a "
      f"feature axis ([..., tokens, features]); got shape {inputs.shape}."
    )
  if not -ndim <= token_axis < ndim or token_axis % ndim == ndim - 1:
    raise ValueError(
      f"{layer}: token_axis={token_axis} is not a valid token axis for inputs of "
      f"shape {inputs.shape}: it must name a dimension other than the last "
      "(feature) one, e.g. -2."
    )
  token_axis %= ndim
  tokens = inputs.shape[token_axis]
  if tokens % tp:
    raise ValueError(
      f"{layer}(tensor_parallel={mode!r}): the token dimension (token_axis="
      f"{token_axis}) of inputs {inputs.shape} has {tokens} tokens, not divisible "
      f"by the size {tp} of mesh axis {axis_name!r} that shards them. Pad the "
      "sequence to a multiple of it, or set token_axis= to a divisible axis."
    )
  check_divisible(layer, mode, axis_name, tp, inputs.shape[-1], kernel.shape[-1])

  # The ops gather / scatter along axis -2.
  x = jnp.moveaxis(inputs, token_axis, -2)

  # Explicit mesh axes carry sharding in the array types. shard_map has to be
  # manual over them too (leaving an Explicit axis outside the manual set fails
  # to lower the backward psum_scatter on jax 0.10), and its in_specs must match
  # the types, so keep each array's existing Explicit sharding and add tp where
  # the layout needs it. Auto axes stay automatic: the compiler keeps their
  # sharding (e.g. a batch sharded over 'dp').
  types = _axis_types(mesh)
  explicit = {a for a, t in types.items() if t == AxisType.Explicit}
  manual = explicit | {axis_name}

  # Per dimension, the mesh axes sharding it (other than tp, which moves).
  *batch, tokens, _ = _explicit_dims(x, explicit - {axis_name})
  # tp is the minor-most axis on the token dim, so gathering (or scattering) over
  # it stays within the block of tokens that the other axes give this device.
  if mode == "column":
    x_dims = (*batch, tokens + (axis_name,), ())
    kernel_dims, bias_dims = ((), (axis_name,)), ((axis_name,),)
    out_dims = (*batch, tokens, (axis_name,))
  else:
    x_dims = (*batch, tokens, (axis_name,))
    kernel_dims, bias_dims = ((axis_name,), ()), ((),)
    out_dims = (*batch, tokens + (axis_name,), ())

  args, dims = [x, kernel], [x_dims, kernel_dims]
  if bias is not None:
    args.append(bias)
    dims.append(bias_dims)
  if explicit:
    args = [_reshard(a, _spec(d, explicit), mesh) for a, d in zip(args, dims)]

  def local(x, kernel, bias=None):
    if mode == "column":
      y = ops.all_gather_matmul(
        x, kernel, axis_name, impl=impl, precision=precision,
        preferred_element_type=preferred_element_type,
      )
    else:
      y = ops.matmul_reduce_scatter(
        x, kernel, axis_name, impl=impl, precision=precision,
        preferred_element_type=preferred_element_type,
      )
    # Column: the local bias shard matches the local features. Row: the bias is
    # replicated and added once, after the reduction, as in the unsharded layer.
    if bias is not None:
      y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y

  y = jax.shard_map(
    local,
    mesh=mesh,
    in_specs=tuple(_spec(d, manual) for d in dims),
    out_specs=_spec(out_dims, manual),
    axis_names=manual,
  )(*args)
  return jnp.moveaxis(y, -2, token_axis)


def apply_partitioning(value: jax.Array, names: tuple, mesh=None) -> jax.Array:
  """Lays a param out per its partitioning `names` over the ambient mesh, if any, else over
  `mesh` (a layer's own mesh field), if given.

  Reshards over Explicit axes (where `with_sharding_constraint` refuses them, or
  only asserts) and constrains over Auto axes.
  """
  ambient = jax.sharding.get_abstract_mesh()
  if mesh is not None and ambient.empty:
    # Only the layer's mesh, no jax.set_mesh: JAX takes Explicit shardings under jit only in a
    # mesh context, so constrain over an all-Auto view of the same devices.
    view = jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                             axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    return jax.lax.with_sharding_constraint(value, NamedSharding(view, P(*names)))
  mesh = ambient
  if mesh.empty:
    return value
  types = _axis_types(mesh)
  dims = [_axes(n) for n in names]
  explicit = {a for a, t in types.items() if t == AxisType.Explicit}
  auto = {a for a, t in types.items() if t == AxisType.Auto}
  if explicit:
    value = _reshard(value, _spec(dims, explicit), mesh)
  if any(n in auto for d in dims for n in d):
    value = jax.lax.with_sharding_constraint(value, _spec(dims, auto))
  return value


def _axis_types(mesh) -> dict[str, AxisType]:
  return dict(zip(mesh.axis_names, mesh.axis_types))


def _axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _type_dims(x: jax.Array) -> list[tuple[str, ...]]:
  """Per dimension of x, the mesh axes that its type shards it over (Explicit ones)."""
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or ()
  return [_axes(e) for e in spec] + [()] * (x.ndim - len(spec))


def _explicit_dims(x: jax.Array, keep: set[str]) -> list[tuple[str, ...]]:
  """Per dimension of x, the axes in `keep` that its type shards it over."""
  return [tuple(n for n in names if n in keep) for names in _type_dims(x)]


def _spec(dims, keep: set[str]) -> P:
  """PartitionSpec from per-dimension axis tuples, keeping only axes in `keep`."""
  entries = []
  for names in dims:
    names = tuple(n for n in names if n in keep)
    entries.append(None if not names else names[0] if len(names) == 1 else names)
  return P(*entries)


def _reshard(x: jax.Array, spec: P, mesh) -> jax.Array:
  """Reshards x to `spec` over the Explicit axes (skipped when it already is)."""
  wanted = [_axes(e) for e in spec] + [()] * (x.ndim - len(spec))
  if _type_dims(x) == wanted:
    return x
  # A concrete mesh (the layer's `mesh` field) may be the only mesh around.
  target = NamedSharding(mesh, spec) if isinstance(mesh, jax.sharding.Mesh) else spec
  return jax.sharding.reshard(x, target)
