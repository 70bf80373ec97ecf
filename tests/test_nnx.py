"""jaxflux.nnx.Linear against flax.nnx.Linear on 8 virtual CPU devices (pure-JAX path)."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxflux
from conftest import assert_trees_close, mesh_of
import jaxflux.nnx

EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto
RANDOM_BIAS = nnx.initializers.normal(1.0)  # Flax's default zero bias would hide bias bugs.
OUT_SPEC = {"column": P(None, None, "tp"), "row": P(None, "tp", None)}



def normal(seed, shape, dtype=jnp.float32, scale=1.0):
  # NumPy, not jax.random: eager jax ops each compile, which dominates a CPU test run.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype)


def value_and_grads(model, x):
  """y, and d(sum(y * r))/d(params, x) for a fixed random r, under jit; params as a dict."""
  graphdef, state = nnx.split(model)

  def loss(state, x):
    y = nnx.merge(graphdef, state)(x)
    return jnp.sum(y.astype(jnp.float32) * normal(99, y.shape)), y

  (_, y), (dstate, dx) = jax.jit(
    jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(state, x)
  return y, nnx.to_pure_dict(dstate), dx


def params_of(model):
  """The model's params as a host-side pure dict: what a checkpoint holds."""
  return jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def build(make):
  """make() under jit: eagerly, each initializer op would compile on its own."""
  return nnx.jit(make)()


def with_params(model, params):
  """The model with its params replaced by a pure dict of arrays (a checkpoint)."""
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  return model


def new(make, seed=0):
  """make()'s model with random NumPy params; no initializer runs (nor compiles)."""
  model = nnx.eval_shape(make)
  shapes = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  leaves, treedef = jax.tree.flatten(shapes)
  values = [normal(seed + i, p.shape, p.dtype, scale=1 / np.sqrt(p.shape[0]) if p.ndim == 2 else 1)
            for i, p in enumerate(leaves)]
  return with_params(model, jax.tree.unflatten(treedef, values))


def make_linear(in_features, out_features, tensor_parallel=None, **kwargs):
  """jaxflux.nnx.Linear, or flax.nnx.Linear when tensor_parallel is None."""
  kwargs = dict(bias_init=RANDOM_BIAS, rngs=nnx.Rngs(0), **kwargs)
  if tensor_parallel is None:
    return nnx.Linear(in_features, out_features, **kwargs)
  return jaxflux.nnx.Linear(in_features, out_features, tensor_parallel=tensor_parallel, **kwargs)


def linear(*args, seed=0, **kwargs):
  return new(lambda: make_linear(*args, **kwargs), seed)


class MLP(nnx.Module):
  """Sequence-parallel MLP: tokens sharded in, through column then row, tokens sharded out."""

  def __init__(self, features, hidden, *, tensor_parallel=True):
    self.up = make_linear(features, hidden, "column" if tensor_parallel else None)
    self.down = make_linear(hidden, features, "row" if tensor_parallel else None)

  def __call__(self, x):
    return self.down(nnx.gelu(self.up(x)))


def mlp(*args, seed=0, **kwargs):
  return new(lambda: MLP(*args, **kwargs), seed)


def flax_mlp(*args, seed=0):
  return mlp(*args, seed=seed, tensor_parallel=False)


@functools.cache
def flax_result(make, *args):
  """Params and value_and_grads of make(*args) on normal(0, x_shape); shared by tests."""
  *args, x_shape = args
  model = make(*args)
  return params_of(model), value_and_grads(model, normal(0, x_shape))


def test_signature_matches_flax():
  ours = list(inspect.signature(jaxflux.nnx.Linear.__init__).parameters.values())
  theirs = list(inspect.signature(nnx.Linear.__init__).parameters.values())
  assert [(p.name, p.kind) for p in ours[:len(theirs)]] == [(p.name, p.kind) for p in theirs]
  for a, b in zip(ours, theirs):
    assert a.default is b.default or a.default == b.default, a.name
  extras = {p.name: (p.kind, p.default) for p in ours[len(theirs):]}
  kw = inspect.Parameter.KEYWORD_ONLY
  assert extras == {"tensor_parallel": (kw, None), "axis_name": (kw, None),
                    "token_axis": (kw, -2), "mesh": (kw, None), "impl": (kw, "auto"),
                    "sequence_parallel": (kw, True)}
  assert issubclass(jaxflux.nnx.Linear, nnx.Linear)


def test_no_tensor_parallel_is_flax_linear():
  x = normal(0, (2, 5, 6))
  ours = build(lambda: jaxflux.nnx.Linear(6, 3, bias_init=RANDOM_BIAS, rngs=nnx.Rngs(0)))
  theirs = build(lambda: nnx.Linear(6, 3, bias_init=RANDOM_BIAS, rngs=nnx.Rngs(0)))
  assert_trees_close(params_of(ours), params_of(theirs), rtol=0, atol=0)
  assert_trees_close(value_and_grads(ours, x), value_and_grads(theirs, x), rtol=0, atol=0)


# jax.make_mesh's default axis type is Explicit; Auto once, to keep the file fast.
@pytest.mark.parametrize("tp, axis_type", [(2, EXPLICIT), (4, EXPLICIT), (8, EXPLICIT), (4, AUTO)])
@pytest.mark.parametrize("mode", ["column", "row"])
def test_values_and_grads_match_flax(tp, mode, axis_type):
  x = normal(0, (2, 16, 24))
  with jax.set_mesh(mesh_of((tp,), ("tp",), axis_type)):
    ours = linear(24, 16, mode)
    y, dparams, dx = value_and_grads(ours, x)
  flax_params, expected = flax_result(linear, 24, 16, x.shape)
  assert_trees_close(params_of(ours), flax_params, rtol=0, atol=0)  # Same tree, same draws.
  assert_trees_close((y, dparams, dx), expected)
  assert y.sharding.is_equivalent_to(NamedSharding(y.sharding.mesh, OUT_SPEC[mode]), y.ndim)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_column_row_mlp_matches_flax(tp):
  x = normal(0, (2, 16, 8))
  with jax.set_mesh(mesh_of((tp,), ("tp",))):
    got = value_and_grads(mlp(8, 32), x)
  assert_trees_close(got, flax_result(flax_mlp, 8, 32, x.shape)[1])


def test_checkpoint_loads_both_ways():
  x = normal(0, (2, 16, 8))
  mesh = mesh_of((4,), ("tp",))
  with jax.set_mesh(mesh):
    ours = build(lambda: MLP(8, 32))
  theirs = build(lambda: MLP(8, 32, tensor_parallel=False))
  # The same tree, shapes, dtypes and (same rng streams) values.
  assert_trees_close(params_of(ours), params_of(theirs), rtol=0, atol=0)
  # A Flax checkpoint into ours.
  checkpoint = params_of(flax_mlp(8, 32, seed=5))
  with jax.set_mesh(mesh):
    y_ours = value_and_grads(with_params(ours, checkpoint), x)[0]
  y_flax = value_and_grads(with_params(theirs, checkpoint), x)[0]
  np.testing.assert_allclose(y_ours, y_flax, rtol=1e-5, atol=1e-5)
  # Ours into Flax.
  fresh = with_params(flax_mlp(8, 32, seed=9), params_of(ours))
  np.testing.assert_allclose(value_and_grads(fresh, x)[0], y_ours, rtol=1e-5, atol=1e-5)


def test_partition_specs():
  with jax.set_mesh(mesh_of((4,), ("tp",))):
    model = nnx.eval_shape(lambda: MLP(8, 32))
  specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model)))
  assert specs == {"up": {"kernel": P(None, "tp"), "bias": P("tp")},
                   "down": {"kernel": P("tp", None), "bias": P(None)}}


@pytest.mark.parametrize("axis_type", [EXPLICIT, AUTO])
def test_explicit_mesh_field_equals_ambient_mesh(axis_type):
  mesh = mesh_of((4,), ("tp",), axis_type)
  x = normal(0, (2, 16, 8))
  for mode in ("column", "row"):
    field = value_and_grads(linear(8, 8, mode, mesh=mesh), x)
    with jax.set_mesh(mesh):
      ambient = value_and_grads(linear(8, 8, mode), x)
    assert_trees_close(field, ambient, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dp_type, tp_type", [
  (EXPLICIT, EXPLICIT), (AUTO, AUTO), (EXPLICIT, AUTO), (AUTO, EXPLICIT)])
def test_dp_by_tp_mesh_keeps_batch_sharding(dp_type, tp_type):
  mesh = mesh_of((2, 4), ("dp", "tp"), (dp_type, tp_type))
  x = normal(0, (4, 16, 8))
  # Flax places sharded params when it creates them ("eager sharding"), and refuses
  # meshes that mix Explicit and Auto axes there; the layer's call handles them.
  mixed = dp_type != tp_type
  with jax.set_mesh(mesh), nnx.use_eager_sharding(not mixed):
    x_dp = jax.device_put(x, NamedSharding(mesh, P("dp")))
    model = build(lambda: MLP(8, 32))
    got = value_and_grads(model, x_dp)
    h = jax.jit(lambda x: model.up(x))(x_dp)
  if not mixed:
    assert model.up.kernel.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 2)
  expected = value_and_grads(with_params(flax_mlp(8, 32), params_of(model)), x)
  assert_trees_close(got, expected)
  # Tokens come out sharded over tp, and the batch stays sharded over dp.
  assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, P("dp", "tp", None)), 3)
  assert h.sharding.is_equivalent_to(NamedSharding(mesh, P("dp", None, "tp")), 3)
  if dp_type == EXPLICIT:  # Types pin it; under Auto the compiler may pick another layout.
    assert jax.typeof(got[2]) == jax.typeof(x_dp)  # d(loss)/dx


@pytest.mark.parametrize("mode, shape, token_axis", [
  ("column", (16, 8), -2), ("row", (3, 2, 16, 8), -2),
  ("column", (2, 16, 3, 8), -3), ("row", (16, 3, 8), 0)])
def test_batch_dims_and_token_axis(mode, shape, token_axis):
  x = normal(0, shape)
  with jax.set_mesh(mesh_of((4,), ("tp",))):
    got = value_and_grads(linear(8, 8, mode, token_axis=token_axis), x)
  assert_trees_close(got, value_and_grads(linear(8, 8), x))


@pytest.mark.parametrize("mode", ["column", "row"])
def test_bfloat16_compute_with_float32_params(mode):
  x = normal(0, (2, 16, 32))
  kwargs = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32)
  with jax.set_mesh(mesh_of((4,), ("tp",))):
    ours = linear(32, 16, mode, **kwargs)
    y, dparams, dx = value_and_grads(ours, x)
  assert jax.tree.map(lambda p: p.dtype, params_of(ours)) == {
    "kernel": jnp.float32, "bias": jnp.float32}
  assert y.dtype == jnp.bfloat16
  # Row sums bf16 partial products across devices: agree to bf16 rounding, not bitwise.
  expected = value_and_grads(linear(32, 16, **kwargs), x)
  assert_trees_close((y, dparams, dx), expected, rtol=2e-2, atol=2e-2)


def test_preferred_element_type():
  x = normal(0, (2, 16, 32), jnp.bfloat16)
  kwargs = dict(param_dtype=jnp.bfloat16, preferred_element_type=jnp.float32)
  with jax.set_mesh(mesh_of((4,), ("tp",))):
    y = value_and_grads(linear(32, 16, "column", **kwargs), x)[0]
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(y, value_and_grads(linear(32, 16, **kwargs), x)[0], rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("kwargs, match", [
  (dict(tensor_parallel="col"), "tensor_parallel='col'"),
  (dict(tensor_parallel="row", impl="cuda"), "impl='cuda'"),
  (dict(tensor_parallel="row", token_axis=1.0), "token_axis"),
  (dict(tensor_parallel="column", dot_general=jnp.dot), "dot_general"),
  (dict(tensor_parallel="column", kernel_metadata={"out_sharding": (None, "x")}),
   "kernel_metadata"),
  (dict(tensor_parallel="row", axis_name="model"), r"no axis 'model'.*axis_name="),
  (dict(tensor_parallel="column", out_features=6), "features=6 is not divisible"),
  (dict(tensor_parallel="row", in_features=6), "last dimension 6 is not divisible"),
])
def test_bad_arguments_raise_at_construction(kwargs, match):
  args = dict(in_features=8, out_features=8, rngs=nnx.Rngs(0)) | kwargs
  with jax.set_mesh(mesh_of((4,), ("tp",))), pytest.raises(ValueError, match=match):
    nnx.eval_shape(lambda: jaxflux.nnx.Linear(**args))


def test_no_mesh_raises():
  with pytest.raises(ValueError, match=r"needs a device mesh.*jax.set_mesh"):
    jaxflux.nnx.Linear(8, 8, rngs=nnx.Rngs(0), tensor_parallel="column")


def call_on(mesh, model, x, **kwargs):
  with jax.set_mesh(mesh):
    return jax.eval_shape(lambda x: model(x, **kwargs), x)


@pytest.mark.parametrize("mode", ["column", "row"])
def test_tokens_not_divisible_raises(mode):
  mesh = mesh_of((4,), ("tp",))
  with jax.set_mesh(mesh):
    model = linear(8, 8, mode)
  with pytest.raises(ValueError, match=r"6 tokens, not divisible by the size 4 .*token_axis"):
    call_on(mesh, model, normal(0, (2, 6, 8)))


def test_bad_call_raises():
  mesh = mesh_of((4,), ("tp",))
  with jax.set_mesh(mesh):
    model = linear(8, 8, "row", token_axis=-1)
  with pytest.raises(ValueError, match="token_axis=-1"):
    call_on(mesh, model, normal(0, (16, 8)))
  model.token_axis = -2
  with pytest.raises(ValueError, match="out_sharding"):
    call_on(mesh, model, normal(0, (16, 8)), out_sharding=P())


@pytest.mark.parametrize("mode", ["column", "row"])
def test_fused_impl_raises_without_kernel(mode):
  if jaxflux.has_cuda():
    pytest.skip("the fused kernel is available here")
  mesh = mesh_of((4,), ("tp",))
  with jax.set_mesh(mesh):
    model = linear(8, 8, mode, impl="fused", param_dtype=jnp.bfloat16)
  with pytest.raises(jaxflux.FusedKernelUnavailableError):
    call_on(mesh, model, normal(0, (16, 8), jnp.bfloat16))


def test_docstring_example_runs():
  import doctest
  assert doctest.testmod(jaxflux.nnx, optionflags=doctest.ELLIPSIS).failed == 0
