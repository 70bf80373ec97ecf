"""`jaxflux.nnx.Linear`: `flax.nnx.Linear` with fused tensor-parallel matmuls."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes, linear
from flax.typing import DotGeneralT, Dtype, Initializer, PrecisionLike, PromoteDtypeFn
from jax import lax

from jaxflux import _tensor_parallel as tpm

__all__ = ["Linear"]

# Metadata keys under which flax (old and new spellings) stores a Param's sharding.
_SHARDING_KEYS = ("out_sharding", "sharding", "sharding_names")


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
    kernel_metadata: metadata for the kernel ``Param``; with ``tensor_parallel``
      set, it must not hold a sharding (the layer sets it).
    bias_metadata: metadata for the bias ``Param``, as for the kernel.
    tensor_parallel: ``None`` (plain ``flax.nnx.Linear``), ``"column"`` or
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
    axis_name: str = "tp",
    token_axis: int = -2,
    mesh: jax.sharding.Mesh | None = None,
    impl: str = "auto",
  ):
    tpm.check_config(
      "jaxflux.nnx.Linear",
      tensor_parallel=tensor_parallel,
      axis_name=axis_name,
      token_axis=token_axis,
      impl=impl,
    )
    if tensor_parallel is not None:
      self._check_tensor_parallel_args(
        tensor_parallel, axis_name, mesh, in_features, out_features,
        dot_general, kernel_metadata, bias_metadata,
      )
      kernel_names, bias_names = tpm.param_partitioning(tensor_parallel, axis_name)
      kernel_init = nnx.with_partitioning(kernel_init, kernel_names, mesh)
      bias_init = nnx.with_partitioning(bias_init, bias_names, mesh)
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

  @staticmethod
  def _check_tensor_parallel_args(
    mode, axis_name, mesh, in_features, out_features,
    dot_general, kernel_metadata, bias_metadata,
  ) -> None:
    layer = f"jaxflux.nnx.Linear(tensor_parallel={mode!r})"
    if dot_general is not lax.dot_general:
      raise ValueError(
        f"{layer}: a custom dot_general is only supported with "
        "tensor_parallel=None; the tensor-parallel layer runs jaxflux's fused "
        "matmul instead."
      )
    for name, metadata in (("kernel_metadata", kernel_metadata),
                           ("bias_metadata", bias_metadata)):
      clash = [k for k in _SHARDING_KEYS if k in metadata]
      if clash:
        raise ValueError(
          f"{layer}: {name} sets {clash}, but the layer sets the params' "
          "sharding from tensor_parallel and axis_name; drop it from "
          f"{name}."
        )
    # Params with sharding metadata are placed on the mesh when created (flax's
    # eager sharding), so the mesh and an even split are needed now.
    if mesh is not None or nnx.using_eager_sharding():
      mesh = tpm.resolve_mesh("jaxflux.nnx.Linear", mode, mesh, axis_name)
      tpm.check_divisible(
        "jaxflux.nnx.Linear", mode, axis_name, mesh.shape[axis_name],
        in_features, out_features,
      )

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
    kernel = self.kernel[...]
    bias = self.bias[...] if self.bias is not None else None
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
    )
