"""`jaxflux.nnx.MoE`: a top-k routed mixture-of-experts MLP (Flax NNX) on grouped matmuls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd as flax_spmd
from flax.typing import Dtype, Initializer, PrecisionLike

from jaxflux.layers import _moe, _tensor_parallel as tpm

__all__ = ["MoE"]


def _sharding_names(names: tuple, mesh) -> tuple:
  """The Param's `out_sharding`: `names`, less those that neither the active rules map nor the
  mesh has (replicated, as a Linen logical name without a rule; flax would take them as mesh
  axes and fail). Without a mesh there is nothing to check against: all of them."""
  if mesh.empty:
    return tuple(names)
  rules = dict(flax_spmd.get_logical_axis_rules())
  return tuple(n if n in rules or n in mesh.axis_names else None for n in names)


class MoE(nnx.Module):
  """A mixture-of-experts MLP: each token goes through its top-k experts' MLPs.

  The NNX counterpart of ``jaxflux.MoE`` (see there for the math): the same params, as
  ``nnx.Param`` attributes (``gate``, ``wi_0`` / ``wi_1`` or ``wi``, ``wo``), the same results.

  Load-balancing loss: ``model(x, return_load_balancing_loss=True)`` returns ``(y, loss)``.
  (Storing it on the module would mutate the module at every call, which fails for a module
  closed over by ``jax.jit`` / ``nnx.jit``.) Expert load: ``return_expert_load=True`` returns
  ``jaxflux.MoE``'s ``expert_load`` too, float32 ``[num_experts]``, the (token, expert) pairs
  routed to each expert over all tokens of the call; with both flags ``(y, loss, load)``.

  Partitioning. Each Param's ``out_sharding`` is the logical names of ``gate_axes``,
  ``wi_axes`` or ``wo_axes`` (MaxText's by default); flax maps them through the active
  ``nnx.logical_axis_rules`` and places the Param when it is made under a mesh
  (``jax.set_mesh``). A name that the rules do not map and that is no mesh axis is left out
  (replicated, as in Linen). Without a mesh the names are kept but nothing is placed. The
  expert MLP is split over the mesh axes of wi's expert and intermediate dimensions, as in
  ``jaxflux.MoE``; the rules are read when the layer is built.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import jaxflux
    >>> moe = jaxflux.nnx.MoE(16, num_experts=4, num_experts_per_tok=2, intermediate_size=32,
    ...                       rngs=nnx.Rngs(0))
    >>> x = jnp.ones((2, 5, 16))  # [batch, tokens, hidden]
    >>> y, loss = nnx.jit(lambda x: moe(x, return_load_balancing_loss=True))(x)
    >>> y.shape, loss.shape
    ((2, 5, 16), ())
    >>> moe.wi_0.get_metadata()["out_sharding"]
    ('exp', 'embed', 'mlp')

  Args:
    hidden_size: the input's (and output's) last dimension H.
    num_experts: the number of experts E.
    num_experts_per_tok: experts per token k, 1 to num_experts.
    intermediate_size: each expert's hidden size I.
    activation: ``"swiglu"`` (default) or ``"gelu"``.
    norm_topk_prob: renormalize the top-k probabilities to sum to 1; None (default):
      when num_experts_per_tok > 1. With one expert per token the weight stays its router
      probability (Switch Transformer): renormalized it would be 1, leaving the router no
      gradient from the task loss (True there warns).
    dtype: the dtype of the expert computation (default: infer from input and params). The
      router and the weighted sum over experts run in float32.
    param_dtype: the dtype passed to parameter initializers (default: float32).
    precision: numerical precision of the matmuls, see ``jax.lax.Precision``.
    kernel_init: initializer of the expert kernels wi_* and wo (a plain initializer: the
      layer sets the Params' sharding itself); default: LeCun normal over each expert's fan-in.
    router_init: initializer of the gate kernel.
    impl: ``"auto"``, ``"fused"`` (the fused grouped GEMM or an error) or ``"xla"``; passed
      to ``jaxflux.grouped_matmul``.
    gate_axes: logical axis names of gate's dimensions (default ``("embed", None)``).
    wi_axes: of wi_0 / wi_1 / wi (default ``("exp", "embed", "mlp")``).
    wo_axes: of wo (default ``("exp", "mlp", "embed")``).
    rngs: rng key.
  """

  def __init__(
    self,
    hidden_size: int,
    num_experts: int,
    num_experts_per_tok: int,
    intermediate_size: int,
    *,
    activation: str = "swiglu",
    norm_topk_prob: bool | None = None,
    dtype: Dtype | None = None,
    param_dtype: Dtype = jnp.float32,
    precision: PrecisionLike = None,
    kernel_init: Initializer = _moe.default_kernel_init,
    router_init: Initializer = _moe.default_router_init,
    impl: str = "auto",
    gate_axes: tuple = _moe.GATE_AXES,
    wi_axes: tuple = _moe.WI_AXES,
    wo_axes: tuple = _moe.WO_AXES,
    rngs: nnx.Rngs,
  ):
    layer = "jaxflux.nnx.MoE"
    if not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or hidden_size < 1:
      raise ValueError(f"{layer}: hidden_size={hidden_size!r} must be a positive int.")
    _moe.check_config(
      layer, num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
      intermediate_size=intermediate_size, activation=activation,
      norm_topk_prob=norm_topk_prob, dtype=dtype, impl=impl, gate_axes=gate_axes,
      wi_axes=wi_axes, wo_axes=wo_axes)
    self.hidden_size = hidden_size
    self.num_experts = num_experts
    self.num_experts_per_tok = num_experts_per_tok
    self.intermediate_size = intermediate_size
    self.activation = activation
    self.norm_topk_prob = norm_topk_prob
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.impl = impl
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
      wi_spec = flax_spmd.get_pspec(_sharding_names(wi_axes, mesh))
      _moe.check_split(layer, mesh, wi_spec, num_experts, intermediate_size)
    specs = {}

    def make(name, init, field, names, shape):
      value = init(rngs.params(), shape, param_dtype)
      if isinstance(value, nnx.VariableMetadata):
        raise ValueError(
          f"{layer}: {field} returns nnx.VariableMetadata (e.g. nnx.with_partitioning); the "
          "layer sets its Params' sharding from gate_axes / wi_axes / wo_axes itself. Pass a "
          "plain initializer and set those arguments.")
      names = _sharding_names(names, mesh)
      # Flax places a Param with out_sharding when it is made, which needs a mesh.
      extra = {} if not mesh.empty else {"eager_sharding": False}
      setattr(self, name, nnx.Param(value, out_sharding=names, **extra))
      # As mesh axes, resolved now (as flax resolves them to place the Param).
      specs[name] = None if mesh.empty else tuple(flax_spmd.get_pspec(names))

    h, e, i = hidden_size, num_experts, intermediate_size
    make("gate", router_init, "router_init", gate_axes, (h, e))
    for name in _moe.expert_param_names(activation):
      make(name, kernel_init, "kernel_init", wi_axes, (e, h, i))
    make("wo", kernel_init, "kernel_init", wo_axes, (e, i, h))
    self._param_specs = tuple(sorted(specs.items()))

  def __call__(self, inputs: jax.Array, *, return_load_balancing_loss: bool = False,
               return_expert_load: bool = False):
    """Routes each token of ``inputs [..., hidden_size]`` through its top-k experts.

    Returns:
      ``y [..., hidden_size]`` in the compute dtype; with ``return_load_balancing_loss``,
      ``(y, loss)``, the float32 scalar loss of ``jaxflux.MoE``; with ``return_expert_load``,
      ``(y, load)``, float32 ``[num_experts]``; with both, ``(y, loss, load)``.
    """
    specs = dict(self._param_specs)

    def value(name):
      # Laid out as stored (as Linen's boxes do on unbox): on Auto axes the gradients too.
      v = getattr(self, name)[...]
      return v if specs[name] is None else tpm.apply_partitioning(v, specs[name])

    y, loss, load = _moe.moe_mlp(
      "jaxflux.nnx.MoE", inputs, value("gate"),
      tuple(value(n) for n in _moe.expert_param_names(self.activation)), value("wo"),
      num_experts_per_tok=self.num_experts_per_tok, norm_topk_prob=self.norm_topk_prob,
      activation=self.activation, impl=self.impl, precision=self.precision, dtype=self.dtype,
      wi_spec=specs[_moe.expert_param_names(self.activation)[0]])
    extra = (loss,) * bool(return_load_balancing_loss) + (load,) * bool(return_expert_load)
    return (y, *extra) if extra else y
