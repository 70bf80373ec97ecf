"""`jaxflux.Dense`: `flax.linen.Dense` with fused tensor-parallel matmuls."""

from __future__ import annotations

import flax.linen as nn
import jax
from jax import lax

from jaxflux import _tensor_parallel as tpm

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
    return tpm.apply_partitioning(self.value, self.names, self.mesh)


def _with_partitioning(init, names: tuple, mesh):
  """`nn.with_partitioning` with `_Partitioned`; the new value is laid out already, over
  `mesh` (the layer's field) or, when it is None, the ambient mesh."""

  def wrapped(*args, **kwargs):
    value = tpm.apply_partitioning(init(*args, **kwargs), names, mesh)
    return _Partitioned(value, names, mesh)

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
    dot_general_cls: dot product class; only with ``tensor_parallel=None``.
    tensor_parallel: ``None`` (plain ``flax.linen.Dense``), ``"column"`` or
      ``"row"``; see above.
    axis_name: the mesh axis that shards the layer (default ``"tp"``).
    token_axis: the input (and output) axis holding tokens, the axis that is
      gathered / scattered (default -2). Any axis but the last (feature) one;
      other values are moved to -2 around the op, which costs a transpose.
      The number of tokens must be divisible by the size of the axis.
    mesh: the device mesh; default: the ambient mesh of ``jax.set_mesh``.
    impl: ``"auto"``, ``"fused"`` (fused kernel or an error) or ``"xla"``
      (pure-JAX reference); passed to the ops.
  """

  tensor_parallel: str | None = None
  axis_name: str = "tp"
  token_axis: int = -2
  mesh: jax.sharding.Mesh | None = None
  impl: str = "auto"

  def __post_init__(self):
    tpm.check_config(
      "jaxflux.Dense",
      tensor_parallel=self.tensor_parallel,
      axis_name=self.axis_name,
      token_axis=self.token_axis,
      impl=self.impl,
    )
    if self.tensor_parallel is not None and (
      self.dot_general is not None or self.dot_general_cls is not None
    ):
      raise ValueError(
        f"jaxflux.Dense(tensor_parallel={self.tensor_parallel!r}): dot_general "
        "and dot_general_cls are only supported with tensor_parallel=None; the "
        "tensor-parallel layer runs jaxflux's fused matmul instead."
      )
    super().__post_init__()

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
    kernel_init, bias_init = self.kernel_init, self.bias_init
    if mode is not None:
      # Check before creating params: an uneven split fails less clearly there.
      mesh = tpm.resolve_mesh("jaxflux.Dense", mode, self.mesh, self.axis_name)
      tpm.check_divisible(
        "jaxflux.Dense", mode, self.axis_name, mesh.shape[self.axis_name],
        inputs.shape[-1], self.features,
      )
      kernel_names, bias_names = tpm.param_partitioning(mode, self.axis_name)
      kernel_init = _with_partitioning(kernel_init, kernel_names, self.mesh)
      bias_init = _with_partitioning(bias_init, bias_names, self.mesh)

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

    return tpm.tensor_parallel_matmul(
      "jaxflux.Dense",
      inputs,
      kernel,
      bias,
      mode=mode,
      axis_name=self.axis_name,
      token_axis=self.token_axis,
      mesh=self.mesh,
      impl=self.impl,
      precision=self.precision,
      preferred_element_type=None,  # flax.linen.Dense has no such field
    )
