"""`jaxflux.nnx.Linear`: `flax.nnx.Linear` with fused tensor-parallel matmuls."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd as flax_spmd
from flax.nnx.nn import dtypes, linear
from flax.typing import DotGeneralT, Dtype, Initializer, PrecisionLike, PromoteDtypeFn
from jax import lax

from jaxflux.layers import _tensor_parallel as tpm

__all__ = ["Linear"]

# Older spellings of a Param's `out_sharding` metadata, which flax renames in this order.
_OLD_SHARDING_KEYS = ("sharding", "sharding_names")


def _sharding_metadata(init: Initializer, metadata: Mapping[str, Any], shape: tuple,
                       dtype: Dtype) -> dict:
  """The metadata that `nnx.Param(init(key, shape, dtype), **metadata)` gets (what `init`
  sets wins, older sharding keys become `out_sharding`, as in flax); `init` is only traced."""
  found = {}

  def run():
    out = init(jax.random.key(0), shape, dtype)
    if isinstance(out, nnx.VariableMetadata):
      found.update(out.metadata)
      out = out.raw_value
    return out

  jax.eval_shape(run)
  merged = {**metadata, **found}
  for key in _OLD_SHARDING_KEYS:
    if key in merged:
      merged["out_sharding"] = merged.pop(key)
  return merged


def _with_metadata(init: Initializer, extra: dict) -> Initializer:
  """`init` whose Param metadata also holds `extra`, over what `init` itself sets."""

  def wrapped(*args):
    out = init(*args)
    if isinstance(out, nnx.VariableMetadata):
      return dataclasses.replace(out, metadata={**out.metadata, **extra})
    return nnx.VariableMetadata(out, metadata=dict(extra))

  return wrapped


def _mesh_spec(names, rules) -> tuple:
  """Sharding names as mesh axes, mapped as flax maps them when it creates the Param: through
  the active `nnx.logical_axis_rules` and the Param's `sharding_rules`; unmapped names stay."""
  return tuple(flax_spmd.get_pspec(tuple(names), rules))


def _tensor_parallel_params(
  mode: str,
  axis_name: str | None,
  mesh: jax.sharding.Mesh | None,
  shape: tuple[int, int],
  dtype: Dtype,
  kernel_init: Initializer,
  kernel_metadata: Mapping[str, Any],
  bias_init: Initializer,
  bias_metadata: Mapping[str, Any],
  use_bias: bool,
) -> tuple[str, Initializer, Initializer, tuple[tuple, tuple | None]]:
  """The tensor-parallel axis, kernel / bias initializers that carry the params' sharding, and
  that sharding as mesh axes (kernel spec, bias spec).

  A kernel with sharding metadata of its own (`nnx.with_partitioning` on kernel_init, or
  `out_sharding` in kernel_metadata) keeps it; its sharded dimension, mapped to mesh axes
  (`_mesh_spec`), names the axis (tpm.axis_from_partitioning). Otherwise the params get the
  mode's partitioning over the axis. A bias without sharding gets the one that goes with the
  kernel's (and its rules).
  """
  layer = "jaxflux.nnx.Linear"
  kernel = _sharding_metadata(kernel_init, kernel_metadata, shape, dtype)
  names, rules, origin = kernel.get("out_sharding"), kernel.get("sharding_rules"), None
  if not names:
    axis = axis_name or tpm.DEFAULT_AXIS
    names = tpm.param_partitioning(mode, axis)[0]
    kernel_init = _with_metadata(kernel_init, {"out_sharding": names, "mesh": mesh})
  else:
    names = tuple(getattr(names, "spec", names))  # A NamedSharding's spec.
    spec = _mesh_spec(names, rules)
    active = flax_spmd.composite_rules(flax_spmd.get_logical_axis_rules(), rules)
    source = "kernel_init / kernel_metadata"
    axis = tpm.axis_from_partitioning(
      layer, mode, axis_name, names=names, spec=spec, rules=active or None, source=source)
    origin = tpm.axis_origin(mode, names, spec, source)
    if mesh is not None and kernel.get("mesh") is None:
      kernel_init = _with_metadata(kernel_init, {"mesh": mesh})
  specs = (_mesh_spec(names, rules), None)
  if use_bias:
    bias = _sharding_metadata(bias_init, bias_metadata, shape[1:], dtype)
    bias_names, bias_rules = bias.get("out_sharding"), bias.get("sharding_rules")
    if not bias_names:
      bias_names, bias_rules = tpm.bias_partitioning(mode, names), rules
      extra = {"out_sharding": bias_names, "mesh": mesh}
      if rules:
        extra["sharding_rules"] = rules
      bias_init = _with_metadata(bias_init, extra)
    elif mesh is not None and bias.get("mesh") is None:
      bias_init = _with_metadata(bias_init, {"mesh": mesh})
    specs = (specs[0], _mesh_spec(getattr(bias_names, "spec", bias_names), bias_rules))
  # Params with sharding metadata are placed on the mesh when created (flax's eager
  # sharding), so the mesh and an even split are needed now.
  if mesh is not None or nnx.using_eager_sharding():
    mesh = tpm.resolve_mesh(layer, mode, mesh, axis, origin)
    tpm.check_divisible(layer, mode, axis, mesh.shape[axis], *shape)
  return axis, kernel_init, bias_init, specs


class Linear(nnx.Linear):
  """A linear transformation over the last dimension, optionally tensor-parallel.

  A drop-in for ``flax.nnx.Linear`` (it subclasses it): the same arguments,
  order and defaults and the same params (``kernel [in, out]``, ``bias [out]``
  as ``nnx.Param``), so checkpoints load either way. With ``tensor_parallel``
  set, the matmul runs sharded over one mesh axis, with its collective fused
  into the matmul:

  - ``"column"``: tokens sharded over the axis in, features sharded out
    (``jaxflux.all_gather_matmul``). Params: kernel ``P(None, axis)``,
    bias ``P(axis)``.
  - ``"row"``: input features sharded in, tokens sharded out
    (``jaxflux.matmul_reduce_scatter``). Params: kernel ``P(axis, None)``,
    bias replicated.

  With ``sequence_parallel=False`` (Megatron's plain tensor parallelism) tokens are
  never sharded: a column layer takes them replicated and multiplies locally (no
  communication), a row layer gives its output replicated through
  ``jaxflux.matmul_all_reduce``. The params, their partitioning and checkpoints are
  the same either way.

  Logical axes (FSDP x TP). A kernel with sharding metadata of its own
  (``kernel_init=nnx.with_partitioning(init, ("embed", "mlp"))``, or ``out_sharding``
  in ``kernel_metadata``, with optional ``sharding_rules``) keeps it, and flax shards the
  Param by it, mapping the names through the active ``nnx.logical_axis_rules`` and its
  ``sharding_rules`` (a name without a rule is a mesh axis). The kernel's sharded
  dimension (column: output features, row: input features) must map to exactly one mesh
  axis, else a ValueError names the logical axis and the rules: that axis is the layer's
  tensor-parallel axis. With ``axis_name`` left None the layer takes it; a given
  ``axis_name`` must be the same axis. Other mesh axes (``("embed", "fsdp")``) stay on the
  stored params and their gradients; the matmul gets the kernel gathered over them. The
  rules are read when the layer is built. A bias with sharding metadata keeps it; one
  without gets the kernel's output-feature name (column) or none (row: replicated).

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import jaxflux
    >>> mesh = jax.make_mesh((jax.device_count(),), ("tp",))
    >>> with jax.set_mesh(mesh):
    ...   up = jaxflux.nnx.Linear(8, 32, rngs=nnx.Rngs(0), tensor_parallel="column")
    ...   down = jaxflux.nnx.Linear(32, 8, rngs=nnx.Rngs(1), tensor_parallel="row")
    ...   x = jnp.ones((2, 8 * jax.device_count(), 8))  # [batch, tokens, features]
    ...   y = nnx.jit(lambda x: down(nnx.gelu(up(x))))(x)
    >>> y.shape == x.shape
    True
    >>> nnx.get_partition_spec(nnx.state(up))["kernel"].get_value()
    P(None, 'tp')

  Args:
    in_features: the number of input features.
    out_features: the number of output features.
    use_bias: whether to add a bias to the output (default: True).
    dtype: the dtype of the computation (default: infer from input and params).
    param_dtype: the dtype passed to parameter initializers (default: float32).
    precision: numerical precision of the computation, see
      ``jax.lax.Precision``.
    kernel_init: initializer function for the weight matrix.
    bias_init: initializer function for the bias.
    dot_general: dot product function; only the default with
      ``tensor_parallel`` set.
    promote_dtype: function promoting the tuple ``(inputs, kernel, bias)`` to a
      common dtype, called as ``promote_dtype((inputs, kernel, bias), dtype=dtype)``.
    preferred_element_type: the dtype the matmul outputs (see ``jax.lax.dot``).
    rngs: rng key.
    kernel_metadata: metadata for the kernel ``Param``; a sharding in it (or from
      ``kernel_init``) is kept, see Logical axes.
    bias_metadata: metadata for the bias ``Param``, as for the kernel.
    tensor_parallel: ``None`` (plain ``flax.nnx.Linear``), ``"column"`` or
      ``"row"``; see above.
    axis_name: the mesh axis that shards the layer. Default None: the axis that the
      kernel's sharding puts its sharded dimension on (see Logical axes), else ``"tp"``.
      The built layer holds the resolved axis.
    token_axis: the input (and output) axis holding tokens, the axis that is
      gathered / scattered (default -2). Any axis but the last (feature) one;
      other values are moved to -2 around the op, which costs a transpose.
      The number of tokens must be divisible by the size of the axis. Not read
      with ``sequence_parallel=False``.
    mesh: the device mesh; default: the ambient mesh of ``jax.set_mesh``.
    impl: ``"auto"``, ``"fused"`` (fused kernel or an error) or ``"xla"``
      (pure-JAX reference); passed to the ops.
    sequence_parallel: ``True`` (default): tokens sharded between a column and a
      row layer; ``False``: tokens replicated (see above).
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    *,
    use_bias: bool = True,
    dtype: Dtype | None = None,
    param_dtype: Dtype = jnp.float32,
    precision: PrecisionLike = None,
    kernel_init: Initializer = linear.default_kernel_init,
    bias_init: Initializer = linear.default_bias_init,
    dot_general: DotGeneralT = lax.dot_general,
    promote_dtype: PromoteDtypeFn = dtypes.promote_dtype,
    preferred_element_type: Dtype | None = None,
    rngs: nnx.Rngs,
    kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
    bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    tensor_parallel: str | None = None,
    axis_name: str | None = None,
    token_axis: int = -2,
    mesh: jax.sharding.Mesh | None = None,
    impl: str = "auto",
    sequence_parallel: bool = True,
  ):
    tpm.check_config(
      "jaxflux.nnx.Linear",
      tensor_parallel=tensor_parallel,
      axis_name=axis_name,
      token_axis=token_axis,
      impl=impl,
      sequence_parallel=sequence_parallel,
    )
    param_specs = None
    if tensor_parallel is not None:
      if dot_general is not lax.dot_general:
        raise ValueError(
          f"jaxflux.nnx.Linear(tensor_parallel={tensor_parallel!r}): a custom dot_general "
          "is only supported with tensor_parallel=None; the tensor-parallel layer runs "
          "jaxflux's fused matmul instead."
        )
      axis_name, kernel_init, bias_init, param_specs = _tensor_parallel_params(
        tensor_parallel, axis_name, mesh, (in_features, out_features), param_dtype,
        kernel_init, kernel_metadata, bias_init, bias_metadata, use_bias,
      )
    super().__init__(
      in_features,
      out_features,
      use_bias=use_bias,
      dtype=dtype,
      param_dtype=param_dtype,
      precision=precision,
      kernel_init=kernel_init,
      bias_init=bias_init,
      dot_general=dot_general,
      promote_dtype=promote_dtype,
      preferred_element_type=preferred_element_type,
      rngs=rngs,
      kernel_metadata=kernel_metadata,
      bias_metadata=bias_metadata,
    )
    self.tensor_parallel = tensor_parallel
    self.axis_name = axis_name
    self.token_axis = token_axis
    self.mesh = mesh
    self.impl = impl
    self.sequence_parallel = sequence_parallel
    # The params' sharding as mesh axes, resolved with the rules active when they were made:
    # applied to them at each call (as linen's boxes do on unbox), so that on Auto axes their
    # gradients are constrained to it too.
    self._param_specs = param_specs

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    """Applies ``inputs @ kernel + bias`` over the last dimension of inputs.

    Args:
      inputs: ``[..., in_features]``; with ``tensor_parallel``, tokens at
        ``token_axis`` (global view, under ``jit`` with a mesh).
      out_sharding: as for ``flax.nnx.Linear``; only with
        ``tensor_parallel=None`` (the mode fixes the output sharding).

    Returns:
      ``[..., out_features]``, the layout of ``inputs``.
    """
    if self.tensor_parallel is None:
      return super().__call__(inputs, out_sharding)
    if out_sharding is not None:
      raise ValueError(
        f"jaxflux.nnx.Linear(tensor_parallel={self.tensor_parallel!r}): "
        "out_sharding is only supported with tensor_parallel=None; the output "
        "sharding follows from the mode (column: features sharded, row: tokens "
        "sharded). Reshard the result if you need another layout."
      )
    kernel_spec, bias_spec = self._param_specs
    kernel = tpm.apply_partitioning(self.kernel[...], kernel_spec, self.mesh)
    bias = None
    if self.bias is not None:
      bias = tpm.apply_partitioning(self.bias[...], bias_spec, self.mesh)
    inputs, kernel, bias = self.promote_dtype(
      (inputs, kernel, bias), dtype=self.dtype
    )
    return tpm.tensor_parallel_matmul(
      "jaxflux.nnx.Linear",
      inputs,
      kernel,
      bias,
      mode=self.tensor_parallel,
      axis_name=self.axis_name,
      token_axis=self.token_axis,
      mesh=self.mesh,
      impl=self.impl,
      precision=self.precision,
      preferred_element_type=self.preferred_element_type,
      sequence_parallel=self.sequence_parallel,
    )
