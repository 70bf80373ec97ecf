"""jaxflux.MoE (Linen) and jaxflux.nnx.MoE against a dense per-expert reference, on 8 virtual CPU
devices (pure-JAX path): values, gradients, the load-balancing loss, dtypes, validation, and the
expert-parallel split over a mesh."""

import functools
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxflux
import jaxflux.nnx
from conftest import assert_trees_close, mesh_of
from jaxpr_util import equations, ffi_calls

EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto
HIDDEN, INTER = 16, 24
EXPERT_NAMES = {"swiglu": ("wi_0", "wi_1"), "gelu": ("wi",)}


def normal(rng, shape, scale=1.0):
  # NumPy, not jax.random: eager jax ops each compile, which dominates a CPU test run.
  return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def random_params(seed, num_experts, activation, hidden=HIDDEN, inter=INTER):
  """Random params with the layer's names; the router at scale 1 so that routing is decisive."""
  rng = np.random.default_rng(seed)
  params = {"gate": normal(rng, (hidden, num_experts))}
  for name in EXPERT_NAMES[activation]:
    params[name] = normal(rng, (num_experts, hidden, inter), hidden ** -0.5)
  params["wo"] = normal(rng, (num_experts, inter, hidden), inter ** -0.5)
  return params


def random_x(seed, shape):
  return normal(np.random.default_rng(seed), shape)


def reference(params, x, k, activation, norm_topk_prob=None):
  """Every token through every expert (dense einsums), each expert's output weighted by the
  token's routing weight for it (0 outside its top k; renormalized over the top k where
  norm_topk_prob says, None: for k > 1); and the Switch load-balancing loss."""
  x2 = x.reshape(-1, x.shape[-1])
  probs = jax.nn.softmax(x2 @ params["gate"], axis=-1)
  top, chosen = jax.lax.top_k(probs, k)
  if k > 1 if norm_topk_prob is None else norm_topk_prob:
    top = top / top.sum(-1, keepdims=True)
  num_experts = probs.shape[-1]
  y = jnp.zeros_like(x2)
  for e in range(num_experts):
    weight = jnp.sum(jnp.where(chosen == e, top, 0.0), axis=-1)  # [T]
    if activation == "swiglu":
      h = (jax.nn.silu(jnp.einsum("th,hi->ti", x2, params["wi_0"][e]))
           * jnp.einsum("th,hi->ti", x2, params["wi_1"][e]))
    else:
      h = jax.nn.gelu(jnp.einsum("th,hi->ti", x2, params["wi"][e]))
    y = y + weight[:, None] * jnp.einsum("ti,ih->th", h, params["wo"][e])
  fraction = jnp.mean(jnp.sum(jax.nn.one_hot(chosen, num_experts), axis=1), axis=0) / k
  loss = num_experts * jnp.sum(fraction * jnp.mean(probs, axis=0))
  return y.reshape(x.shape), loss


def sum_of_squares(y):
  return jnp.sum(jnp.square(y.astype(jnp.float32)))


def linen_run(layer, params, x):
  """y, the sown loss, and d(sum y^2)/d(params, x), under jit."""
  def loss(params, x):
    y, state = layer.apply({"params": params}, x, mutable=["intermediates"])
    return sum_of_squares(y), (y, state["intermediates"]["load_balancing_loss"][0])

  (_, (y, aux)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
    params, x)
  return y, aux, grads


@functools.cache
def reference_run(seed, num_experts, k, activation, x_shape, norm_topk_prob=None):
  params, x = random_params(seed, num_experts, activation), random_x(seed + 1, x_shape)
  ref = functools.partial(reference, k=k, activation=activation, norm_topk_prob=norm_topk_prob)
  y, aux = jax.jit(ref)(params, x)
  grads = jax.jit(jax.grad(lambda p, x: sum_of_squares(ref(p, x)[0]), argnums=(0, 1)))(params, x)
  return params, x, y, aux, grads


CASES = [  # (num_experts, k, x shape): odd token counts, a batch, k = 1 and 2, E = 4 and 8.
  (4, 1, (13, HIDDEN)),
  (4, 2, (3, 5, HIDDEN)),
  (8, 2, (2, 7, HIDDEN)),
  (8, 1, (1, HIDDEN)),
]


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("num_experts,k,x_shape", CASES)
def test_linen_matches_dense_reference(activation, num_experts, k, x_shape):
  params, x, y_ref, aux_ref, grads_ref = reference_run(3, num_experts, k, activation, x_shape)
  layer = jaxflux.MoE(num_experts, k, INTER, activation=activation, impl="xla")
  y, aux, grads = linen_run(layer, params, x)
  assert y.shape == x.shape and y.dtype == jnp.float32
  assert_trees_close(y, y_ref)
  np.testing.assert_allclose(aux, aux_ref, rtol=1e-5)
  assert_trees_close(grads, grads_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_without_renormalized_top_k():
  params, x, y_ref, _, grads_ref = reference_run(5, 8, 2, "swiglu", (9, HIDDEN), False)
  y, _, grads = linen_run(jaxflux.MoE(8, 2, INTER, norm_topk_prob=False), params, x)
  assert_trees_close(y, y_ref)
  assert_trees_close(grads, grads_ref, rtol=1e-4, atol=1e-5)


def test_top_1_weights_by_the_router_probability_and_trains_the_router():
  """k = 1 by default keeps the chosen expert's router probability as its weight (Switch
  Transformer), so the task loss reaches the gate; renormalized it would be 1 (no gradient),
  which norm_topk_prob=True still gives, with a warning that says so."""
  params, x, y_ref, _, grads_ref = reference_run(3, 4, 1, "swiglu", (13, HIDDEN))
  y, _, grads = linen_run(jaxflux.MoE(4, 1, INTER, impl="xla"), params, x)
  assert_trees_close(y, y_ref)
  assert_trees_close(grads, grads_ref, rtol=1e-4, atol=1e-5)
  assert np.abs(grads[0]["gate"]).max() > 1e-3 * np.abs(grads[0]["wo"]).max()

  with pytest.warns(UserWarning, match="norm_topk_prob=True with num_experts_per_tok=1 makes "
                                       "every routing weight 1"):
    layer = jaxflux.MoE(4, 1, INTER, norm_topk_prob=True, impl="xla")
  with pytest.warns(UserWarning, match="jaxflux.nnx.MoE: norm_topk_prob=True"):
    jaxflux.nnx.MoE(HIDDEN, 4, 1, INTER, norm_topk_prob=True, rngs=nnx.Rngs(0))

  def task_loss(gate):
    return sum_of_squares(layer.apply({"params": {**params, "gate": gate}}, x))
  with warnings.catch_warnings():  # Linen clones the layer in apply: the same warning again
    warnings.simplefilter("ignore", UserWarning)
    assert np.abs(jax.grad(task_loss)(params["gate"])).max() < 1e-6  # routing weight 1: none


@pytest.mark.parametrize("shape", [(0, HIDDEN), (2, 0, HIDDEN)], ids=["no-tokens", "empty-seq"])
def test_zero_tokens_give_an_empty_output(shape):
  params = random_params(0, 4, "swiglu")
  x = jnp.zeros(shape, jnp.float32)
  y, aux, grads = linen_run(jaxflux.MoE(4, 2, INTER, impl="xla"), params, x)
  assert y.shape == shape and np.isfinite(aux)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  model = jaxflux.nnx.MoE(HIDDEN, 4, 2, INTER, impl="xla", rngs=nnx.Rngs(0))
  assert model(x).shape == shape


def test_init_params_and_loss_range():
  layer = jaxflux.MoE(8, 2, INTER, activation="gelu")
  x = random_x(0, (4, 6, HIDDEN))
  variables = jax.jit(layer.init)(jax.random.key(0), x)
  shapes = jax.tree.map(jnp.shape, nn.unbox(variables))["params"]
  assert shapes == {"gate": (HIDDEN, 8), "wi": (8, HIDDEN, INTER), "wo": (8, INTER, HIDDEN)}
  wi = np.asarray(nn.unbox(variables)["params"]["wi"])
  assert 0.5 < wi.std() * np.sqrt(HIDDEN) < 1.5  # fan-in scaling per expert
  _, state = jax.jit(lambda v, x: layer.apply(v, x, mutable=["intermediates"]))(variables, x)
  (aux,) = state["intermediates"]["load_balancing_loss"]
  assert 1.0 <= float(aux) <= 8.0  # 1 at perfect balance, E when one expert takes all


def reference_load(params, x, k):
  """(token, expert) pairs per expert: NumPy's top k of the float32 router logits, counted."""
  logits = np.asarray(x, np.float32).reshape(-1, x.shape[-1]) @ np.asarray(params["gate"])
  chosen = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
  return np.bincount(chosen.ravel(), minlength=logits.shape[-1]).astype(np.float32)


@pytest.mark.parametrize("case", [None, "dp2_tp4_sequence_parallel", "dp2_ep2_tp2_fsdp"])
def test_expert_load_counts_the_routed_pairs(case):
  params, x = random_params(3, 8, "swiglu"), random_x(4, (4, 8, HIDDEN))
  want = reference_load(params, x, 2)
  assert want.sum() == 64 and len(set(want)) > 1  # uneven: a wrong count can't hide
  layer = jaxflux.MoE(8, 2, INTER)
  load = jax.jit(lambda p, x: layer.apply({"params": p}, x, mutable=["intermediates"])[1][
      "intermediates"]["expert_load"][0])
  if case is None:
    got = load(params, x)
  else:  # tokens sharded: every device's count is of all tokens, not its own
    shape, names, rules, x_spec = MESHES[case]
    mesh = mesh_of(shape, names, EXPLICIT)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      variables = jax.jit(layer.init)(jax.random.key(0), x)
      sharded = {k: jax.device_put(v, variables["params"][k].value.sharding)
                 for k, v in params.items()}
      got = load(sharded, jax.device_put(x, NamedSharding(mesh, x_spec)))
  np.testing.assert_array_equal(np.asarray(got), want)
  if case is not None:
    return
  model = jaxflux.nnx.MoE(HIDDEN, 8, 2, INTER, rngs=nnx.Rngs(0))
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  both, only_load = nnx.jit(lambda m, x: (
      m(x, return_load_balancing_loss=True, return_expert_load=True),
      m(x, return_expert_load=True)[1]))(model, x)
  y, loss, nnx_load = both
  assert y.shape == x.shape and loss.shape == ()
  np.testing.assert_array_equal(np.asarray(nnx_load), want)
  np.testing.assert_array_equal(np.asarray(only_load), want)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.slow
def test_nnx_equals_linen(activation):
  params, x, y_ref, aux_ref, _ = reference_run(7, 4, 2, activation, (3, 5, HIDDEN))
  model = nnx.jit(lambda: jaxflux.nnx.MoE(HIDDEN, 4, 2, INTER, activation=activation,
                                         rngs=nnx.Rngs(0)))()
  state = nnx.state(model, nnx.Param)
  assert set(nnx.to_pure_dict(state)) == set(params)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  y, aux = nnx.jit(lambda m, x: m(x, return_load_balancing_loss=True))(model, x)
  y_linen, aux_linen, _ = linen_run(jaxflux.MoE(4, 2, INTER, activation=activation), params, x)
  np.testing.assert_array_equal(y, y_linen)
  assert float(aux) == float(aux_linen)
  assert_trees_close(y, y_ref)
  assert nnx.jit(lambda m, x: m(x))(model, x).shape == x.shape  # y alone by default

  def loss(model, x):
    return sum_of_squares(model(x))

  grads = nnx.jit(nnx.grad(loss))(model, x)
  _, _, (linen_grads, _) = linen_run(jaxflux.MoE(4, 2, INTER, activation=activation), params, x)
  assert_trees_close(nnx.to_pure_dict(grads), linen_grads)


def test_xla_and_auto_agree_and_fused_raises_on_cpu():
  params, x = random_params(1, 4, "swiglu"), random_x(2, (2, 5, HIDDEN))
  ys = {impl: jax.jit(jaxflux.MoE(4, 2, INTER, impl=impl).apply)({"params": params}, x)
        for impl in ("xla", "auto")}
  np.testing.assert_array_equal(ys["xla"], ys["auto"])
  if jaxflux.has_cuda():
    pytest.skip("the fused kernel may run here")
  layer = jaxflux.MoE(4, 2, INTER, impl="fused", dtype=jnp.bfloat16)
  with pytest.raises(jaxflux.FusedKernelUnavailableError, match="grouped_matmul"):
    jax.jit(layer.apply)({"params": params}, x)


@pytest.mark.slow
def test_bfloat16_compute_with_float32_params():
  params, x, y_ref, _, _ = reference_run(11, 8, 2, "swiglu", (4, 8, HIDDEN))
  layer = jaxflux.MoE(8, 2, INTER, dtype=jnp.bfloat16)
  y = jax.jit(layer.apply)({"params": params}, x)
  assert y.dtype == jnp.bfloat16
  err = np.max(np.abs(np.asarray(y, np.float32) - np.asarray(y_ref)))
  assert 0 < err < 3e-2 * np.max(np.abs(np.asarray(y_ref))), err
  grads = jax.jit(jax.grad(lambda p: sum_of_squares(layer.apply({"params": p}, x))))(params)
  assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
  # A bfloat16 input with float32 params computes in float32, as flax's promotion does.
  y32 = jax.jit(jaxflux.MoE(8, 2, INTER).apply)({"params": params}, x.astype(jnp.bfloat16))
  assert y32.dtype == jnp.float32


@pytest.mark.parametrize("kwargs,match", [
  (dict(num_experts_per_tok=5), r"num_experts_per_tok=5 must be an int from 1 to num_experts=4"),
  (dict(num_experts_per_tok=0), r"num_experts_per_tok=0"),
  (dict(num_experts=0), r"num_experts=0 must be a positive int"),
  (dict(intermediate_size=2.5), r"intermediate_size=2.5"),
  (dict(activation="relu"), r"activation='relu' is not one of \('swiglu', 'gelu'\)"),
  (dict(impl="cutlass"), r"impl='cutlass' is not one of"),
  (dict(norm_topk_prob=1), r"norm_topk_prob=1 must be a bool"),
  (dict(dtype=jnp.int8), r"dtype=.*not a floating dtype"),
  (dict(wi_axes=("exp", "embed")), r"wi_axes=\('exp', 'embed'\) must be a tuple of 3"),
])
def test_bad_arguments_raise_at_construction(kwargs, match):
  base = dict(num_experts=4, num_experts_per_tok=2, intermediate_size=INTER)
  with pytest.raises(ValueError, match=match):
    jaxflux.MoE(**{**base, **kwargs})
  with pytest.raises(ValueError, match=match.replace("jaxflux.MoE", "jaxflux.nnx.MoE")):
    jaxflux.nnx.MoE(HIDDEN, **{**base, **kwargs}, rngs=nnx.Rngs(0))


def test_bad_inputs_raise_at_trace_time():
  layer = jaxflux.MoE(4, 2, INTER)
  params = {"params": random_params(0, 4, "swiglu")}
  with pytest.raises(TypeError, match=r"jaxflux.MoE: the input must be a floating-point"):
    jax.eval_shape(layer.init, jax.random.key(0), jnp.zeros((3, HIDDEN), jnp.int32))
  with pytest.raises(ValueError, match=r"input has shape \(3, 8\).*hidden size .* is 16"):
    jax.eval_shape(layer.apply, params, jnp.zeros((3, 8)))
  model = jaxflux.nnx.MoE(HIDDEN, 4, 2, INTER, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"jaxflux.nnx.MoE: the input has shape \(3, 8\)"):
    model(jnp.zeros((3, 8)))
  boxed = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("exp", "embed", "mlp"))
  with pytest.raises(ValueError, match=r"kernel_init returns LogicallyPartitioned.*wi_axes"):
    jax.eval_shape(jaxflux.MoE(4, 2, INTER, kernel_init=boxed).init, jax.random.key(0),
                   jnp.zeros((3, HIDDEN)))
  with pytest.raises(ValueError, match=r"kernel_init returns nnx.VariableMetadata"):
    jaxflux.nnx.MoE(HIDDEN, 4, 2, INTER, rngs=nnx.Rngs(0),
                    kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                                      ("exp", "embed", "mlp")))


def test_logical_names_on_the_params():
  layer = jaxflux.MoE(4, 2, INTER)
  boxed = jax.eval_shape(layer.init, jax.random.key(0), jnp.zeros((3, HIDDEN)))["params"]
  assert all(isinstance(v, nn.LogicallyPartitioned) for v in boxed.values())
  assert nn.get_partition_spec(boxed) == {
    "gate": P("embed", None), "wi_0": P("exp", "embed", "mlp"),
    "wi_1": P("exp", "embed", "mlp"), "wo": P("exp", "mlp", "embed")}
  custom = jaxflux.MoE(4, 2, INTER, gate_axes=("hidden", None), wi_axes=("e", None, "ff"),
                       wo_axes=("e", "ff", None))
  boxed = jax.eval_shape(custom.init, jax.random.key(0), jnp.zeros((3, HIDDEN)))["params"]
  assert nn.get_partition_spec(boxed)["wo"] == P("e", "ff", None)


# (mesh shape, axis names, rules, x's sharding): experts over 'ep' with the batch over 'dp',
# the tokens over the experts' axis (gathered, then reduce-scattered), experts and their
# intermediate dimension over 'ep' and 'tp' with the tokens over 'tp', and the 8-way split.
MESHES = {
  "dp2_ep4": ((2, 4), ("dp", "ep"), (("exp", "ep"),), P("dp")),
  "tokens_on_ep": ((2, 4), ("dp", "ep"), (("exp", "ep"),), P("ep")),
  "ep2_tp4": ((2, 4), ("ep", "tp"), (("exp", "ep"), ("mlp", "tp")), P(None, "tp")),
  "dp2_ep2_tp2_fsdp": ((2, 2, 2), ("dp", "ep", "tp"),
                       (("exp", "ep"), ("mlp", "tp"), ("embed", "dp")), P("dp", "tp")),
  "ep8": ((8,), ("ep",), (("exp", "ep"),), P()),
  # Tensor parallelism with sequence-parallel tokens: the fused MoE ops' split.
  "tp4_sequence_parallel": ((4,), ("tp",), (("mlp", "tp"),), P(None, "tp")),
  "dp2_tp4_sequence_parallel": ((2, 4), ("dp", "tp"), (("mlp", "tp"),), P("dp", "tp")),
}


def mesh_spec(names, rules):
  return nn.logical_to_mesh_axes(names, rules)


@pytest.mark.parametrize("axis_type", [EXPLICIT, AUTO])
@pytest.mark.parametrize("case", sorted(MESHES))
@pytest.mark.slow
def test_sharded_over_experts_matches_unsharded(case, axis_type):
  shape, names, rules, x_spec = MESHES[case]
  mesh = mesh_of(shape, names, axis_type)
  layer = jaxflux.MoE(8, 2, INTER)
  params, x, y_ref, aux_ref, grads_ref = reference_run(13, 8, 2, "swiglu", (4, 8, HIDDEN))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    variables = jax.jit(layer.init)(jax.random.key(0), x)
    for name, box in variables["params"].items():
      assert isinstance(box, nn.LogicallyPartitioned)
      assert box.value.sharding.is_equivalent_to(
        NamedSharding(mesh, mesh_spec(box.names, rules)), box.value.ndim), name
    xs = jax.device_put(x, NamedSharding(mesh, x_spec))
    params_sharded = {k: jax.device_put(v, variables["params"][k].value.sharding)
                      for k, v in params.items()}
    y, aux, grads = linen_run(layer, params_sharded, xs)
  assert_trees_close(y, y_ref)
  np.testing.assert_allclose(aux, aux_ref, rtol=1e-5)
  assert_trees_close(grads, grads_ref, rtol=1e-4, atol=1e-5)
  if axis_type == EXPLICIT:  # The tokens keep their sharding, the grads their params'.
    assert jax.typeof(y).sharding.spec == P(*x_spec, *[None] * (3 - len(x_spec)))
    for name, g in grads[0].items():
      assert g.sharding.is_equivalent_to(params_sharded[name].sharding, g.ndim), name


# Expert parallelism with the tokens on the experts' axis: each (token, expert) pair's row goes
# to its expert's device and back (two all-to-alls), instead of every device seeing every token.
@pytest.mark.parametrize("devices, num_experts, k, activation, tokens", [
    (8, 8, 2, "swiglu", 3),    # one expert per device, 3 tokens each
    pytest.param(8, 16, 1, "gelu", 5, marks=pytest.mark.slow),    # two per device, top-1
    pytest.param(8, 16, 4, "swiglu", 2, marks=pytest.mark.slow),  # more pairs than tokens
    (1, 4, 2, "swiglu", 6),    # a one-device mesh
])
def test_expert_parallel_dispatch_matches_and_sends_only_rows(devices, num_experts, k,
                                                              activation, tokens):
  mesh = mesh_of((devices,), ("ep",))
  rules = (("exp", "ep"),)
  layer = jaxflux.MoE(num_experts, k, INTER, activation=activation)
  params, x, y_ref, aux_ref, grads_ref = reference_run(23 + k, num_experts, k, activation,
                                                       (devices * tokens, HIDDEN))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    variables = jax.jit(layer.init)(jax.random.key(0), x)
    sharded = {name: jax.device_put(v, variables["params"][name].value.sharding)
               for name, v in params.items()}
    xs = jax.device_put(x, NamedSharding(mesh, P("ep")))
    y, aux, grads = linen_run(layer, sharded, xs)
    loss = lambda p, x: sum_of_squares(layer.apply({"params": p}, x))  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(sharded, xs)
  assert_trees_close(y, y_ref)
  np.testing.assert_allclose(aux, aux_ref, rtol=1e-5)
  assert_trees_close(grads, grads_ref, rtol=1e-4, atol=1e-5)
  primitives = {eqn.primitive.name for eqn in equations(jaxpr)}
  # The rows move by all-to-all, forward and backward; no device gathers the tokens.
  assert "all_to_all" in primitives and "all_gather" not in primitives, primitives


EP_RULES = (("exp", "ep"),)


def expert_parallel_grads(layer, params, x):
  """(mesh, the layer's loss gradient function, the params and x placed for it) with the
  experts and the tokens over an 8-device "ep" axis; trace the function under
  `jax.set_mesh(mesh)` and `nn.logical_axis_rules(EP_RULES)`."""
  mesh = mesh_of((8,), ("ep",))
  boxes = jax.eval_shape(layer.init, jax.random.key(0), x)["params"]
  sharded = {k: jax.device_put(v, NamedSharding(mesh, mesh_spec(boxes[k].names, EP_RULES)))
             for k, v in params.items()}
  loss = lambda p, x: sum_of_squares(layer.apply({"params": p}, x))  # noqa: E731
  return mesh, jax.grad(loss, argnums=(0, 1)), sharded, jax.device_put(
      x, NamedSharding(mesh, P("ep")))


def test_expert_parallel_gpu_program_moves_rows_by_ragged_all_to_all():
  """Lowered for CUDA (jax.export: no GPU needed), the expert-parallel train step moves its rows
  and ids with XLA's ragged all-to-all, there and back, forward and backward; the all_to_all
  equivalent the CPU runs (the test above) is not in it, only the row counts' small
  all-to-alls."""
  layer = jaxflux.MoE(8, 2, INTER)
  mesh, grads, params, x = expert_parallel_grads(
      layer, random_params(31, 8, "swiglu"), random_x(32, (24, HIDDEN)))
  with jax.set_mesh(mesh), nn.logical_axis_rules(EP_RULES):
    exported = jax.export.export(
        jax.jit(grads), platforms=("cuda",),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")])(
            params, x)
  text = exported.mlir_module()
  ragged = text.count("@ragged_all_to_all(")
  # forward: rows and ids out, rows back; backward: the transposes of the two row exchanges
  assert ragged >= 5, ragged
  # every plain all-to-all carries [devices] int32 counts or offsets, none a row
  all_to_alls = [line for line in text.splitlines() if '"stablehlo.all_to_all"' in line]
  assert all_to_alls and all(re.search(r"-> tensor<8xi32>", a) for a in all_to_alls)


def test_expert_parallel_dispatch_runs_the_grouped_kernel(fake_hopper):
  """impl="fused" under expert parallelism: each device's experts on the grouped GEMM kernel
  (traced, not run), forward and backward, the rows moved by the ragged exchange."""
  layer = jaxflux.MoE(8, 2, 32, impl="fused", dtype=jnp.bfloat16)
  mesh, grads, params, x = expert_parallel_grads(
      layer, random_params(29, 8, "swiglu", inter=32), random_x(30, (16, HIDDEN)))
  with jax.set_mesh(mesh), nn.logical_axis_rules(EP_RULES):
    jaxpr = jax.make_jaxpr(grads)(params, x)
  assert {target for target, _ in ffi_calls(jaxpr)} == {"jaxflux_grouped_gemm"}
  primitives = {eqn.primitive.name for eqn in equations(jaxpr)}
  assert {"ragged_all_to_all", "all_to_all"} <= primitives, primitives


# Tensor parallelism with sequence-parallel tokens (the intermediate dimension and the tokens on
# one axis, the experts whole): the layer runs the MoE ops, all_gather_grouped_matmul ->
# activation -> grouped_matmul_reduce_scatter.
TP_RULES = (("mlp", "tp"),)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_tensor_parallel_split_runs_the_moe_ops_and_matches(activation):
  mesh = mesh_of((2,), ("tp",))
  layer = jaxflux.MoE(4, 2, INTER, activation=activation, impl="xla")
  params, x, y_ref, aux_ref, grads_ref = reference_run(17, 4, 2, activation, (2, 6, HIDDEN))
  with jax.set_mesh(mesh), nn.logical_axis_rules(TP_RULES):
    variables = jax.jit(layer.init)(jax.random.key(0), x)
    sharded = {k: jax.device_put(v, variables["params"][k].value.sharding)
               for k, v in params.items()}
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "tp")))
    y, aux, grads = linen_run(layer, sharded, xs)
  assert_trees_close(y, y_ref)
  np.testing.assert_allclose(aux, aux_ref, rtol=1e-5)
  assert_trees_close(grads, grads_ref, rtol=1e-4, atol=1e-5)


def test_tensor_parallel_split_calls_the_fused_moe_ops(fake_hopper):
  """With the kernels (faked: traced, not run), forward and backward hold both fused MoE calls
  and no XLA collective: impl="fused" gathers the expert ids, sums the load-balancing
  statistics and the router kernel's gradient with jaxflux's all-gather too."""
  mesh = mesh_of((2,), ("tp",))
  layer = jaxflux.MoE(4, 2, 32, impl="fused", dtype=jnp.bfloat16)  # 16 columns per device
  params, x = random_params(19, 4, "swiglu", inter=32), random_x(20, (2, 6, HIDDEN))
  with jax.set_mesh(mesh), nn.logical_axis_rules(TP_RULES):
    boxes = jax.eval_shape(layer.init, jax.random.key(0), x)["params"]
    sharded = {k: jax.device_put(v, NamedSharding(mesh, mesh_spec(boxes[k].names, TP_RULES)))
               for k, v in params.items()}
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "tp")))
    def loss(p, x):  # the task loss and the sown load-balancing loss, every param's gradient
      y, state = layer.apply({"params": p}, x, mutable=["intermediates"])
      return sum_of_squares(y) + state["intermediates"]["load_balancing_loss"][0]

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(sharded, xs)
  targets = {target for target, _ in ffi_calls(jaxpr)}
  assert {"jaxflux_all_gather_grouped_matmul", "jaxflux_grouped_matmul_reduce_scatter",
          "jaxflux_all_gather"} <= targets, targets
  collectives = {p for p in (eqn.primitive.name for eqn in equations(jaxpr))
                 if p.startswith("psum") or p in ("all_gather", "reduce_scatter",
                                                   "psum_scatter", "all_to_all")}
  assert not collectives, collectives
  # A layer given a precision runs the same fused ops (the precision is the XLA path's).
  precise = jaxflux.MoE(4, 2, 32, impl="fused", dtype=jnp.bfloat16,
                        precision=jax.lax.Precision.HIGHEST)
  with jax.set_mesh(mesh), nn.logical_axis_rules(TP_RULES):
    jaxpr = jax.make_jaxpr(lambda p, x: precise.apply({"params": p}, x))(sharded, xs)
  assert {"jaxflux_all_gather_grouped_matmul", "jaxflux_grouped_matmul_reduce_scatter"} <= {
      target for target, _ in ffi_calls(jaxpr)}


@pytest.mark.slow
def test_expert_weights_are_never_gathered():
  """Expert parallelism, not FSDP: each device multiplies by its own experts; the forward
  communicates only the outputs' all-reduce."""
  shape, names, rules, x_spec = MESHES["dp2_ep4"]
  mesh = mesh_of(shape, names)
  layer = jaxflux.MoE(8, 2, INTER)
  x = random_x(0, (4, 8, HIDDEN))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    variables = jax.jit(layer.init)(jax.random.key(0), x)
    xs = jax.device_put(x, NamedSharding(mesh, x_spec))
    hlo = jax.jit(layer.apply).lower(variables, xs).compile().as_text()
  collectives = re.findall(r"(all-gather|all-reduce|reduce-scatter|all-to-all)\(", hlo)
  assert set(collectives) == {"all-reduce"}, collectives


def test_uneven_expert_split_raises():
  mesh = mesh_of((4,), ("ep",))
  with jax.set_mesh(mesh), nn.logical_axis_rules((("exp", "ep"),)):
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by 4.*wi_axes\[0\]"):
      jax.eval_shape(jaxflux.MoE(6, 2, INTER).init, jax.random.key(0), jnp.zeros((8, HIDDEN)))
    with pytest.raises(ValueError, match=r"jaxflux.nnx.MoE: num_experts=6 is not divisible"):
      jaxflux.nnx.MoE(HIDDEN, 6, 2, INTER, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("axis_type", [EXPLICIT, AUTO])
@pytest.mark.slow
def test_nnx_sharded_over_experts(axis_type):
  shape, names, rules, x_spec = MESHES["dp2_ep4"]
  mesh = mesh_of(shape, names, axis_type)
  params, x, y_ref, _, _ = reference_run(17, 8, 2, "swiglu", (4, 8, HIDDEN))
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules + (("embed", None), ("mlp", None))):
    model = nnx.jit(lambda: jaxflux.nnx.MoE(HIDDEN, 8, 2, INTER, rngs=nnx.Rngs(0)))()
    assert model.wi_1.get_metadata()["out_sharding"] == ("exp", "embed", "mlp")
    assert model.gate.get_metadata()["out_sharding"] == ("embed", None)
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    assert specs["wo"].get_value() == P("ep", None, None)
    assert model.wo[...].sharding.is_equivalent_to(NamedSharding(mesh, P("ep")), 3)
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, {k: jax.device_put(v, getattr(model, k)[...].sharding)
                                     for k, v in params.items()})
    nnx.update(model, state)
    y = nnx.jit(lambda m, x: m(x))(model, jax.device_put(x, NamedSharding(mesh, x_spec)))
  assert_trees_close(y, y_ref)


@pytest.mark.slow
def test_nnx_without_rules_or_mesh():
  # No mesh: the names are kept as metadata, nothing is placed. A mesh without rules: names that
  # are no mesh axis are left out (replicated), as a Linen name without a rule.
  model = jaxflux.nnx.MoE(HIDDEN, 4, 2, INTER, rngs=nnx.Rngs(0))
  assert model.wi_0.get_metadata()["out_sharding"] == ("exp", "embed", "mlp")
  with jax.set_mesh(mesh_of((8,), ("exp",))):
    model = jaxflux.nnx.MoE(HIDDEN, 8, 2, INTER, rngs=nnx.Rngs(0))
    y = nnx.jit(lambda m, x: m(x))(model, random_x(0, (5, HIDDEN)))
  assert model.wi_0.get_metadata()["out_sharding"] == ("exp", None, None)
  assert model.wi_0[...].sharding.spec == P("exp", None, None)
  assert y.shape == (5, HIDDEN)


@pytest.mark.parametrize("module", ["jaxflux.layers.moe_linen", "jaxflux.layers.moe_nnx"])
def test_docstring_examples_run(module):
  import doctest
  import importlib

  assert doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS).failed == 0
