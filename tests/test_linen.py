"""jaxflux.Dense against flax.linen.Dense on 8 virtual CPU devices (pure-JAX path)."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxflux
from conftest import assert_trees_close, mesh_of

EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto
RANDOM_BIAS = nn.initializers.normal(1.0)  # Flax's default zero bias would hide bias bugs.
OUT_SPEC = {"column": P(None, None, "tp"), "row": P(None, "tp", None)}



def normal(seed, shape, dtype=jnp.float32):
  # NumPy, not jax.random: eager jax ops each compile, which dominates a CPU test run.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def dense_params(seed, in_features, features):
  """A random flax.linen.Dense checkpoint (non-zero bias)."""
  return {"kernel": normal(seed, (in_features, features)) / np.sqrt(in_features),
          "bias": normal(seed + 1, (features,))}


def mlp_params(seed, features, hidden):
  return {"params": {"Dense_0": dense_params(seed, features, hidden),
                     "Dense_1": dense_params(seed + 2, hidden, features)}}


def value_and_grads(module, params, x):
  """y, and d(sum(y * r))/d(params, x) for a fixed random r, all under jit."""
  def loss(params, x):
    y = module.apply(params, x)
    return jnp.sum(y.astype(jnp.float32) * normal(99, y.shape)), y

  (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return y, grads


@functools.cache
def flax_dense_result(x_shape, features):
  """flax.linen.Dense's value_and_grads on normal(0, x_shape): shared by parametrizations."""
  params = {"params": dense_params(1, x_shape[-1], features)}
  return value_and_grads(nn.Dense(features), params, normal(0, x_shape))


@functools.cache
def flax_mlp_result(x_shape):
  return value_and_grads(MLP(32, tensor_parallel=False), mlp_params(1, 8, 32), normal(0, x_shape))


class MLP(nn.Module):
  """Sequence-parallel MLP: tokens sharded in, through column then row, tokens sharded out."""
  hidden: int
  tensor_parallel: bool = True

  @nn.compact
  def __call__(self, x):
    if self.tensor_parallel:
      up = jaxflux.Dense(self.hidden, bias_init=RANDOM_BIAS, tensor_parallel="column")
      down = jaxflux.Dense(x.shape[-1], bias_init=RANDOM_BIAS, tensor_parallel="row")
    else:
      up = nn.Dense(self.hidden, bias_init=RANDOM_BIAS)
      down = nn.Dense(x.shape[-1], bias_init=RANDOM_BIAS)
    return down(nn.gelu(up(x)))


def test_fields_match_flax():
  ours = {f.name: f for f in dataclasses.fields(jaxflux.Dense)}
  theirs = [f for f in dataclasses.fields(nn.Dense) if f.name not in ("parent", "name")]
  names = [f.name for f in dataclasses.fields(jaxflux.Dense) if f.name not in ("parent", "name")]
  assert names == [f.name for f in theirs] + [
    "tensor_parallel", "axis_name", "token_axis", "mesh", "impl", "sequence_parallel"]
  for f in theirs:
    assert ours[f.name].default is f.default
  defaults = jaxflux.Dense(4)
  assert (defaults.tensor_parallel, defaults.axis_name, defaults.token_axis,
          defaults.mesh, defaults.impl) == (None, None, -2, None, "auto")
  assert isinstance(defaults, nn.Dense)


def test_no_tensor_parallel_is_flax_dense():
  x = normal(0, (2, 5, 6))
  ours, ref = jaxflux.Dense(3, bias_init=RANDOM_BIAS), nn.Dense(3, bias_init=RANDOM_BIAS)
  params = jax.jit(ours.init)(jax.random.key(1), x)
  assert_trees_close(params, jax.jit(ref.init)(jax.random.key(1), x), rtol=0, atol=0)
  assert_trees_close(value_and_grads(ours, params, x), value_and_grads(ref, params, x),
                     rtol=0, atol=0)


# jax.make_mesh's default axis type is Explicit; Auto once, to keep the file fast.
@pytest.mark.parametrize("tp, axis_type", [(2, EXPLICIT), (4, EXPLICIT), (8, EXPLICIT), (4, AUTO)])
@pytest.mark.parametrize("mode", ["column", "row"])
def test_values_and_grads_match_flax(tp, mode, axis_type):
  x = normal(0, (2, 16, 24))
  ours = jaxflux.Dense(16, bias_init=RANDOM_BIAS, tensor_parallel=mode)
  params = {"params": dense_params(1, 24, 16)}  # A plain Flax checkpoint.
  with jax.set_mesh(mesh_of((tp,), ("tp",), axis_type)):
    y, grads = value_and_grads(ours, params, x)
  assert_trees_close((y, grads), flax_dense_result(x.shape, 16))
  assert y.sharding.is_equivalent_to(NamedSharding(y.sharding.mesh, OUT_SPEC[mode]), y.ndim)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_column_row_mlp_matches_flax(tp):
  x = normal(0, (2, 16, 8))
  params = mlp_params(1, 8, 32)
  with jax.set_mesh(mesh_of((tp,), ("tp",))):
    got = value_and_grads(MLP(32), params, x)
  assert_trees_close(got, flax_mlp_result(x.shape))


def test_checkpoint_loads_both_ways():
  x = normal(0, (2, 16, 8))
  with jax.set_mesh(mesh_of((4,), ("tp",))):
    boxed = jax.jit(MLP(32).init)(jax.random.key(1), x)
    y_ours = jax.jit(MLP(32).apply)(boxed, x)
  boxed = jax.device_get(boxed)  # As saved to, and restored from, a checkpoint.
  ours = nn.unbox(boxed)
  flax_mlp = MLP(32, tensor_parallel=False)
  theirs = jax.jit(flax_mlp.init)(jax.random.key(1), x)
  # Same tree, names, shapes, dtypes and even values (same rng streams).
  assert_trees_close(ours, theirs, rtol=0, atol=0)
  # Ours (boxed or not) into plain Flax, and the other way round in the tests above.
  np.testing.assert_allclose(flax_mlp.apply(boxed, x), y_ours, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(flax_mlp.apply(ours, x), y_ours, rtol=1e-5, atol=1e-5)


def test_partition_specs():
  x = normal(0, (2, 16, 8))
  with jax.set_mesh(mesh_of((4,), ("tp",))):
    variables = jax.eval_shape(MLP(32).init, jax.random.key(1), x)
  assert nn.get_partition_spec(variables) == {"params": {
    "Dense_0": {"kernel": P(None, "tp"), "bias": P("tp")},
    "Dense_1": {"kernel": P("tp", None), "bias": P(None)},
  }}


@pytest.mark.parametrize("axis_type", [EXPLICIT, AUTO])
def test_explicit_mesh_field_equals_ambient_mesh(axis_type):
  mesh = mesh_of((4,), ("tp",), axis_type)
  x = normal(0, (2, 16, 8))
  params = {"params": dense_params(1, 8, 8)}
  results = {}
  for mode in ("column", "row"):
    results[mode] = value_and_grads(
      jaxflux.Dense(8, tensor_parallel=mode, mesh=mesh, bias_init=RANDOM_BIAS), params, x)
    with jax.set_mesh(mesh):
      ambient = value_and_grads(
        jaxflux.Dense(8, tensor_parallel=mode, bias_init=RANDOM_BIAS), params, x)
    assert_trees_close(results[mode], ambient, rtol=1e-6, atol=1e-6)
  # The explicit mesh also initialises (boxing with that mesh) without an ambient one.
  variables = jax.jit(jaxflux.Dense(8, tensor_parallel="row", mesh=mesh).init)(
    jax.random.key(1), x)
  assert nn.get_partition_spec(variables)["params"]["kernel"] == P("tp", None)
  # ... and lays the params out over it (not only their metadata).
  for mode, spec in (("row", P("tp", None)), ("column", P(None, "tp"))):
    variables = jax.jit(jaxflux.Dense(8, tensor_parallel=mode, mesh=mesh).init)(
      jax.random.key(1), x)
    kernel = variables["params"]["kernel"].value
    assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, spec), kernel.ndim), mode


@pytest.mark.parametrize("dp_type, tp_type", [
  (EXPLICIT, EXPLICIT), (AUTO, AUTO), (EXPLICIT, AUTO), (AUTO, EXPLICIT)])
def test_dp_by_tp_mesh_keeps_batch_sharding(dp_type, tp_type):
  mesh = mesh_of((2, 4), ("dp", "tp"), (dp_type, tp_type))
  x = normal(0, (4, 16, 8))
  up = jaxflux.Dense(32, tensor_parallel="column", bias_init=RANDOM_BIAS)
  with jax.set_mesh(mesh):
    x_dp = jax.device_put(x, NamedSharding(mesh, P("dp")))
    variables = jax.jit(MLP(32).init)(jax.random.key(1), x_dp)
    y_boxed = jax.jit(MLP(32).apply)(variables, x_dp)
    params = nn.unbox(variables)
    got = value_and_grads(MLP(32), params, x_dp)
    h = jax.jit(up.apply)({"params": params["params"]["Dense_0"]}, x_dp)
  kernel = params["params"]["Dense_0"]["kernel"]
  assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 2)
  expected = value_and_grads(MLP(32, tensor_parallel=False), jax.device_get(params), x)
  assert_trees_close(got, expected)
  np.testing.assert_allclose(y_boxed, got[0], rtol=1e-6, atol=1e-6)
  # Tokens come out sharded over tp, and the batch stays sharded over dp.
  assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, P("dp", "tp", None)), 3)
  assert h.sharding.is_equivalent_to(NamedSharding(mesh, P("dp", None, "tp")), 3)
  if dp_type == EXPLICIT:  # Types pin it; under Auto the compiler may pick another layout.
    assert jax.typeof(got[1][1]) == jax.typeof(x_dp)  # d(loss)/dx


@pytest.mark.parametrize("mode, shape, token_axis", [
  ("column", (16, 8), -2), ("row", (3, 2, 16, 8), -2),
  ("column", (2, 16, 3, 8), -3), ("row", (16, 3, 8), 0)])
def test_batch_dims_and_token_axis(mode, shape, token_axis):
  x = normal(0, shape)
  ours = jaxflux.Dense(8, bias_init=RANDOM_BIAS, tensor_parallel=mode, token_axis=token_axis)
  ref = nn.Dense(8, bias_init=RANDOM_BIAS)
  params = {"params": dense_params(1, 8, 8)}
  with jax.set_mesh(mesh_of((4,), ("tp",))):
    got = value_and_grads(ours, params, x)
  assert_trees_close(got, value_and_grads(ref, params, x))


@pytest.mark.parametrize("mode", ["column", "row"])
def test_bfloat16_compute_with_float32_params(mode):
  x = normal(0, (2, 16, 32))
  kwargs = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32, bias_init=RANDOM_BIAS)
  ours, ref = jaxflux.Dense(16, tensor_parallel=mode, **kwargs), nn.Dense(16, **kwargs)
  with jax.set_mesh(mesh_of((4,), ("tp",))):
    params = nn.unbox(jax.jit(ours.init)(jax.random.key(1), x))
    y, grads = value_and_grads(ours, params, x)
  assert jax.tree.map(lambda p: p.dtype, params) == {
    "params": {"kernel": jnp.float32, "bias": jnp.float32}}
  assert y.dtype == jnp.bfloat16
  # Row sums bf16 partial products across devices: agree to bf16 rounding, not bitwise.
  expected = value_and_grads(ref, jax.device_get(params), x)
  assert_trees_close((y, grads), expected, rtol=2e-2, atol=2e-2)


def init_on(mesh, layer, x):
  with jax.set_mesh(mesh):
    return jax.eval_shape(layer.init, jax.random.key(0), x)


@pytest.mark.parametrize("layer, match", [
  (lambda: jaxflux.Dense(8, tensor_parallel="col"), "tensor_parallel='col'"),
  (lambda: jaxflux.Dense(8, tensor_parallel="row", impl="cuda"), "impl='cuda'"),
  (lambda: jaxflux.Dense(8, tensor_parallel="row", token_axis=1.0), "token_axis"),
  (lambda: jaxflux.Dense(8, tensor_parallel="column", dot_general=jax.lax.dot_general),
   "dot_general"),
])
def test_bad_fields_raise_at_construction(layer, match):
  with pytest.raises(ValueError, match=match):
    layer()


def test_no_mesh_raises():
  with pytest.raises(ValueError, match=r"needs a device mesh.*jax.set_mesh"):
    jax.eval_shape(jaxflux.Dense(8, tensor_parallel="column").init, jax.random.key(0),
                   normal(0, (16, 8)))


def test_unknown_axis_raises():
  mesh = mesh_of((4,), ("model",))
  with pytest.raises(ValueError, match=r"no axis 'tp'.*axis_name="):
    init_on(mesh, jaxflux.Dense(8, tensor_parallel="row"), normal(0, (16, 8)))


@pytest.mark.parametrize("mode", ["column", "row"])
def test_tokens_not_divisible_raises(mode):
  with pytest.raises(ValueError, match=r"6 tokens, not divisible by the size 4 .*token_axis"):
    init_on(mesh_of((4,), ("tp",)), jaxflux.Dense(8, tensor_parallel=mode), normal(0, (2, 6, 8)))


@pytest.mark.parametrize("mode, in_features, features, match", [
  ("column", 8, 6, "features=6 is not divisible"),
  ("row", 6, 8, "last dimension 6 is not divisible"),
])
def test_features_not_divisible_raises(mode, in_features, features, match):
  with pytest.raises(ValueError, match=match):
    init_on(mesh_of((4,), ("tp",)), jaxflux.Dense(features, tensor_parallel=mode),
            normal(0, (16, in_features)))


def test_feature_axis_as_token_axis_raises():
  with pytest.raises(ValueError, match="token_axis=-1"):
    init_on(mesh_of((4,), ("tp",)), jaxflux.Dense(8, tensor_parallel="row", token_axis=-1),
            normal(0, (16, 8)))


@pytest.mark.parametrize("mode", ["column", "row"])
def test_fused_impl_raises_without_kernel(mode):
  if jaxflux.has_cuda():
    pytest.skip("the fused kernel is available here")
  assert issubclass(jaxflux.FusedKernelUnavailableError, RuntimeError)
  layer = jaxflux.Dense(8, tensor_parallel=mode, impl="fused", dtype=jnp.bfloat16)
  with pytest.raises(jaxflux.FusedKernelUnavailableError):
    init_on(mesh_of((4,), ("tp",)), layer, normal(0, (16, 8), jnp.bfloat16))


def test_docstring_example_runs():
  import doctest

  import jaxflux.layers.linen
  assert doctest.testmod(jaxflux.layers.linen, optionflags=doctest.ELLIPSIS).failed == 0
