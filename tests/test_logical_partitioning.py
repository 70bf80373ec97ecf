"""Logical partitioning (MaxText-style): kernels declared with logical axis names keep them, the
rules pick the tensor-parallel mesh axis, and other mesh axes (FSDP) stay on the stored params
and their gradients. Against flax.linen.Dense / flax.nnx.Linear with the same partitioning and
rules, in float32 on 8 virtual CPU devices (pure-JAX path)."""

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

EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto
FSDP_TP = (("batch", "fsdp"), ("embed", "fsdp"), ("mlp", "tp"))
# (mesh shape, axis names, axis type, rules, the tp axis, the batch axis of x).
MESHES = {
  "tp_named_model": ((4,), ("model",), EXPLICIT, (("embed", None), ("mlp", "model")), "model",
                     None),
  "fsdp2_tp4": ((2, 4), ("fsdp", "tp"), EXPLICIT, FSDP_TP, "tp", "fsdp"),
  "fsdp4_tp2_auto": ((4, 2), ("fsdp", "tp"), AUTO, FSDP_TP, "tp", "fsdp"),
}
# Logical names of (kernel, bias) per layer; the MLP is column (up) then row (down).
NAMES = {"up": (("embed", "mlp"), ("mlp",)), "down": (("mlp", "embed"), ("embed",))}
MODES = {"up": "column", "down": "row"}


def normal(seed, shape):
  # NumPy, not jax.random: eager jax ops each compile, which dominates a CPU test run.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def loss_and_grad(apply, params, x):
  """y and d(sum(y * r))/d(params, x) for a fixed random r, under jit."""
  def loss(params, x):
    y = apply(params, x)
    return jnp.sum(y * normal(99, y.shape)), y

  (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return y, grads


def mesh_spec(names, rules) -> P:
  return nn.logical_to_mesh_axes(names, rules)


def check_sharding(array, mesh, spec):
  assert array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim), (
    array.sharding, spec)
  if all(t == EXPLICIT for t in mesh.axis_types):  # The type carries it too.
    assert jax.typeof(array).sharding.spec == P(*spec, *[None] * (array.ndim - len(spec)))


def unboxed(tree):
  """The values in nn.Partitioned boxes, without laying them out (no eager ops)."""
  return jax.tree.map(lambda v: v.value if isinstance(v, nn.Partitioned) else v, tree,
                      is_leaf=lambda v: isinstance(v, nn.Partitioned))


class LinenMLP(nn.Module):
  """Dense (embed -> mlp) -> gelu -> Dense (mlp -> embed), params with logical names."""
  tensor_parallel: bool = True

  @nn.compact
  def __call__(self, x):
    for name, features in (("up", 32), ("down", x.shape[-1])):
      kernel_names, bias_names = NAMES[name]
      kwargs = dict(
        name=name,
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), kernel_names),
        bias_init=nn.with_logical_partitioning(nn.initializers.normal(1.0), bias_names))
      if self.tensor_parallel:
        layer = jaxflux.Dense(features, tensor_parallel=MODES[name], impl="xla", **kwargs)
      else:
        layer = nn.Dense(features, **kwargs)
      x = layer(x if name == "up" else nn.gelu(x))
    return x


@pytest.mark.parametrize("mesh_name", MESHES)
def test_linen_matches_flax(mesh_name):
  shape, axes, axis_type, rules, tp, batch = MESHES[mesh_name]
  mesh = mesh_of(shape, axes, axis_type)
  x = normal(0, (4, 16, 8))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    x_in = jax.device_put(x, NamedSharding(mesh, P(batch)))
    variables = jax.jit(LinenMLP().init)(jax.random.key(1), x_in)
    y, (grads, dx) = loss_and_grad(LinenMLP().apply, variables, x_in)
  with nn.logical_axis_rules(rules):  # Flax's Dense, unsharded.
    flax_boxes = jax.eval_shape(LinenMLP(tensor_parallel=False).init, jax.random.key(1), x)
    expected = loss_and_grad(LinenMLP(tensor_parallel=False).apply,
                             jax.device_get(unboxed(variables)), x)
  assert_trees_close((y, (unboxed(grads), dx)), expected)
  # Boxed as Flax boxes them: the same types, logical names and rules.
  spec = nn.get_partition_spec(variables)
  assert spec == nn.get_partition_spec(flax_boxes) == {"params": {
    layer: {"kernel": P(*k), "bias": P(*b)} for layer, (k, b) in NAMES.items()}}
  for box in jax.tree.leaves(variables, is_leaf=lambda v: isinstance(v, nn.Partitioned)):
    assert isinstance(box, nn.LogicallyPartitioned) and box.rules is None
  # Params and their gradients sharded as the rules say: over fsdp and tp.
  shardings = nn.logical_to_mesh_sharding(spec, mesh, rules)
  for layer, (kernel_names, bias_names) in NAMES.items():
    for param, names in (("kernel", kernel_names), ("bias", bias_names)):
      want = mesh_spec(names, rules)
      assert shardings["params"][layer][param].spec == want
      check_sharding(variables["params"][layer][param].value, mesh, want)
      check_sharding(grads["params"][layer][param].value, mesh, want)
  assert mesh_spec(NAMES["up"][0], rules)[1] == tp  # The layers ran over this axis.
  check_sharding(y, mesh, P(batch, tp, None))


@pytest.mark.parametrize("mode", ["column", "row"])
def test_linen_box_rules_and_mesh_axis_names(mode):
  mesh = mesh_of((2, 4), ("fsdp", "tp"))
  x = normal(0, (4, 16, 8))
  names = ("embed", "mlp") if mode == "column" else ("mlp", "embed")
  expected = mesh_spec(names, FSDP_TP)
  inits = {  # The box's own rules (no rules context); mesh axis names (nn.with_partitioning).
    "box_rules": nn.with_logical_partitioning(
      nn.initializers.lecun_normal(), names, rules=FSDP_TP),
    "mesh_axes": nn.with_partitioning(nn.initializers.lecun_normal(), tuple(expected)),
  }
  for kind, kernel_init in inits.items():
    layer = jaxflux.Dense(8, tensor_parallel=mode, kernel_init=kernel_init, impl="xla")
    with jax.set_mesh(mesh):
      variables = jax.eval_shape(layer.init, jax.random.key(0), x)
    kernel = variables["params"]["kernel"]
    assert kernel.names == (names if kind == "box_rules" else tuple(expected)), kind
    assert kernel.value.sharding.spec == expected, kind
    # An unwrapped bias_init gets the bias names that go with the kernel's.
    bias_names = (kernel.names[1],) if mode == "column" else (None,)
    assert variables["params"]["bias"].names == bias_names, kind
    assert type(variables["params"]["bias"]) is type(kernel), kind


def linen_init(layer, mesh, rules, x):
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    return jax.eval_shape(layer.init, jax.random.key(0), x)


def test_linen_axis_name_precedence():
  mesh = mesh_of((4,), ("model",))
  rules = MESHES["tp_named_model"][3]
  x = normal(0, (16, 8))
  init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
  for axis_name in (None, "model"):  # Unset: the rules' axis; set: it must agree.
    variables = linen_init(jaxflux.Dense(8, tensor_parallel="column", kernel_init=init,
                                         axis_name=axis_name), mesh, rules, x)
    assert variables["params"]["kernel"].value.sharding.spec == P(None, "model")
  with pytest.raises(ValueError, match=r"axis_name='tp' disagrees.*'mlp'.*mesh axis 'model'"):
    linen_init(jaxflux.Dense(8, tensor_parallel="column", kernel_init=init, axis_name="tp"),
               mesh, rules, x)


@pytest.mark.parametrize("mode, names, rules, match", [
  ("column", ("embed", "mlp"), (("embed", "fsdp"),),
   r"output-feature dimension has logical axis 'mlp', which maps to no mesh axis.*"
   r"\(\('embed', 'fsdp'\),\)"),
  ("row", ("mlp", "embed"), (("mlp", None), ("embed", "fsdp")),
   r"input-feature dimension has logical axis 'mlp', which maps to no mesh axis"),
  ("column", ("embed", "mlp"), (("mlp", ("fsdp", "tp")),),
   r"logical axis 'mlp', which maps to 2 mesh axes \('fsdp', 'tp'\)"),
  ("column", ("embed", None), FSDP_TP, r"logical axis None, which maps to no mesh axis"),
])
def test_linen_unmapped_tensor_parallel_axis_raises(mode, names, rules, match):
  init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
  layer = jaxflux.Dense(8, tensor_parallel=mode, kernel_init=init)
  with pytest.raises(ValueError, match=match):
    linen_init(layer, mesh_of((2, 4), ("fsdp", "tp")), rules, normal(0, (16, 8)))


def test_linen_rules_pick_an_axis_the_mesh_lacks_raises():
  init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
  layer = jaxflux.Dense(8, tensor_parallel="column", kernel_init=init)
  with pytest.raises(ValueError, match=r"no axis 'model'.*\('embed', 'mlp'\) from kernel_init"):
    linen_init(layer, mesh_of((2, 4), ("fsdp", "tp")), (("mlp", "model"),), normal(0, (16, 8)))


class NnxMLP(nnx.Module):
  """The NNX twin of LinenMLP; the down layer's bias has no sharding of its own."""

  def __init__(self, tensor_parallel=True):
    for i, (name, features) in enumerate((("up", (8, 32)), ("down", (32, 8)))):
      kernel_names, bias_names = NAMES[name]
      kwargs = dict(
        kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), kernel_names),
        bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(i))
      if name == "up":
        kwargs["bias_init"] = nnx.with_partitioning(kwargs["bias_init"], bias_names)
      if tensor_parallel:
        layer = jaxflux.nnx.Linear(*features, tensor_parallel=MODES[name], impl="xla",
                                   **kwargs)
      else:
        layer = nnx.Linear(*features, **kwargs)
      setattr(self, name, layer)

  def __call__(self, x):
    return self.down(nnx.gelu(self.up(x)))


def nnx_loss_and_grad(model, x):
  graphdef, state = nnx.split(model)
  y, (dstate, dx) = loss_and_grad(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
  return y, nnx.to_pure_dict(dstate), dx


@pytest.mark.parametrize("mesh_name", MESHES)
def test_nnx_matches_flax(mesh_name):
  shape, axes, axis_type, rules, tp, batch = MESHES[mesh_name]
  mesh = mesh_of(shape, axes, axis_type)
  x = normal(0, (4, 16, 8))
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    x_in = jax.device_put(x, NamedSharding(mesh, P(batch)))
    model = nnx.jit(NnxMLP)()  # Flax lays the params out by their names and the rules.
    y, grads, dx = nnx_loss_and_grad(model, x_in)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.Param)))
    flax_model = nnx.eval_shape(lambda: NnxMLP(tensor_parallel=False))
    flax_specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(flax_model, nnx.Param)))
  assert model.up.axis_name == model.down.axis_name == tp
  params = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  with nnx.use_eager_sharding(False):
    ref = nnx.eval_shape(lambda: NnxMLP(tensor_parallel=False))
  state = nnx.state(ref, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(ref, state)
  assert_trees_close((y, grads, dx), nnx_loss_and_grad(ref, x))
  # The sharding flax gives these names and rules, on the params and their gradients.
  expected = {"up": {"kernel": mesh_spec(NAMES["up"][0], rules),
                     "bias": mesh_spec(NAMES["up"][1], rules)},
              "down": {"kernel": mesh_spec(NAMES["down"][0], rules), "bias": P(None)}}
  assert specs == flax_specs | {"down": expected["down"]} == expected
  for layer, params in expected.items():
    for param, spec in params.items():
      check_sharding(getattr(getattr(model, layer), param).get_value(), mesh, spec)
      check_sharding(grads[layer][param], mesh, spec)
  check_sharding(y, mesh, P(batch, tp, None))


def test_nnx_metadata_rules_and_precedence():
  mesh = mesh_of((2, 4), ("fsdp", "tp"))
  # out_sharding and sharding_rules in kernel_metadata, no rules context.
  metadata = {"out_sharding": ("mlp", "embed"), "sharding_rules": FSDP_TP}
  make = lambda **kw: jaxflux.nnx.Linear(32, 8, tensor_parallel="row", rngs=nnx.Rngs(0),
                                         kernel_metadata=metadata, **kw)
  with jax.set_mesh(mesh):
    layer = nnx.eval_shape(make)
    assert layer.axis_name == "tp"
    assert layer.kernel.get_value().sharding.spec == P("tp", "fsdp")
    assert layer.bias.get_value().sharding.spec == P(None)
    assert nnx.eval_shape(lambda: make(axis_name="tp")).axis_name == "tp"
    with pytest.raises(ValueError, match=r"axis_name='fsdp' disagrees.*mesh axis 'tp'"):
      nnx.eval_shape(lambda: make(axis_name="fsdp"))


@pytest.mark.parametrize("mode, names, rules, match", [
  # NNX keeps a name without a rule as a mesh axis name.
  ("column", ("embed", "mlp"), (("embed", "fsdp"),),
   r"no axis 'mlp'.*\('embed', 'mlp'\) from kernel_init / kernel_metadata.*dimension \('mlp'\)"),
  ("row", ("mlp", "embed"), (("mlp", None), ("embed", "fsdp")),
   r"input-feature dimension has logical axis 'mlp', which maps to no mesh axis"),
  ("column", ("embed", "mlp"), (("mlp", ("fsdp", "tp")),),
   r"logical axis 'mlp', which maps to 2 mesh axes \('fsdp', 'tp'\)"),
])
def test_nnx_unmapped_tensor_parallel_axis_raises(mode, names, rules, match):
  init = nnx.with_partitioning(nnx.initializers.lecun_normal(), names)
  with jax.set_mesh(mesh_of((2, 4), ("fsdp", "tp"))), nnx.logical_axis_rules(rules):
    with pytest.raises(ValueError, match=match):
      nnx.eval_shape(lambda: jaxflux.nnx.Linear(
        8, 8, tensor_parallel=mode, kernel_init=init, rngs=nnx.Rngs(0)))
