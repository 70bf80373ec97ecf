"""Global-view tensor-parallel matmul shared by `jaxflux.Dense` and `jaxflux.nnx.Linear`.

The layers see global arrays under `jit`; this module wraps the per-device ops
(`jaxflux.all_gather_matmul`, `jaxflux.matmul_reduce_scatter`, `jaxflux.matmul_all_reduce`)
in a `jax.shard_map` that is manual over the tensor-parallel axis, so that other mesh axes (a
data-parallel axis sharding the batch, say) keep their sharding.

Layouts (global shapes, `T` tokens, `K` in features, `N` out features, `tp` axis size), with
sequence parallelism (the default):

  column: x [..., T/tp @tp, K]      kernel [K, N/tp @tp]   bias [N/tp @tp]
          -> y [..., T, N/tp @tp]   (all-gather of tokens fused with the matmul)
  row:    x [..., T, K/tp @tp]      kernel [K/tp @tp, N]   bias [N] replicated
          -> y [..., T/tp @tp, N]   (matmul fused with the reduce-scatter of tokens)

and without (`sequence_parallel=False`, Megatron's plain tensor parallelism; the params are
laid out the same way, so checkpoints and partition metadata do not change):

  column: x [..., T, K] replicated  -> y [..., T, N/tp @tp]   (a local matmul)
  row:    x [..., T, K/tp @tp]      -> y [..., T, N] replicated (matmul fused with an
                                                                 all-reduce)

With Flax's FP8 recipe (`jaxflux.Dense(..., dot_general_cls=nn.Fp8DirectDotGeneralOp)`) the
per-device matmul is `_fp8_recipe.fp8_matmul` instead, in the same layouts; the recipe's six
variables enter the shard_map replicated.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxflux import ops
from jaxflux.layers import _fp8_recipe, _layer_mesh as lm

TENSOR_PARALLEL_MODES = (None, "column", "row")
IMPLS = lm.IMPLS
# The tensor-parallel mesh axis when neither axis_name nor the kernel's partitioning names one.
DEFAULT_AXIS = "tp"
# The kernel dimension [in, out] that each mode shards, and what that dimension is called.
SHARDED_DIM = {"column": 1, "row": 0}
_DIM_ROLE = {"column": "output-feature", "row": "input-feature"}


def param_partitioning(mode: str, axis_name: str) -> tuple[tuple, tuple]:
  """Partitioning names of (kernel [in, out], bias [out]) for a mode: the kernel's sharded
  dimension on `axis_name` (a mesh axis, or a logical axis that the rules map to one)."""
  kernel = (None, axis_name) if mode == "column" else (axis_name, None)
  return kernel, bias_partitioning(mode, kernel)


def bias_partitioning(mode: str, kernel_names: tuple) -> tuple:
  """The bias's names that go with the kernel's: a column bias is split like the kernel's
  output features; a row bias is added after the reduction, so it is replicated."""
  return (tuple(kernel_names)[1],) if mode == "column" else (None,)


def axis_from_partitioning(
  layer: str,
  mode: str,
  axis_name: str | None,
  *,
  names: tuple,
  spec: tuple,
  rules: tuple | None,
  source: str,
) -> str:
  """The mesh axis a layer runs on, given its kernel's own partitioning.

  Args:
    names: the kernel's partitioning names as the user wrote them (logical or mesh axes).
    spec: those names mapped to mesh axes (a PartitionSpec or tuple, one entry a dim).
    rules: the logical axis rules used for the mapping, for error messages (None: the names
      are mesh axes).
    source: where the names came from (the argument to fix), for error messages.

  The kernel's sharded dimension (column: output features, row: input features) must map to
  exactly one mesh axis: the tensor-parallel axis. `axis_name` None takes it; a given
  `axis_name` must name the same axis, since the stored params follow the partitioning.
  """
  dim, role = SHARDED_DIM[mode], _DIM_ROLE[mode]
  head = f"{layer}(tensor_parallel={mode!r})"
  where = (f"kernel partitioning {tuple(names)} from {source}"
           + ("" if rules is None else f", logical axis rules {tuple(rules)}"))
  logical = tuple(names)[dim] if len(tuple(names)) > dim else None
  mapped = lm.axes(tuple(spec)[dim]) if len(tuple(spec)) > dim else ()
  if len(mapped) != 1:
    found = "no mesh axis" if not mapped else f"{len(mapped)} mesh axes {mapped}"
    raise ValueError(
      f"{head}: the kernel's {role} dimension has logical axis {logical!r}, which maps to "
      f"{found} ({where}). The layer shards that dimension over one mesh axis, its "
      f"tensor-parallel axis: add a rule ({logical!r}, '<mesh axis>') for it (e.g. in "
      "nn.logical_axis_rules), or name that dimension with a logical axis that maps to "
      "exactly one mesh axis."
    )
  axis = mapped[0]
  if axis_name is not None and axis_name != axis:
    raise ValueError(
      f"{head}: axis_name={axis_name!r} disagrees with the kernel's partitioning, which puts "
      f"its {role} dimension ({logical!r}) on mesh axis {axis!r} ({where}). Leave "
      f"axis_name unset to use {axis!r}, set axis_name={axis!r}, or change the partitioning "
      "or its rules."
    )
  return axis


def axis_origin(mode: str, names: tuple, spec: tuple, source: str) -> str:
  """Says where a tensor-parallel axis came from, for resolve_mesh's error."""
  dim = SHARDED_DIM[mode]
  return (f"the kernel's partitioning {tuple(names)} from {source} puts its "
          f"{_DIM_ROLE[mode]} dimension ({tuple(names)[dim]!r}) on mesh axis "
          f"{lm.axes(tuple(spec)[dim])[0]!r}")


def check_config(
  layer: str,
  *,
  tensor_parallel: Any,
  axis_name: Any,
  token_axis: Any,
  impl: Any,
  sequence_parallel: Any = True,
) -> None:
  """Checks the static tensor-parallel options; raises ValueError naming the field."""
  if tensor_parallel not in TENSOR_PARALLEL_MODES:
    raise ValueError(
      f"{layer}: tensor_parallel={tensor_parallel!r} is not one of "
      f"{TENSOR_PARALLEL_MODES}. Use 'column' (tokens sharded in, features "
      "sharded out) or 'row' (features sharded in, tokens sharded out)."
    )
  if axis_name is not None and not isinstance(axis_name, str):
    raise ValueError(
      f"{layer}: axis_name={axis_name!r} must be the name (str) of one mesh axis, or None "
      "(the axis the kernel's partitioning names, else 'tp')."
    )
  if not isinstance(token_axis, int) or isinstance(token_axis, bool):
    raise ValueError(f"{layer}: token_axis={token_axis!r} must be an int.")
  if impl not in IMPLS:
    raise ValueError(f"{layer}: impl={impl!r} is not one of {IMPLS}.")
  if not isinstance(sequence_parallel, bool):
    raise ValueError(
      f"{layer}: sequence_parallel={sequence_parallel!r} must be a bool: True (tokens "
      "sharded between a column and a row layer) or False (tokens replicated, the row "
      "layer's output all-reduced)."
    )


def resolve_mesh(layer: str, mode: str, mesh, axis_name: str, origin: str | None = None):
  """The explicit `mesh` if given, else the ambient one; checks it has `axis_name`.

  `origin`: where axis_name came from when the kernel's partitioning chose it (axis_origin).
  """
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
    fix = ("Set axis_name= to the tensor-parallel axis of the mesh, or build the mesh with "
           "that axis.")
    if origin is not None:
      fix = (f"({origin}.) Map that logical axis to the mesh's tensor-parallel axis, or "
             "build the mesh with that axis.")
    raise ValueError(
      f"{layer}(tensor_parallel={mode!r}): the mesh has axes {mesh.axis_names} "
      f"and no axis {axis_name!r}. {fix}"
    )
  if lm.axis_types(mesh)[axis_name] == AxisType.Manual:
    raise ValueError(
      f"{layer}(tensor_parallel={mode!r}): mesh axis {axis_name!r} is already "
      "manual (the layer is called inside a shard_map over it). Inside shard_map "
      "call jaxflux.all_gather_matmul / jaxflux.matmul_reduce_scatter / "
      "jaxflux.matmul_all_reduce directly."
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
  sequence_parallel: bool = True,
  fp8_meta: tuple | None = None,
) -> jax.Array:
  """`inputs @ kernel + bias` (global view) with the op of `mode` in a shard_map.

  Args:
    inputs: [..., tokens, in_features] (tokens at `token_axis`), already promoted.
    kernel: [in_features, features]; bias: [features] or None.
    mesh: the layer's `mesh` field (None: use the ambient mesh).
    sequence_parallel: False: tokens are never split (module docstring), so `token_axis`
      is not read and any number of tokens works.
    fp8_meta: None, or the six variables of Flax's FP8 recipe (`_fp8_recipe.META_NAMES`
      order): the matmul then runs that recipe (`_fp8_recipe.fp8_matmul`), in the kernel's
      dtype; `precision` and `preferred_element_type` are not read (Flax's FP8 ops ignore
      them too). The variables enter replicated; their cotangents are their new values.

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
  if sequence_parallel:
    token_axis = _token_axis(layer, mode, axis_name, tp, inputs, token_axis)
  check_divisible(layer, mode, axis_name, tp, inputs.shape[-1], kernel.shape[-1])
  # The ops gather / scatter along axis -2; without sequence parallelism nothing moves.
  x = jnp.moveaxis(inputs, token_axis, -2) if sequence_parallel else inputs

  # Explicit mesh axes carry sharding in the array types. shard_map has to be
  # manual over them too (leaving an Explicit axis outside the manual set fails
  # to lower the backward psum_scatter on jax 0.10), and its in_specs must match
  # the types, so keep each array's existing Explicit sharding and add tp where
  # the layout needs it. Auto axes stay automatic: the compiler keeps their
  # sharding (e.g. a batch sharded over 'dp').
  types = lm.axis_types(mesh)
  explicit = {a for a, t in types.items() if t == AxisType.Explicit}
  manual = explicit | {axis_name}

  # Per dimension, the mesh axes sharding it (other than tp, which moves).
  *batch, tokens, _ = lm.explicit_dims(x, explicit - {axis_name})
  # tp is the minor-most axis on the token dim, so gathering (or scattering) over
  # it stays within the block of tokens that the other axes give this device.
  # Without sequence parallelism the tokens keep their layout (never over tp) on both sides.
  split_tokens = tokens + (axis_name,) if sequence_parallel else tokens
  if mode == "column":
    x_dims = (*batch, split_tokens, ())
    kernel_dims, bias_dims = ((), (axis_name,)), ((axis_name,),)
    out_dims = (*batch, tokens, (axis_name,))
  else:
    x_dims = (*batch, tokens, (axis_name,))
    kernel_dims, bias_dims = ((axis_name,), ()), ((),)
    out_dims = (*batch, split_tokens, ())

  args, dims = [x, kernel], [x_dims, kernel_dims]
  if bias is not None:
    args.append(bias)
    dims.append(bias_dims)
  meta_count = 0 if fp8_meta is None else len(fp8_meta)
  if fp8_meta is not None:
    args.extend(fp8_meta)
    dims.extend([((),)] * meta_count)  # replicated: scales [1], amax histories [length]
  if explicit:
    args = [lm.reshard(a, lm.spec(d, explicit), mesh) for a, d in zip(args, dims)]

  def local(x, kernel, *rest):
    rest = list(rest)
    meta = tuple(rest[len(rest) - meta_count:])
    bias = rest[0] if len(rest) > meta_count else None
    kw = dict(precision=precision, preferred_element_type=preferred_element_type)
    if meta:
      y = _fp8_recipe.fp8_matmul(x, kernel, meta, mode=mode, axis_name=axis_name, impl=impl,
                                 sequence_parallel=sequence_parallel)
    elif mode == "column" and not sequence_parallel:
      # Every device has all tokens: its output features need no communication. (The
      # backward sums x's cotangent over tp: the transpose of x's implicit broadcast.)
      y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), **kw)
    elif mode == "column":
      y = ops.all_gather_matmul(x, kernel, axis_name, impl=impl, **kw)
    elif sequence_parallel:
      y = ops.matmul_reduce_scatter(x, kernel, axis_name, impl=impl, **kw)
    else:
      y = ops.matmul_all_reduce(x, kernel, axis_name, impl=impl, **kw)
    # Column: the local bias shard matches the local features. Row: the bias is
    # replicated and added once, after the reduction, as in the unsharded layer.
    if bias is not None:
      y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y

  y = jax.shard_map(
    local,
    mesh=mesh,
    in_specs=tuple(lm.spec(d, manual) for d in dims),
    out_specs=lm.spec(out_dims, manual),
    axis_names=manual,
  )(*args)
  return jnp.moveaxis(y, -2, token_axis) if sequence_parallel else y


def _token_axis(layer: str, mode: str, axis_name: str, tp: int, inputs, token_axis: int) -> int:
  """The token axis (>= 0) of `inputs`, checked: not the feature axis, and tokens that split
  evenly over tp."""
  ndim = inputs.ndim
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
      "sequence to a multiple of it, or set token_axis= to a divisible axis, or use "
      "sequence_parallel=False (tokens replicated)."
    )
  return token_axis


def apply_partitioning(value: jax.Array, names: tuple, mesh=None) -> jax.Array:
  """Lays a param out per its partitioning `names` (mesh axes) over the ambient mesh, if
  any, else over `mesh` (a layer's own mesh field), if given.

  Reshards over Explicit axes (where `with_sharding_constraint` refuses them, or
  only asserts) and constrains over Auto axes.
  """
  target = jax.sharding.get_abstract_mesh()
  if target.empty:
    if mesh is None:
      return value
    if lm.typed_mesh(value) != mesh.abstract_mesh:
      # Only the layer's mesh, no jax.set_mesh: JAX takes Explicit shardings under jit only
      # in a mesh context, so constrain over an all-Auto view of the same devices.
      view = jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                               axis_types=(AxisType.Auto,) * len(mesh.axis_names))
      return jax.lax.with_sharding_constraint(value, NamedSharding(view, P(*names)))
    # Already typed over that mesh (a param made over it outside jit): keep to its types, so
    # that its cotangent has the same type.
    target = mesh
  types = lm.axis_types(target)
  dims = [lm.axes(n) for n in names]
  explicit = {a for a, t in types.items() if t == AxisType.Explicit}
  auto = {a for a, t in types.items() if t == AxisType.Auto}
  if explicit:
    value = lm.reshard(value, lm.spec(dims, explicit), target)
  # On an all-Auto mesh also when no axis shards it: replicated is a layout too (and its
  # gradient's). On a mixed mesh that would drop the Explicit axes of an eager value.
  if any(n in auto for d in dims for n in d) or (auto and not explicit):
    spec = lm.spec(dims, auto)
    concrete = isinstance(target, jax.sharding.Mesh)
    value = jax.lax.with_sharding_constraint(
      value, NamedSharding(target, spec) if concrete else spec)
  return value
