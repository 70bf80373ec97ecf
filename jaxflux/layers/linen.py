"""`jaxflux.Dense`: `flax.linen.Dense` with fused tensor-parallel matmuls."""

from __future__ import annotations

import flax.linen as nn
import jax
from flax.core import meta
from flax.typing import Dtype, Initializer
from jax import lax

from jaxflux.layers import _fp8_recipe, _tensor_parallel as tpm

__all__ = ["Dense"]


class _Partitioned(nn.Partitioned):
  """`nn.Partitioned` that also works on Explicit mesh axes.

  Flax applies the partitioning on unbox with `with_sharding_constraint`, which
  refuses Explicit axes (the default of `jax.make_mesh`) on mixed meshes and
  only asserts on all-Explicit ones; this reshards over those instead.
  """

  def unbox(self, apply_constraint=True):
    if not apply_constraint:
      return self.value
    return tpm.apply_partitioning(self.value, _mesh_names(self), self.mesh)


class _LogicallyPartitioned(nn.LogicallyPartitioned):
  """`nn.LogicallyPartitioned` that also works on Explicit mesh axes (see `_Partitioned`).

  Its names stay logical (`nn.get_partition_spec` gives them, `nn.logical_to_mesh_sharding`
  maps them); unboxing lays the value out over the mesh axes that its rules, else the active
  `nn.logical_axis_rules`, map them to, as Flax does.
  """

  def unbox(self, apply_constraint=True):
    if not apply_constraint:
      return self.value
    return tpm.apply_partitioning(self.value, _mesh_names(self), self.mesh)


def _mesh_names(box: nn.Partitioned) -> tuple:
  """A box's partitioning as mesh axes: logical names through their rules (the box's own,
  else the active ones), as Flax maps them; plain `nn.Partitioned` names are mesh axes."""
  if isinstance(box, nn.LogicallyPartitioned):
    rules = box.rules if box.rules is not None else nn.get_logical_axis_rules()
    return tuple(nn.logical_to_mesh_axes(box.names, rules))
  return tuple(box.names)


def _user_box(init: Initializer, shape: tuple, dtype: Dtype,
              field: str) -> nn.Partitioned | None:
  """The partitioning box that `init` returns (`nn.with_partitioning`,
  `nn.with_logical_partitioning`), or None; `init` is only traced, not run."""
  out = jax.eval_shape(lambda: init(jax.random.key(0), shape, dtype))
  if isinstance(out, nn.Partitioned):
    return out
  if isinstance(out, meta.AxisMetadata):
    raise ValueError(
      f"jaxflux.Dense: {field} returns {type(out).__name__}; a tensor-parallel layer takes "
      "a plain initializer, or one wrapped in nn.with_partitioning / "
      "nn.with_logical_partitioning."
    )
  return None


def _template(box: nn.Partitioned, mesh: jax.sharding.Mesh | None) -> nn.Partitioned:
  """`box`'s metadata (names, rules, mesh: else the layer's) in a box of ours, no value."""
  mesh = box.mesh if box.mesh is not None else mesh
  if isinstance(box, nn.LogicallyPartitioned):
    return _LogicallyPartitioned(None, box.names, mesh=mesh, rules=box.rules)
  return _Partitioned(None, box.names, mesh=mesh)


def _laid_out(init: Initializer, template: nn.Partitioned) -> Initializer:
  """`init` whose value (unboxed if `init` boxes it) is laid out per `template` over its mesh
  or, when it is None, the ambient mesh, and boxed like `template`."""

  def wrapped(*args, **kwargs):
    value = init(*args, **kwargs)
    if isinstance(value, nn.Partitioned):
      value = value.value
    return template.replace_boxed(
      tpm.apply_partitioning(value, _mesh_names(template), template.mesh))

  return wrapped


class Dense(nn.Dense):
  """A linear transformation over the last dimension, optionally tensor-parallel.

  A drop-in for ``flax.linen.Dense`` (it subclasses it): the same fields, order,
  defaults and params (``kernel [in, features]``, ``bias [features]``), so
  checkpoints load either way once unboxed (tensor-parallel params come boxed in
  ``nn.Partitioned``, as with ``nn.with_partitioning``: save ``nn.unbox(variables)``).
  With ``tensor_parallel`` set, the matmul runs
  sharded over one mesh axis, with its collective fused into the matmul:

  - ``"column"``: tokens sharded over the axis in, features sharded out
    (``jaxflux.all_gather_matmul``). Params: kernel ``P(None, axis)``,
    bias ``P(axis)``.
  - ``"row"``: input features sharded in, tokens sharded out
    (``jaxflux.matmul_reduce_scatter``). Params: kernel ``P(axis, None)``,
    bias replicated.

  A column layer followed by a row layer is a sequence-parallel MLP: tokens are
  sharded between the pair and gathered / scattered inside the fused matmuls.

  With ``sequence_parallel=False`` (Megatron's plain tensor parallelism) tokens are
  never sharded: a column layer takes them replicated and multiplies locally (no
  communication), a row layer gives its output replicated through
  ``jaxflux.matmul_all_reduce``. The params, their partitioning and checkpoints are
  the same either way.

  Logical axes (FSDP x TP). A ``kernel_init`` wrapped in
  ``nn.with_logical_partitioning(init, ("embed", "mlp"))`` keeps its names: the params
  come boxed as ``nn.LogicallyPartitioned`` with those names and rules, as Flax makes
  them, so ``nn.get_partition_spec`` and ``nn.logical_to_mesh_sharding(spec, mesh,
  rules)`` give the model's shardings. The rules (the box's own, else the active
  ``nn.logical_axis_rules``) must map the kernel's sharded dimension (column: output
  features, row: input features) to exactly one mesh axis, else a ValueError names the
  logical axis and the rules: that axis is the layer's tensor-parallel axis. With
  ``axis_name`` left None the layer takes it; a given ``axis_name`` must be the same
  axis. Other mesh axes in the rules (``("embed", "fsdp")``) stay on the stored params
  and their gradients; the matmul gets the kernel gathered over them, as for any FSDP
  weight. A ``bias_init`` wrapped the same way keeps its names too; an unwrapped one
  gets the kernel's output-feature name (column) or none (row: replicated).
  ``nn.with_partitioning`` boxes work alike, their names being mesh axes.

  FP8. ``dot_general_cls=nn.Fp8DirectDotGeneralOp`` (or the deprecated
  ``nn.Fp8DotGeneralOp``, the same math) runs Flax's FP8 recipe with the fused FP8 matmuls:
  the same submodule and variables as ``flax.linen.Dense`` with that class (six
  ``_overwrite_with_gradient`` variables, whose gradients are their new values: overwrite
  them with their gradients after each step, as with Flax), the same delayed-scaling updates
  with the amax taken over the whole (global) tensor, e4m3 forward and e5m2 output
  gradient. The matmul runs in the kernel's dtype (after ``dtype`` promotion), as Flax's.
  With ``sequence_parallel=False`` a row layer's forward runs the FP8
  ``jaxflux.matmul_all_reduce``; the rest (a column layer's forward, both backwards) needs no
  communication and runs local XLA FP8 matmuls.

  Example usage::

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import jaxflux
    >>> mesh = jax.make_mesh((jax.device_count(),), ("tp",))
    >>> class MLP(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     h = jaxflux.Dense(4 * 8, tensor_parallel="column")(x)
    ...     return jaxflux.Dense(8, tensor_parallel="row")(nn.gelu(h))
    >>> x = jnp.ones((2, 8 * jax.device_count(), 8))  # [batch, tokens, features]
    >>> with jax.set_mesh(mesh):
    ...   variables = jax.jit(MLP().init)(jax.random.key(0), x)
    ...   y = jax.jit(MLP().apply)(variables, x)
    >>> y.shape == x.shape
    True
    >>> nn.get_partition_spec(variables)["params"]["Dense_0"]["kernel"]
    P(None, 'tp')

  Attributes:
    features: the number of output features.
    use_bias: whether to add a bias to the output (default: True).
    dtype: the dtype of the computation (default: infer from input and params).
    param_dtype: the dtype passed to parameter initializers (default: float32).
    precision: numerical precision of the computation, see
      ``jax.lax.Precision``.
    kernel_init: initializer function for the weight matrix.
    bias_init: initializer function for the bias.
    promote_dtype: function promoting ``(inputs, kernel, bias)`` to a common
      dtype, called as ``promote_dtype(inputs, kernel, bias, dtype=dtype)``.
    dot_general: dot product function; only with ``tensor_parallel=None``.
    dot_general_cls: dot product class. With ``tensor_parallel`` set, only Flax's FP8
      recipe: ``nn.Fp8DirectDotGeneralOp`` or ``nn.Fp8DotGeneralOp`` (see FP8).
    tensor_parallel: ``None`` (plain ``flax.linen.Dense``), ``"column"`` or
      ``"row"``; see above.
    axis_name: the mesh axis that shards the layer. Default None: the axis that a
      partitioned ``kernel_init`` puts its sharded dimension on (see Logical axes),
      else ``"tp"``.
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

  tensor_parallel: str | None = None
  axis_name: str | None = None
  token_axis: int = -2
  mesh: jax.sharding.Mesh | None = None
  impl: str = "auto"
  sequence_parallel: bool = True

  def __post_init__(self):
    tpm.check_config(
      "jaxflux.Dense",
      tensor_parallel=self.tensor_parallel,
      axis_name=self.axis_name,
      token_axis=self.token_axis,
      impl=self.impl,
      sequence_parallel=self.sequence_parallel,
    )
    if self.tensor_parallel is not None and self.dot_general is not None:
      raise ValueError(
        f"jaxflux.Dense(tensor_parallel={self.tensor_parallel!r}): a dot_general function "
        "is only supported with tensor_parallel=None; the tensor-parallel layer runs "
        "jaxflux's fused matmul instead. For FP8 training pass "
        "dot_general_cls=nn.Fp8DirectDotGeneralOp (Flax's recipe, run through the fused "
        "FP8 matmuls)."
      )
    if self.tensor_parallel is not None and self.dot_general_cls is not None:
      _fp8_recipe.check_dot_general_cls(
        "jaxflux.Dense", self.tensor_parallel, self.dot_general_cls)
    super().__post_init__()

  def _tensor_parallel_params(
    self, mode: str, in_features: int
  ) -> tuple[str, str | None, Initializer, Initializer]:
    """The tensor-parallel axis, where it came from (None: axis_name or the default), and
    the kernel and bias initializers that box and lay out the params.

    A kernel_init that boxes its value (nn.with_partitioning / nn.with_logical_partitioning)
    keeps its names; its sharded dimension names the axis (tpm.axis_from_partitioning).
    Otherwise the params get the mode's partitioning over the axis. A bias_init without a
    box gets the bias partitioning that goes with the kernel's.
    """
    layer = "jaxflux.Dense"
    shape = (in_features, self.features)
    kernel_box = _user_box(self.kernel_init, shape, self.param_dtype, "kernel_init")
    origin = None
    if kernel_box is None:
      axis = self.axis_name or tpm.DEFAULT_AXIS
      kernel = _Partitioned(None, tpm.param_partitioning(mode, axis)[0], mesh=self.mesh)
    else:
      kernel = _template(kernel_box, self.mesh)
      spec = _mesh_names(kernel)
      rules = None
      if isinstance(kernel, nn.LogicallyPartitioned):
        rules = kernel.rules if kernel.rules is not None else nn.get_logical_axis_rules()
      axis = tpm.axis_from_partitioning(
        layer, mode, self.axis_name, names=kernel.names, spec=spec, rules=rules,
        source="kernel_init")
      origin = tpm.axis_origin(mode, kernel.names, spec, "kernel_init")
    bias_box = None
    if self.use_bias:
      bias_box = _user_box(self.bias_init, (self.features,), self.param_dtype, "bias_init")
    if bias_box is None:
      bias = kernel.replace(names=tpm.bias_partitioning(mode, kernel.names))
    else:
      bias = _template(bias_box, self.mesh)
    return axis, origin, _laid_out(self.kernel_init, kernel), _laid_out(self.bias_init, bias)

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    """Applies ``inputs @ kernel + bias`` over the last dimension of inputs.

    Args:
      inputs: ``[..., in_features]``; with ``tensor_parallel``, tokens at
        ``token_axis`` (global view, under ``jit`` with a mesh).

    Returns:
      ``[..., features]``, the layout of ``inputs``.
    """
    mode = self.tensor_parallel
    kernel_init, bias_init, axis = self.kernel_init, self.bias_init, None
    if mode is not None:
      axis, origin, kernel_init, bias_init = self._tensor_parallel_params(
        mode, inputs.shape[-1])
      # Check before creating params: an uneven split fails less clearly there.
      mesh = tpm.resolve_mesh("jaxflux.Dense", mode, self.mesh, axis, origin)
      tpm.check_divisible(
        "jaxflux.Dense", mode, axis, mesh.shape[axis], inputs.shape[-1], self.features)

    kernel = self.param(
      "kernel", kernel_init, (inputs.shape[-1], self.features), self.param_dtype
    )
    bias = (
      self.param("bias", bias_init, (self.features,), self.param_dtype)
      if self.use_bias
      else None
    )
    inputs, kernel, bias = self.promote_dtype(
      inputs, kernel, bias, dtype=self.dtype
    )

    if mode is None:
      # Exactly flax.linen.Dense.
      if self.dot_general_cls is not None:
        dot_general = self.dot_general_cls()
      elif self.dot_general is not None:
        dot_general = self.dot_general
      else:
        dot_general = lax.dot_general
      y = dot_general(
        inputs,
        kernel,
        (((inputs.ndim - 1,), (0,)), ((), ())),
        precision=self.precision,
      )
      if bias is not None:
        y += bias.reshape((1,) * (y.ndim - 1) + (-1,))
      return y

    fp8_meta = None
    if self.dot_general_cls is not None:
      # Flax's FP8 recipe: the submodule flax.linen.Dense creates (same class, same name,
      # e.g. Fp8DirectDotGeneralOp_0) holds its six variables; the recipe reads them, and
      # their gradients are their new values, as with flax.linen.Dense.
      fp8_op = self.dot_general_cls()
      fp8_meta = tuple(getattr(fp8_op, name).value for name in _fp8_recipe.META_NAMES)
    return tpm.tensor_parallel_matmul(
      "jaxflux.Dense",
      inputs,
      kernel,
      bias,
      mode=mode,
      axis_name=axis,
      token_axis=self.token_axis,
      mesh=self.mesh,
      impl=self.impl,
      precision=self.precision,
      preferred_element_type=None,  # flax.linen.Dense has no such field
      sequence_parallel=self.sequence_parallel,
      fp8_meta=fp8_meta,
    )
