"""`jaxflux.MoE`: a top-k routed mixture-of-experts MLP (Flax Linen) on grouped matmuls."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta
from flax.typing import Dtype, Initializer, PrecisionLike

from jaxflux.layers import _moe
from jaxflux.layers.linen import _LogicallyPartitioned, _laid_out

__all__ = ["MoE"]


class MoE(nn.Module):
  """A mixture-of-experts MLP: each token goes through its top-k experts' MLPs.

  For ``x [..., hidden]``: router logits ``x @ gate`` in float32, a softmax, the top
  ``num_experts_per_tok`` experts per token (for k > 1 their probabilities renormalized to sum to
  1, as in Mixtral and Qwen3: ``norm_topk_prob``), and ``y = sum_j p_j * MLP_{e_j}(x)`` over them,
  with ``MLP_e(x) = (silu(x @ wi_0[e]) * (x @ wi_1[e])) @ wo[e]`` (``"swiglu"``) or
  ``gelu(x @ wi[e]) @ wo[e]`` (``"gelu"``, tanh approximation as ``flax.linen.gelu``). No
  capacity limit: no token is dropped. The (token, expert) pairs are sorted by expert and
  multiplied with ``jaxflux.grouped_matmul`` (``impl`` is passed to it).

  Params: ``gate [hidden, num_experts]`` (the router, no bias), ``wi_0`` and ``wi_1``
  (swiglu) or ``wi`` (gelu) ``[num_experts, hidden, intermediate_size]``, ``wo
  [num_experts, intermediate_size, hidden]``.

  Load-balancing loss: sown as ``intermediates/load_balancing_loss`` (``apply(...,
  mutable=["intermediates"])`` returns it, a 1-tuple), Switch Transformer's
  ``num_experts * sum_e f_e * P_e``: ``f_e`` the fraction of (token, expert) pairs routed to
  expert e, ``P_e`` its mean router probability; 1 when both are uniform. Add it, scaled
  (e.g. by 0.01), to the training loss.

  Expert load: sown beside it as ``intermediates/expert_load``, float32 ``[num_experts]``,
  the (token, expert) pairs routed to each expert over all tokens of the call (they sum to
  tokens * num_experts_per_tok): the rows each expert's grouped matmul computes, for
  watching the balance.

  Partitioning. The params come boxed in ``nn.LogicallyPartitioned`` with the logical names
  of ``gate_axes``, ``wi_axes`` and ``wo_axes`` (MaxText's by default); the active
  ``nn.logical_axis_rules`` map them to mesh axes (a name without a rule is replicated), as
  for ``jaxflux.Dense``. Under a mesh (``jax.set_mesh``) the expert MLP is split over the mesh
  axes that wi's expert dimension (``"exp"``: expert parallelism) and intermediate dimension
  (``"mlp"``: tensor parallelism) map to: each device multiplies by its own experts' slices
  and the outputs are summed over those axes. Each device keeps all the (token, expert) rows
  of its tokens (no all-to-all dispatch yet). Apply under the same rules as ``init``.

  Example usage::

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import jaxflux
    >>> moe = jaxflux.MoE(num_experts=4, num_experts_per_tok=2, intermediate_size=32)
    >>> x = jnp.ones((2, 5, 16))  # [batch, tokens, hidden]
    >>> variables = jax.jit(moe.init)(jax.random.key(0), x)
    >>> y, state = jax.jit(lambda v, x: moe.apply(v, x, mutable=["intermediates"]))(
    ...     variables, x)
    >>> y.shape, state["intermediates"]["load_balancing_loss"][0].shape
    ((2, 5, 16), ())
    >>> float(state["intermediates"]["expert_load"][0].sum())  # 10 tokens, 2 experts each
    20.0
    >>> nn.get_partition_spec(variables)["params"]["wi_0"]
    P('exp', 'embed', 'mlp')

  Attributes:
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
      layer boxes the params itself); default: LeCun normal over each expert's fan-in.
    router_init: initializer of the gate kernel.
    impl: ``"auto"``, ``"fused"`` (the fused grouped GEMM or an error) or ``"xla"``; passed
      to ``jaxflux.grouped_matmul``.
    gate_axes: logical axis names of gate's dimensions (default ``("embed", None)``).
    wi_axes: of wi_0 / wi_1 / wi (default ``("exp", "embed", "mlp")``).
    wo_axes: of wo (default ``("exp", "mlp", "embed")``).
  """

  num_experts: int
  num_experts_per_tok: int
  intermediate_size: int
  activation: str = "swiglu"
  norm_topk_prob: bool | None = None
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  precision: PrecisionLike = None
  kernel_init: Initializer = _moe.default_kernel_init
  router_init: Initializer = _moe.default_router_init
  impl: str = "auto"
  gate_axes: tuple = _moe.GATE_AXES
  wi_axes: tuple = _moe.WI_AXES
  wo_axes: tuple = _moe.WO_AXES

  def __post_init__(self):
    _moe.check_config(
      "jaxflux.MoE", num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
      intermediate_size=self.intermediate_size, activation=self.activation,
      norm_topk_prob=self.norm_topk_prob, dtype=self.dtype, impl=self.impl,
      gate_axes=self.gate_axes, wi_axes=self.wi_axes, wo_axes=self.wo_axes)
    super().__post_init__()

  def _param(self, name: str, init: Initializer, field: str, names: tuple, shape: tuple):
    """The param `name`, created boxed with logical `names` and laid out by the rules."""
    if self.is_initializing() and not self.has_variable("params", name):
      out = jax.eval_shape(lambda: init(jax.random.key(0), shape, self.param_dtype))
      if isinstance(out, meta.AxisMetadata):
        raise ValueError(
          f"jaxflux.MoE: {field} returns {type(out).__name__}; the layer boxes its params "
          "with the logical names of gate_axes / wi_axes / wo_axes itself. Pass a plain "
          "initializer and set those fields.")
    box = _LogicallyPartitioned(None, tuple(names))
    return self.param(name, _laid_out(init, box), shape, self.param_dtype)

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    """Routes each token of ``inputs [..., hidden]`` through its top-k experts.

    Returns:
      ``[..., hidden]`` in the compute dtype; sows the load-balancing loss and the expert
      load (see above).
    """
    layer = "jaxflux.MoE"
    hidden = _moe.check_hidden(layer, inputs, self._stored_hidden())
    experts, inter = self.num_experts, self.intermediate_size
    wi_spec = nn.logical_to_mesh_axes(tuple(self.wi_axes), nn.get_logical_axis_rules())
    _moe.check_split(layer, jax.sharding.get_abstract_mesh(), wi_spec, experts, inter)
    gate = self._param("gate", self.router_init, "router_init", self.gate_axes,
                       (hidden, experts))
    wi = tuple(self._param(name, self.kernel_init, "kernel_init", self.wi_axes,
                           (experts, hidden, inter))
               for name in _moe.expert_param_names(self.activation))
    wo = self._param("wo", self.kernel_init, "kernel_init", self.wo_axes,
                     (experts, inter, hidden))
    y, loss, load = _moe.moe_mlp(
      layer, inputs, gate, wi, wo, num_experts_per_tok=self.num_experts_per_tok,
      norm_topk_prob=self.norm_topk_prob, activation=self.activation, impl=self.impl,
      precision=self.precision, dtype=self.dtype, wi_spec=wi_spec)
    self.sow("intermediates", "load_balancing_loss", loss)
    self.sow("intermediates", "expert_load", load)
    return y

  def _stored_hidden(self) -> int | None:
    """The hidden size of existing params (None while initializing): an input of another size
    gets an error naming the sizes, not Flax's shape mismatch."""
    if not self.has_variable("params", "gate"):
      return None
    gate = self.get_variable("params", "gate")
    return jnp.shape(gate.value if isinstance(gate, meta.AxisMetadata) else gate)[0]
