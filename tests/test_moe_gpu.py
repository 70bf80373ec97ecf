"""jaxflux.MoE on one GPU: the fused grouped GEMM path (impl="fused") against the same layer on
XLA's ragged dot, forward and gradients, in bfloat16."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflux
from gpu_util import rel_err
from hlo_util import custom_call_targets


@pytest.mark.gpu
# The quick tier keeps one case (swiglu costs 9 s more on one H100).
@pytest.mark.parametrize("activation", [pytest.param("swiglu", marks=pytest.mark.slow), "gelu"])
def test_fused_layer_matches_ragged_dot_layer(activation):
  hidden, inter, experts, k = 512, 1024, 8, 2
  x = jax.random.normal(jax.random.key(0), (4, 250, hidden), jnp.float32).astype(jnp.bfloat16)
  layers = {impl: jaxflux.MoE(experts, k, inter, activation=activation, impl=impl,
                              dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
            for impl in ("fused", "xla")}
  params = jax.jit(layers["xla"].init)(jax.random.key(1), x)["params"]

  def loss(params, x, impl):
    y = layers[impl].apply({"params": params}, x)
    return jnp.mean(jnp.square(y.astype(jnp.float32))), y

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
  assert "jaxflux_grouped_gemm" in grad.lower(params, x, "fused").as_text()
  (_, y_fused), g_fused = grad(params, x, "fused")
  (_, y_xla), g_xla = grad(params, x, "xla")
  assert y_fused.dtype == jnp.bfloat16
  assert rel_err(y_fused, y_xla) <= 1e-2
  for got, want in zip(jax.tree.leaves(g_fused), jax.tree.leaves(g_xla)):
    assert rel_err(got, want) <= 2e-2
  assert np.all(np.isfinite(np.asarray(y_fused, np.float32)))


@pytest.mark.gpu
@pytest.mark.quick_once()
@pytest.mark.parametrize("transpose_w", [False, True], ids=["w-GKN", "w-GNK"])
def test_moe_ops_at_tp1_run_the_grouped_kernel(transpose_w):
  """The tensor-parallel MoE ops on a one-device mesh, impl="fused": no rank to talk to, each
  segment's products on the grouped GEMM kernel. The expert MLP (gather, GELU, combine) forward
  and backward, including the router weights' gradient, against the same ops on XLA's path;
  empty experts and a pair routed nowhere included."""
  from jax.sharding import AxisType, PartitionSpec as P
  m, k, n, out, experts, topk = 200, 256, 384, 256, 6, 2
  keys = jax.random.split(jax.random.key(6), 5)
  x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
  w1 = (jax.random.normal(keys[1], (experts, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
  w2 = (jax.random.normal(keys[2], (experts, n, out)) / np.sqrt(n)).astype(jnp.bfloat16)
  if transpose_w:
    w1, w2 = w1.transpose(0, 2, 1), w2.transpose(0, 2, 1)
  ids = jax.random.randint(keys[3], (m, topk), 0, experts - 2)  # the last two experts empty
  ids = ids.at[0, 0].set(experts)  # one pair routed nowhere
  weights = jax.random.uniform(keys[4], (m, topk), jnp.float32, 0.1, 1.0)
  mesh = jax.make_mesh((1,), ("tp",), (AxisType.Auto,), devices=jax.devices()[:1])

  def mlp(x, w1, w2, weights, impl):
    def local(x, w1, w2, ids, weights):
      routing = jaxflux.moe_routing(ids, experts, "tp")
      y = jaxflux.all_gather_grouped_matmul(x, w1, routing, axis_name="tp", impl=impl,
                                            transpose_w=transpose_w)
      h = jax.nn.gelu(y.astype(jnp.float32)).astype(y.dtype)
      return jaxflux.grouped_matmul_reduce_scatter(h, w2, routing, weights, axis_name="tp",
                                                   impl=impl, transpose_w=transpose_w)
    tokens, cols, rows = P("tp"), P(None, None, "tp"), P(None, "tp")  # tp=1: whole arrays
    w1_spec, w2_spec = (rows, cols) if transpose_w else (cols, rows)
    return jax.shard_map(local, mesh=mesh, in_specs=(tokens, w1_spec, w2_spec, tokens, tokens),
                         out_specs=tokens)(x, w1, w2, ids, weights)

  def loss(x, w1, w2, weights, impl):
    z = mlp(x, w1, w2, weights, impl)
    return jnp.sum(z.astype(jnp.float32) ** 2), z

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True),
                 static_argnums=4)
  targets = custom_call_targets(grad.lower(x, w1, w2, weights, "fused").compile().as_text())
  ours = {t: c for t, c in targets.items() if t.startswith("jaxflux_")}
  # the forward's two products and at least dx's and dh's in the backward (dw's too, unless
  # fused away), on the grouped kernel alone
  assert set(ours) == {"jaxflux_grouped_gemm"} and ours["jaxflux_grouped_gemm"] >= 4, targets
  (_, z_fused), g_fused = grad(x, w1, w2, weights, "fused")
  (_, z_xla), g_xla = grad(x, w1, w2, weights, "xla")
  assert z_fused.dtype == jnp.bfloat16 and rel_err(z_fused, z_xla) <= 1e-2
  for name, got, want in zip(("dx", "dw1", "dw2", "dweights"), g_fused, g_xla):
    assert rel_err(got, want) <= 2e-2, name


@pytest.mark.gpu
def test_expert_parallel_layer_runs_the_ragged_all_to_all():
  """The experts over a one-device "ep" axis with the tokens (the expert-parallel path): on a GPU
  the rows move by XLA's ragged all-to-all (in the lowered program), and the layer's output
  and gradients equal the same layer's without a mesh."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((1,), ("ep",), (AxisType.Explicit,), devices=jax.devices()[:1])
  layer = jaxflux.MoE(4, 2, 128, impl="xla", dtype=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST)  # float32 products, no TF32
  x = jax.random.normal(jax.random.key(7), (96, 64), jnp.float32)
  params = nn.unbox(jax.jit(layer.init)(jax.random.key(8), x)["params"])
  loss = lambda p, x: jnp.sum(jnp.square(layer.apply({"params": p}, x)))  # noqa: E731
  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  want_loss, want = grad(params, x)
  with jax.set_mesh(mesh), nn.logical_axis_rules((("exp", "ep"),)):
    xs = jax.device_put(x, NamedSharding(mesh, P("ep")))
    # the experts' weights on "ep" (their expert dimension), the router's kernel replicated
    params = {k: jax.device_put(v, NamedSharding(mesh, P() if k == "gate" else P("ep")))
              for k, v in params.items()}
    assert "ragged_all_to_all" in grad.lower(params, xs).as_text()
    got_loss, got = grad(params, xs)
  assert rel_err(got_loss, want_loss) <= 1e-5
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert rel_err(a, b) <= 1e-4


@pytest.mark.gpu
@pytest.mark.slow
def test_fused_layer_under_a_mesh_with_expert_rules():
  """Under jax.set_mesh with the experts' intermediate dimension on tp (the layer's shard_map
  path), as examples/train_tp_transformer.py --moe runs it: gradients equal the XLA path's."""
  from jax.sharding import AxisType
  import flax.linen as nn
  mesh = jax.make_mesh((1, 1), ("dp", "tp"), axis_types=(AxisType.Explicit, AxisType.Auto),
                       devices=jax.devices()[:1])
  rules = (("exp", None), ("embed", None), ("mlp", "tp"))
  x = jax.random.normal(jax.random.key(2), (2, 256, 256), jnp.float32).astype(jnp.bfloat16)
  grads = {}
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    for impl in ("fused", "xla"):
      layer = jaxflux.MoE(4, 2, 512, impl=impl, dtype=jnp.bfloat16)
      params = jax.jit(layer.init)(jax.random.key(3), x)["params"]
      loss = lambda p, x: jnp.mean(jnp.square(layer.apply({"params": p}, x).astype(jnp.float32)))
      grads[impl] = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
  for got, want in zip(jax.tree.leaves(grads["fused"]), jax.tree.leaves(grads["xla"])):
    assert rel_err(got, want) <= 2e-2


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_fused_layer_on_zero_tokens_and_top_1(k):
  """No tokens: an empty output and zero gradients on the kernel path. Top-1 (the router
  probability as the weight, the default): the fused layer's gate gradient is the XLA layer's."""
  hidden, inter, experts = 256, 512, 4
  layers = {impl: jaxflux.MoE(experts, k, inter, impl=impl, dtype=jnp.bfloat16,
                              param_dtype=jnp.bfloat16) for impl in ("fused", "xla")}
  x = jax.random.normal(jax.random.key(4), (2, 128, hidden), jnp.float32).astype(jnp.bfloat16)
  params = nn.unbox(jax.jit(layers["xla"].init)(jax.random.key(5), x)["params"])
  loss = lambda impl: jax.jit(jax.grad(lambda p, x: jnp.sum(jnp.square(
      layers[impl].apply({"params": p}, x).astype(jnp.float32)))))
  empty = jnp.zeros((0, hidden), jnp.bfloat16)
  assert jax.jit(layers["fused"].apply)({"params": params}, empty).shape == (0, hidden)
  for g in jax.tree.leaves(loss("fused")(params, empty)):
    assert not np.any(np.asarray(g, np.float32))
  got, want = loss("fused")(params, x), loss("xla")(params, x)
  assert np.abs(np.asarray(want["gate"], np.float32)).max() > 0
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert rel_err(a, b) <= 2e-2
