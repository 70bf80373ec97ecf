"""Tensor parallelism without sequence parallelism (`sequence_parallel=False`) in jaxflux.Dense and
jaxflux.nnx.Linear, against flax.linen.Dense / flax.nnx.Linear on 8 virtual CPU devices: values,
gradients and param shardings of column and row layers, a column -> row MLP and its compiled
collectives; and sequence_parallel=True (the default) unchanged."""

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
from hlo_util import count_collectives

EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto
RANDOM_BIAS = nn.initializers.normal(1.0)  # Flax's default zero bias would hide bias bugs.
# Global output layouts, [batch, tokens, features].
OUT_SPEC = {("column", False): P(None, None, "tp"), ("row", False): P(None, None, None),
            ("column", True): P(None, None, "tp"), ("row", True): P(None, "tp", None)}
PARAM_SPECS = {"column": {"kernel": P(None, "tp"), "bias": P("tp")},
               "row": {"kernel": P("tp", None), "bias": P(None)}}


def normal(seed, shape, dtype=jnp.float32):
  # NumPy, not jax.random: eager jax ops each compile, which dominates a CPU test run.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def dense_params(seed, in_features, features):
  """A random flax.linen.Dense checkpoint (non-zero bias)."""
  return {"kernel": normal(seed, (in_features, features)) / np.sqrt(in_features),
          "bias": normal(seed + 1, (features,))}


def linen_value_and_grads(module, params, x):
  """y, and d(sum(y * r))/d(params, x) for a fixed random r, under jit."""
  def loss(params, x):
    y = module.apply(params, x)
    return jnp.sum(y.astype(jnp.float32) * normal(99, y.shape)), y

  (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return y, grads


def assert_layout(y, spec):
  assert y.sharding.is_equivalent_to(NamedSharding(y.sharding.mesh, spec), y.ndim), y.sharding


class LinenMLP(nn.Module):
  """column -> gelu -> row; plain flax.linen.Dense layers with tensor_parallel=False."""
  hidden: int
  tensor_parallel: bool = True
  sequence_parallel: bool = False

  @nn.compact
  def __call__(self, x):
    if self.tensor_parallel:
      kw = dict(bias_init=RANDOM_BIAS, sequence_parallel=self.sequence_parallel)
      up = jaxflux.Dense(self.hidden, tensor_parallel="column", **kw)
      down = jaxflux.Dense(x.shape[-1], tensor_parallel="row", **kw)
    else:
      up = nn.Dense(self.hidden, bias_init=RANDOM_BIAS)
      down = nn.Dense(x.shape[-1], bias_init=RANDOM_BIAS)
    return down(nn.gelu(up(x)))


def mlp_params(seed, features, hidden):
  return {"params": {"Dense_0": dense_params(seed, features, hidden),
                     "Dense_1": dense_params(seed + 2, hidden, features)}}


# --- flax.linen ---------------------------------------------------------------------------------

def test_the_field_defaults_to_sequence_parallel():
  assert jaxflux.Dense(4).sequence_parallel is True
  assert jaxflux.Dense(4, tensor_parallel="row", sequence_parallel=False).sequence_parallel is False
  with pytest.raises(ValueError, match=r"sequence_parallel='no' must be a bool"):
    jaxflux.Dense(4, tensor_parallel="row", sequence_parallel="no")


# 5 tokens: without sequence parallelism the tokens are never split, so any count works.
@pytest.mark.parametrize("tp, axis_type", [(2, EXPLICIT), (4, EXPLICIT), (8, EXPLICIT), (4, AUTO)])
@pytest.mark.parametrize("mode", ["column", "row"])
def test_linen_values_grads_and_layout_match_flax(tp, mode, axis_type):
  x = normal(0, (2, 5, 24))
  params = {"params": dense_params(1, 24, 16)}  # a plain Flax checkpoint
  ours = jaxflux.Dense(16, bias_init=RANDOM_BIAS, tensor_parallel=mode, sequence_parallel=False)
  with jax.set_mesh(mesh_of((tp,), ("tp",), axis_type)):
    y, grads = linen_value_and_grads(ours, params, x)
  assert_trees_close((y, grads), linen_value_and_grads(nn.Dense(16, bias_init=RANDOM_BIAS),
                                                       params, x))
  assert_layout(y, OUT_SPEC[mode, False])


@pytest.mark.parametrize("mode", ["column", "row"])
def test_linen_param_shardings_are_those_of_sequence_parallel(mode):
  x = normal(0, (2, 8, 16))
  mesh = mesh_of((4,), ("tp",))
  with jax.set_mesh(mesh):
    variables = {sp: jax.jit(jaxflux.Dense(16, tensor_parallel=mode, sequence_parallel=sp).init)(
        jax.random.key(1), x) for sp in (True, False)}
  assert nn.get_partition_spec(variables[False]) == {"params": PARAM_SPECS[mode]}
  assert nn.get_partition_spec(variables[True]) == nn.get_partition_spec(variables[False])
  # The same values from the same rng, laid out over the mesh the same way.
  assert_trees_close(nn.unbox(variables[False]), nn.unbox(variables[True]), rtol=0, atol=0)
  for name, spec in PARAM_SPECS[mode].items():
    value = variables[False]["params"][name].value
    assert value.sharding.is_equivalent_to(NamedSharding(mesh, spec), value.ndim), name


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_linen_column_row_mlp_matches_flax(tp):
  x = normal(0, (2, 6, 8))
  params = mlp_params(1, 8, 32)
  with jax.set_mesh(mesh_of((tp,), ("tp",))):
    got = linen_value_and_grads(LinenMLP(32), params, x)
  assert_trees_close(got, linen_value_and_grads(LinenMLP(32, tensor_parallel=False), params, x))
  assert_layout(got[0], P(None, None, None))


def test_mlp_collectives_are_megatrons():
  """Without sequence parallelism a column -> row MLP's step has one all-reduce forward (the
  row layer's output) and one backward (the column layer's input gradient), nothing else."""
  x = normal(0, (2, 8, 8))
  params = mlp_params(1, 8, 32)
  module = LinenMLP(32)

  def loss(params, x, r):
    # Nonlinear in y, so the backward needs the forward's all-reduce (with a linear loss XLA
    # may combine the two independent all-reduces into one instruction).
    return jnp.sum(jnp.sin(module.apply(params, x)) * r)
  with jax.set_mesh(mesh_of((4,), ("tp",))):
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(
        params, x, normal(3, x.shape)).compile().as_text()
  assert count_collectives(text) == {"all-reduce": 2}


@pytest.mark.parametrize("mode", ["column", "row"])
def test_linen_sequence_parallel_true_is_unchanged(mode):
  """The default: tokens sharded in (column) or out (row), against Flax, as before."""
  x = normal(0, (2, 16, 24))
  params = {"params": dense_params(1, 24, 16)}
  default = jaxflux.Dense(16, bias_init=RANDOM_BIAS, tensor_parallel=mode)
  explicit = jaxflux.Dense(16, bias_init=RANDOM_BIAS, tensor_parallel=mode,
                           sequence_parallel=True)
  with jax.set_mesh(mesh_of((4,), ("tp",))):
    got = linen_value_and_grads(default, params, x)
    again = linen_value_and_grads(explicit, params, x)
  assert_trees_close(got, again, rtol=0, atol=0)
  assert_trees_close(got, linen_value_and_grads(nn.Dense(16, bias_init=RANDOM_BIAS), params, x))
  assert_layout(got[0], OUT_SPEC[mode, True])


# --- flax.nnx -----------------------------------------------------------------------------------

def nnx_value_and_grads(model, x):
  graphdef, state = nnx.split(model)

  def loss(state, x):
    y = nnx.merge(graphdef, state)(x)
    return jnp.sum(y.astype(jnp.float32) * normal(99, y.shape)), y

  (_, y), (dstate, dx) = jax.jit(
    jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(state, x)
  return y, nnx.to_pure_dict(dstate), dx


def params_of(model):
  return jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def nnx_linear(in_features, out_features, mode=None, **kw):
  """Built under jit (eagerly each initializer op would compile on its own)."""
  kw = dict(bias_init=nnx.initializers.normal(1.0), **kw)
  if mode is None:
    return nnx.jit(lambda: nnx.Linear(in_features, out_features, rngs=nnx.Rngs(0), **kw))()
  return nnx.jit(lambda: jaxflux.nnx.Linear(in_features, out_features, tensor_parallel=mode,
                                            rngs=nnx.Rngs(0), **kw))()


class NnxMLP(nnx.Module):
  def __init__(self, features, hidden, *, tensor_parallel=True):
    kw = {"sequence_parallel": False} if tensor_parallel else {}
    self.up = nnx_linear(features, hidden, "column" if tensor_parallel else None, **kw)
    self.down = nnx_linear(hidden, features, "row" if tensor_parallel else None, **kw)

  def __call__(self, x):
    return self.down(nnx.gelu(self.up(x)))


@pytest.mark.parametrize("tp, axis_type", [(2, EXPLICIT), (8, EXPLICIT), (4, AUTO)])
@pytest.mark.parametrize("mode", ["column", "row"])
def test_nnx_values_grads_layout_and_params_match_flax(tp, mode, axis_type):
  x = normal(0, (2, 5, 24))
  mesh = mesh_of((tp,), ("tp",), axis_type)
  with jax.set_mesh(mesh):
    ours = nnx_linear(24, 16, mode, sequence_parallel=False)
    got = nnx_value_and_grads(ours, x)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(ours)))
  theirs = nnx_linear(24, 16)
  assert_trees_close(params_of(ours), params_of(theirs), rtol=0, atol=0)  # same draws
  assert_trees_close(got, nnx_value_and_grads(theirs, x))
  assert_layout(got[0], OUT_SPEC[mode, False])
  assert specs == PARAM_SPECS[mode]
  kernel = ours.kernel[...]
  assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, PARAM_SPECS[mode]["kernel"]), 2)


def test_nnx_column_row_mlp_matches_flax():
  x = normal(0, (2, 6, 8))
  with jax.set_mesh(mesh_of((4,), ("tp",))):
    ours = NnxMLP(8, 32)
    got = nnx_value_and_grads(ours, x)
  theirs = NnxMLP(8, 32, tensor_parallel=False)
  assert_trees_close(params_of(ours), params_of(theirs), rtol=0, atol=0)
  assert_trees_close(got, nnx_value_and_grads(theirs, x))
  assert_layout(got[0], P(None, None, None))


def test_nnx_sequence_parallel_must_be_a_bool():
  with pytest.raises(ValueError, match=r"jaxflux.nnx.Linear: sequence_parallel=1 must be a bool"):
    jaxflux.nnx.Linear(8, 8, rngs=nnx.Rngs(0), tensor_parallel="row", sequence_parallel=1)


@pytest.mark.parametrize("mode", ["column", "row"])
def test_nnx_sequence_parallel_true_is_unchanged(mode):
  x = normal(0, (2, 16, 24))
  with jax.set_mesh(mesh_of((4,), ("tp",))):
    default = nnx_linear(24, 16, mode)
    assert default.sequence_parallel is True
    got = nnx_value_and_grads(default, x)
  assert_trees_close(got, nnx_value_and_grads(nnx_linear(24, 16), x))
  assert_layout(got[0], OUT_SPEC[mode, True])
