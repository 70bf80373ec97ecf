"""The layers' `mesh` field on jax.make_mesh meshes, Explicit and Auto axes, with and without
jax.set_mesh: values and gradients of a column -> row -> column -> row model (with and without
biases) against flax.linen.Dense and flax.nnx.Linear in float32 (pure-JAX path on 8 virtual CPU
devices)."""

import contextlib

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
CASES = [(t, ambient) for t in (EXPLICIT, AUTO) for ambient in (False, True)]
CASE_IDS = [f"{t.name}-{'set_mesh' if a else 'field_only'}" for t, a in CASES]
# One model covers both modes with and without bias: (name, mode, use_bias, out features).
LAYERS = (("up", "column", True, 32), ("down", "row", True, 8),
          ("up_nb", "column", False, 16), ("down_nb", "row", False, 8))
LAYER_MODES = {name: mode for name, mode, *_ in LAYERS}
KERNEL_SPECS = {"column": P(None, "tp"), "row": P("tp", None)}
BIAS_SPECS = {"column": P("tp"), "row": P(None)}


def normal(seed, shape, scale=1.0):
  # NumPy, not jax.random: eager jax ops each compile, which dominates a CPU test run.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def maybe_set_mesh(mesh, ambient):
  return jax.set_mesh(mesh) if ambient else contextlib.nullcontext()


def unboxed(tree):
  """The values in nn.Partitioned boxes, without laying them out (no eager ops)."""
  return jax.tree.map(lambda v: v.value if isinstance(v, nn.Partitioned) else v, tree,
                      is_leaf=lambda v: isinstance(v, nn.Partitioned))


def loss_and_grad(apply):
  """jit(value_and_grad) of sum(y * r) for a fixed random r, returning (y, grads)."""
  def loss(params, x):
    y = apply(params, x)
    return jnp.sum(y * normal(99, y.shape)), y

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

  def run(params, x):
    (_, y), grads = fn(params, x)
    return y, grads

  return run


class LinenMLP(nn.Module):
  """LAYERS with gelu between, through the layers' `mesh` field; nn.Dense when mesh is None."""
  mesh: jax.sharding.Mesh | None

  @nn.compact
  def __call__(self, x):
    for i, (name, mode, use_bias, features) in enumerate(LAYERS):
      kwargs = dict(use_bias=use_bias, bias_init=nn.initializers.normal(1.0), name=name)
      if self.mesh is None:
        layer = nn.Dense(features, **kwargs)
      else:
        layer = jaxflux.Dense(features, tensor_parallel=mode, mesh=self.mesh, impl="xla",
                              **kwargs)
      x = layer(nn.gelu(x) if i else x)
    return x


def random_params(shapes, mesh):
  """Random values for a tree of param shapes (kernels scaled by 1/sqrt(fan in)), put on
  `mesh` as the layers lay them out (param_spec): no initializer runs (nor compiles)."""
  leaves, treedef = jax.tree.flatten_with_path(shapes)
  values = []
  for i, (path, leaf) in enumerate(leaves):
    scale = 1 / np.sqrt(leaf.shape[0]) if len(leaf.shape) == 2 else 1.0
    value = normal(10 + i, leaf.shape, scale)
    if mesh is not None:
      value = jax.device_put(value, NamedSharding(mesh, param_spec(path)))
    values.append(value)
  return jax.tree.unflatten(treedef, values)


def param_spec(path) -> P:
  """The layout the layers give the param at `path` (.../<layer>/<kernel or bias>)."""
  keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
  mode = next(LAYER_MODES[k] for k in keys if k in LAYER_MODES)
  return (KERNEL_SPECS if keys[-1] == "kernel" else BIAS_SPECS)[mode]


@pytest.mark.parametrize("axis_type, ambient", CASES, ids=CASE_IDS)
def test_linen_mesh_field(axis_type, ambient):
  mesh = mesh_of((4,), ("tp",), axis_type)
  x = normal(0, (2, 16, 8))
  model = LinenMLP(mesh)
  with maybe_set_mesh(mesh, ambient):
    boxes = jax.eval_shape(model.init, jax.random.key(1), x)
  # Boxed params, laid out over the mesh as the layers' init lays them out.
  params = random_params(unboxed(boxes), mesh)
  variables = jax.tree.map(lambda b, v: b.replace_boxed(v), boxes, params,
                           is_leaf=lambda b: isinstance(b, nn.Partitioned))
  with maybe_set_mesh(mesh, ambient):
    y, (grads, dx) = loss_and_grad(model.apply)(variables, x)
  ref = LinenMLP(None)
  expected = loss_and_grad(ref.apply)(jax.device_get(params), x)
  assert_trees_close((y, (unboxed(grads), dx)), expected)
  assert nn.get_partition_spec(boxes)["params"] == {
    name: {"kernel": KERNEL_SPECS[mode]} | ({"bias": BIAS_SPECS[mode]} if use_bias else {})
    for name, mode, use_bias, _ in LAYERS}
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp", None)), 3)


@pytest.mark.parametrize("axis_type", [EXPLICIT, AUTO])
def test_linen_init_then_grad_with_mesh_field_only(axis_type):
  # A row layer with a bias, initialised and differentiated with only its mesh field set.
  mesh = mesh_of((4,), ("tp",), axis_type)
  x = normal(0, (2, 16, 32))
  kwargs = dict(use_bias=True, bias_init=nn.initializers.normal(1.0))
  layer = jaxflux.Dense(16, tensor_parallel="row", mesh=mesh, impl="xla", **kwargs)
  variables = jax.jit(layer.init)(jax.random.key(0), x)
  for name, spec in (("kernel", P("tp", None)), ("bias", P(None))):
    value = variables["params"][name].value
    assert value.sharding.is_equivalent_to(NamedSharding(mesh, spec), value.ndim)
  got = loss_and_grad(layer.apply)(variables, x)
  params = jax.device_get(unboxed(variables))
  expected = loss_and_grad(nn.Dense(16, **kwargs).apply)(params, x)
  assert_trees_close((got[0], (unboxed(got[1][0]), got[1][1])), expected)


class NnxMLP(nnx.Module):
  """LAYERS with gelu between, through the layers' `mesh` field; nnx.Linear when mesh is None."""

  def __init__(self, mesh):
    in_features = 8
    for i, (name, mode, use_bias, features) in enumerate(LAYERS):
      kwargs = dict(use_bias=use_bias, bias_init=nnx.initializers.normal(1.0),
                    rngs=nnx.Rngs(i))
      if mesh is None:
        layer = nnx.Linear(in_features, features, **kwargs)
      else:
        layer = jaxflux.nnx.Linear(in_features, features, tensor_parallel=mode, mesh=mesh,
                                   impl="xla", **kwargs)
      setattr(self, name, layer)
      in_features = features

  def __call__(self, x):
    for i, (name, *_) in enumerate(LAYERS):
      x = getattr(self, name)(nnx.gelu(x) if i else x)
    return x


def set_params(model, params):
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)


def nnx_loss_and_grad(model, x):
  graphdef, state = nnx.split(model)
  y, (dstate, dx) = loss_and_grad(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
  return y, nnx.to_pure_dict(dstate), dx


@pytest.mark.parametrize("axis_type, ambient", CASES, ids=CASE_IDS)
def test_nnx_mesh_field(axis_type, ambient):
  mesh = mesh_of((4,), ("tp",), axis_type)
  x = normal(0, (2, 16, 8))
  with maybe_set_mesh(mesh, ambient):
    model = nnx.eval_shape(lambda: NnxMLP(mesh))
  # Random params, laid out over the mesh as the layers lay them out when they make them.
  params = random_params(nnx.to_pure_dict(nnx.state(model, nnx.Param)), mesh)
  set_params(model, params)
  with maybe_set_mesh(mesh, ambient):
    got = nnx_loss_and_grad(model, x)
  with nnx.use_eager_sharding(False):
    ref = nnx.eval_shape(lambda: NnxMLP(None))
  set_params(ref, jax.device_get(params))
  assert_trees_close(got, nnx_loss_and_grad(ref, x))
  specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.Param)))
  assert specs == {
    name: {"kernel": KERNEL_SPECS[mode]} | ({"bias": BIAS_SPECS[mode]} if use_bias else {})
    for name, mode, use_bias, _ in LAYERS}
  assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp", None)), 3)


@pytest.mark.parametrize("axis_type", [EXPLICIT, AUTO])
def test_nnx_built_with_mesh_field_only(axis_type):
  # Flax lays sharded params out when it makes them, and JAX takes Explicit shardings under
  # jit only inside jax.set_mesh (as for flax.nnx.Linear), so an Explicit mesh without
  # jax.set_mesh builds eagerly; an Auto one under nnx.jit.
  mesh = mesh_of((4,), ("tp",), axis_type)
  x = normal(0, (2, 16, 32))
  kwargs = dict(use_bias=True, bias_init=nnx.initializers.normal(1.0))
  make = lambda: jaxflux.nnx.Linear(32, 16, tensor_parallel="row", mesh=mesh, impl="xla",
                                    rngs=nnx.Rngs(0), **kwargs)
  layer = make() if axis_type == EXPLICIT else nnx.jit(make)()
  for value, spec in ((layer.kernel.get_value(), P("tp", None)),
                      (layer.bias.get_value(), P(None))):
    assert value.sharding.is_equivalent_to(NamedSharding(mesh, spec), value.ndim)
  got = nnx_loss_and_grad(layer, x)
  with nnx.use_eager_sharding(False):
    ref = nnx.eval_shape(lambda: nnx.Linear(32, 16, rngs=nnx.Rngs(0), **kwargs))
  set_params(ref, jax.device_get(nnx.to_pure_dict(nnx.state(layer, nnx.Param))))
  assert_trees_close(got, nnx_loss_and_grad(ref, x))
