"""The fused FP8 path as traced on any machine: the ops hand their FFI targets FP8 x, w given
[N, K] and the scales as float32 rows and columns, typed like the XLA path under shard_map; and
a training step of jaxflux.Dense with Flax's FP8 recipe (impl="fused") runs every tensor-parallel
matmul, forward and backward, through the fused targets, with no all-gather or reduce-scatter
of its own. The GPU is faked by patching the platform check; nothing here runs a kernel."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxflux
from conftest import make_mesh, mesh_of
from jaxpr_util import equations

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
AG, RS = "jaxflux_all_gather_matmul", "jaxflux_matmul_reduce_scatter"


def _ffi_calls(jaxpr) -> list:
  """Every ffi_call equation of a closed jaxpr, nested jaxprs included."""
  return [eqn for eqn in equations(jaxpr) if eqn.primitive.name == "ffi_call"]


def _primitives(jaxpr) -> set:
  return {eqn.primitive.name for eqn in equations(jaxpr)}


@pytest.mark.parametrize("x_dtype", [E4M3, E5M2])
def test_op_operands_reach_the_target(fake_hopper, x_dtype):
  mesh = make_mesh((2,), ("tp",))
  x = jnp.ones((2, 256, 64), x_dtype)  # per device [2, 128, 64]
  wt = jnp.ones((32, 64), E4M3)        # per device [16, 64]: [n, K]
  x_scale = jnp.ones((2, 256, 1), jnp.float32)
  f = jax.shard_map(
      lambda x, wt, s: jaxflux.all_gather_matmul(x, wt, "tp", impl="fused", x_scale=s,
                                                 w_scale=jnp.float32(2.0), transpose_w=True),
      mesh=mesh, in_specs=(P(None, "tp"), P("tp"), P(None, "tp")), out_specs=P(None, None, "tp"))
  jaxpr = jax.make_jaxpr(f)(x, wt, x_scale)
  (call,) = _ffi_calls(jaxpr)
  assert call.params["target_name"] == AG
  # x, w, rank info, x's row scales (flattened), w's column scales.
  avals = [v.aval for v in call.invars]
  assert [a.dtype for a in avals] == [jnp.dtype(x_dtype), jnp.dtype(E4M3), jnp.dtype(jnp.int32),
                                      jnp.dtype(jnp.float32), jnp.dtype(jnp.float32)]
  assert avals[3].shape == (2 * 128,) and avals[4].shape == (16,)
  assert call.outvars[0].aval.dtype == jnp.bfloat16
  assert dict(call.params["attributes"])["transpose_w"] == 1
  assert "all_gather" not in _primitives(jaxpr)


def test_reduce_scatter_operands_reach_the_target(fake_hopper):
  mesh = make_mesh((2,), ("tp",))
  x = jnp.ones((256, 128), E5M2)  # per device [256, 64]
  wt = jnp.ones((48, 128), E4M3)  # per device [48, 64]: [N, k]
  f = jax.shard_map(
      lambda x, wt: jaxflux.matmul_reduce_scatter(
          x, wt, "tp", impl="fused", x_scale=jnp.float32(0.5),
          w_scale=jnp.full((1, 48), 2.0, jnp.float32), transpose_w=True),
      mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")), out_specs=P("tp"))
  jaxpr = jax.make_jaxpr(f)(x, wt)
  (call,) = _ffi_calls(jaxpr)
  assert call.params["target_name"] == RS
  avals = [v.aval for v in call.invars]
  assert avals[3].shape == (256,) and avals[4].shape == (48,)
  assert call.outvars[0].aval.shape == (128, 48) and call.outvars[0].aval.dtype == jnp.bfloat16
  assert "reduce_scatter" not in _primitives(jaxpr)


def test_layer_training_step_runs_every_matmul_fused(fake_hopper):
  """A column + row pair of jaxflux.Dense with Flax's FP8 recipe: forward AG (column) and RS
  (row), backward RS (column dX) and AG (row dX), all FP8 through the fused targets; the only
  collectives left are the recipe's amax pmaxes."""
  mesh = mesh_of((2,), ("tp",))

  class Pair(nn.Module):
    @nn.compact
    def __call__(self, x):
      kw = dict(dtype=jnp.bfloat16, impl="fused", dot_general_cls=nn.Fp8DirectDotGeneralOp)
      h = jaxflux.Dense(64, tensor_parallel="column", **kw)(x)
      return jaxflux.Dense(32, tensor_parallel="row", **kw)(h)

  model = Pair()
  x = np.random.default_rng(0).standard_normal((2, 256, 32)).astype(np.float32)
  with jax.set_mesh(mesh):
    variables = jax.eval_shape(model.init, jax.random.key(0), x)

    def loss(variables, x):
      return jnp.sum(model.apply(variables, x).astype(jnp.float32))

    jaxpr = jax.make_jaxpr(jax.grad(loss))(variables, x)
  targets = sorted(c.params["target_name"] for c in _ffi_calls(jaxpr))
  assert targets == sorted([AG, RS, RS, AG]), targets
  fp8 = {jnp.dtype(E4M3), jnp.dtype(E5M2)}
  for call in _ffi_calls(jaxpr):
    x_aval, w_aval = call.invars[0].aval, call.invars[1].aval
    assert x_aval.dtype in fp8 and w_aval.dtype == jnp.dtype(E4M3), call.params["target_name"]
  # Forward x in e4m3; the backward's dY in e5m2.
  assert sorted(str(c.invars[0].aval.dtype) for c in _ffi_calls(jaxpr)) == sorted(
      ["float8_e4m3fn"] * 2 + ["float8_e5m2"] * 2)
  prims = _primitives(jaxpr)
  assert "all_gather" not in prims and "reduce_scatter" not in prims, prims
