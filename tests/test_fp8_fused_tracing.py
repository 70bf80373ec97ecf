"""The fused FP8 path as traced on any machine: the ops hand their FFI targets FP8 x, w given
[N, K] and the scales as float32 rows and columns, typed like the XLA path under shard_map; and
a training step of jaxflux.Dense with Flax's FP8 recipe (impl="fused") runs every tensor-parallel
matmul that communicates through the fused targets (with sequence parallelism: all four; without:
the row layer's forward GEMM+AllReduce), with no all-gather, reduce-scatter or all-reduce of its
own. The GPU is faked by patching the platform check; nothing here runs a kernel."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxflux
from jaxflux import _runtime, tuning
from jaxflux.ops import _attributes
from jaxflux.ops.gemm import gemm
from conftest import make_mesh, mesh_of
from jaxpr_util import equations

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
AG, RS = "jaxflux_all_gather_matmul", "jaxflux_matmul_reduce_scatter"
AR = "jaxflux_matmul_all_reduce"


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


@pytest.fixture
def workspace(fake_hopper, monkeypatch):
  """The workspace sizes the fused calls ask for, in order."""
  asked = []
  monkeypatch.setattr(_runtime, "ensure_workspace", lambda nbytes: asked.append(nbytes) or 0)
  return asked


@pytest.mark.parametrize("batch,m", [((), 1), ((), 17), ((3,), 100)])
@pytest.mark.parametrize("x_dtype", [E4M3, E5M2])
def test_all_reduce_operands_reach_the_target(workspace, x_dtype, batch, m):
  """x [..., M, k], w [N, k], the rank operand, x's row scales [batch*M] and w's column scales
  [N] (float32); out bfloat16 [..., M, N] typed replicated (out_specs P()); the table's choice
  for bfloat16 partials; two parities of tp slots of one partial each; no psum."""
  tp, k, n = 2, 64, 48
  mesh = make_mesh((tp,), ("tp",))
  lead = (None,) * len(batch)
  x = jnp.ones(batch + (m, tp * k), x_dtype)
  wt = jnp.ones((n, tp * k), E4M3)
  x_scale = jnp.ones(batch + (m, tp), jnp.float32)  # rank r: [..., m, 1]
  f = jax.shard_map(
      lambda x, wt, s: jaxflux.matmul_all_reduce(
          x, wt, "tp", impl="fused", x_scale=s, w_scale=jnp.full((1, n), 2.0, jnp.float32),
          transpose_w=True),
      mesh=mesh, in_specs=(P(*lead, None, "tp"), P(None, "tp"), P(*lead, None, "tp")),
      out_specs=P())
  jaxpr = jax.make_jaxpr(f)(x, wt, x_scale)
  (call,) = _ffi_calls(jaxpr)
  assert call.params["target_name"] == AR
  avals = [v.aval for v in call.invars]
  assert [a.dtype for a in avals] == [jnp.dtype(x_dtype), jnp.dtype(E4M3), jnp.dtype(jnp.int32),
                                      jnp.dtype(jnp.float32), jnp.dtype(jnp.float32)]
  assert avals[0].shape == batch + (m, k) and avals[1].shape == (n, k)
  rows = int(np.prod(batch, dtype=int)) * m
  assert avals[3].shape == (rows,) and avals[4].shape == (n,)
  (out,) = call.outvars
  assert out.aval.shape == batch + (m, n) and out.aval.dtype == jnp.bfloat16
  attrs = dict(call.params["attributes"])
  choice = tuning.choose_matmul_all_reduce(dtype=jnp.dtype(x_dtype).name, tp=tp,
                                           batch=rows // m, m=m, k=k, n=n, itemsize=2).choice
  assert {a: attrs[a] for a in ("tile", "push_chunks", "swizzle", "grid_sms")} == \
      _attributes.matmul_all_reduce(choice)
  assert attrs["transpose_w"] == 1 and attrs["tp"] == tp
  # Two parities of tp receive slots, each one rank's bfloat16 partial, 256-byte aligned.
  assert workspace == [2 * tp * -(-rows * n * 2 // 256) * 256]
  assert not {p for p in _primitives(jaxpr) if p.startswith("psum")}
  assert jax.eval_shape(f, x, wt, x_scale).dtype == jnp.bfloat16


def test_all_reduce_lowers_to_the_custom_call_alone(fake_hopper):
  """The lowered program holds the GEMM+AllReduce custom call and no all-reduce of XLA's."""
  mesh = make_mesh((2,), ("tp",))
  f = jax.jit(jax.shard_map(
      lambda x, wt: jaxflux.matmul_all_reduce(x, wt, "tp", impl="fused", transpose_w=True,
                                              x_scale=jnp.float32(0.5),
                                              w_scale=jnp.float32(2.0)),
      mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")), out_specs=P()))
  text = f.lower(jax.ShapeDtypeStruct((17, 128), E4M3),
                 jax.ShapeDtypeStruct((32, 128), E4M3)).as_text()
  assert text.count(f"stablehlo.custom_call @{AR}(") == 1, text
  assert "stablehlo.all_reduce" not in text, text


def test_all_reduce_at_tp1_is_the_fp8_gemm(fake_hopper):
  """A group of one: the GEMM-only target with the scales, as the other FP8 ops at tp=1."""
  mesh = make_mesh((1,), ("tp",))
  f = jax.shard_map(
      lambda x, wt: jaxflux.matmul_all_reduce(x, wt, "tp", impl="fused", transpose_w=True,
                                              x_scale=jnp.float32(0.5),
                                              w_scale=jnp.float32(2.0)),
      mesh=mesh, in_specs=(P(), P()), out_specs=P())
  jaxpr = jax.make_jaxpr(f)(jnp.ones((3, 32), E5M2), jnp.ones((16, 32), E4M3))
  (call,) = _ffi_calls(jaxpr)
  assert call.params["target_name"] == "jaxflux_gemm"
  attrs = dict(call.params["attributes"])
  assert attrs["kernel"] == 0 and attrs["transpose_w"] == 1 and attrs["fast_accum"] == 1
  # x, w, the unread source, x's row scales [3, 1], w's column scales [1, 16].
  assert [v.aval.shape for v in call.invars][3:] == [(3, 1), (1, 16)]
  assert call.outvars[0].aval.dtype == jnp.bfloat16


@pytest.mark.parametrize("rows", [1, 129, 4096])
def test_gemm_only_mode_takes_fp8_for_the_all_reduce_gemm(fake_hopper, rows):
  """gemm(kernel="matmul_all_reduce") on FP8: CUTLASS's GEMM (kernel 0) tuned as the fused op
  tunes it for bfloat16 partials, with the scales and the built accumulation."""
  k, n = 64, 32
  x_scale, w_scale = jnp.ones((rows, 1), jnp.float32), jnp.ones((1, n), jnp.float32)
  jaxpr = jax.make_jaxpr(lambda x, wt: gemm(x, wt, kernel="matmul_all_reduce", transpose_w=True,
                                            x_scale=x_scale, w_scale=w_scale))(
      jnp.ones((rows, k), E4M3), jnp.ones((n, k), E4M3))
  (call,) = _ffi_calls(jaxpr)
  assert call.params["target_name"] == "jaxflux_gemm"
  attrs = dict(call.params["attributes"])
  choice = tuning.choose_matmul_all_reduce(dtype="float8_e4m3fn", tp=2, batch=1, m=rows, k=k,
                                           n=n, itemsize=2).choice
  assert (attrs["kernel"], attrs["tile"], attrs["swizzle"], attrs["fast_accum"]) == (
      0, tuning.AR_TILES.index(choice.tile), choice.swizzle, 1)
  assert call.outvars[0].aval.dtype == jnp.bfloat16


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


def test_layer_training_step_without_sequence_parallelism(fake_hopper):
  """The same pair with tokens replicated: the row layer's forward is the fused FP8
  GEMM+AllReduce (e4m3 x and weight); the column layer's forward and both backwards are local
  FP8 dots, as the bfloat16 layers' are."""
  mesh = mesh_of((2,), ("tp",))

  class Pair(nn.Module):
    @nn.compact
    def __call__(self, x):
      kw = dict(dtype=jnp.bfloat16, impl="fused", dot_general_cls=nn.Fp8DirectDotGeneralOp,
                sequence_parallel=False)
      h = jaxflux.Dense(64, tensor_parallel="column", **kw)(x)
      return jaxflux.Dense(32, tensor_parallel="row", **kw)(h)

  model = Pair()
  x = np.random.default_rng(0).standard_normal((2, 17, 32)).astype(np.float32)
  with jax.set_mesh(mesh):
    variables = jax.eval_shape(model.init, jax.random.key(0), x)

    def loss(variables, x):
      return jnp.sum(model.apply(variables, x).astype(jnp.float32))

    jaxpr = jax.make_jaxpr(jax.grad(loss))(variables, x)
  (call,) = _ffi_calls(jaxpr)
  assert call.params["target_name"] == AR
  assert [v.aval.dtype for v in call.invars[:2]] == [jnp.dtype(E4M3)] * 2
  assert call.invars[0].aval.shape == (2, 17, 32) and call.invars[1].aval.shape == (32, 32)
  prims = _primitives(jaxpr)
  assert "all_gather" not in prims and "reduce_scatter" not in prims, prims
