"""The tensor-parallel MoE ops (all_gather_grouped_matmul, grouped_matmul_reduce_scatter) and
their routing on 8 virtual CPU devices (pure-JAX path): the routing's invariants against NumPy,
the first op against per-row einsums, a column -> row MoE MLP and its gradients against a dense
per-token reference over the global tokens, jit with traced routing, the fused path as traced
(GPU faked), and the trace-time errors."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxflux
from conftest import make_mesh
from jaxflux import (MoeRouting, all_gather_grouped_matmul, grouped_matmul_reduce_scatter,
                     moe_routing)
from jaxflux import tuning
from jaxflux.ops import _moe_fused, _platform
from jaxpr_util import equations, ffi_calls

G = 4  # experts
POOL = 4096  # jax.random draws of one shape, sliced: eager jax ops each compile per shape


def _draw(fn, seed, shape):
  size = int(np.prod(shape))
  assert size <= POOL, shape
  return np.asarray(fn(jax.random.key(seed), (POOL,)))[:size].reshape(shape)


def rand(seed, shape, scale=1.0):
  return _draw(jax.random.normal, seed, shape) * np.float32(scale)


def expert_ids(seed, tokens, topk, invalid=False):
  """[tokens, topk] ids from a random subset of the experts (so that some stay empty); with
  invalid, about a fifth of the ids outside [0, G) as well."""
  subset = np.argsort(_draw(jax.random.uniform, seed, (G,)))[:G - 1 - seed % 2]
  uniform = _draw(jax.random.uniform, seed + 1, (2, tokens, topk))
  ids = subset[(uniform[0] * len(subset)).astype(np.int32)]
  if invalid:
    ids = np.where(uniform[1] < 0.2, np.where(np.arange(tokens)[:, None] % 2, -1, G), ids)
  return ids.astype(np.int32)


def ref_routing(ids, tp):
  """NumPy: per segment, the stable order of its pairs by expert (invalid ids last) and the
  group sizes; and the sorted keys."""
  keys = np.where((ids >= 0) & (ids < G), ids, G).reshape(tp, -1)
  order = np.argsort(keys, axis=1, kind="stable")
  sizes = np.stack([np.bincount(k, minlength=G + 1)[:G] for k in keys])
  return order, sizes, np.take_along_axis(keys, order, axis=1)


def routing_fn(mesh):
  """Global ids [tp*m, topk] -> every rank's MoeRouting, stacked along a new leading axis."""
  def body(ids):
    return jax.tree.map(lambda a: a[None], moe_routing(ids, G, "tp"))
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))


@pytest.mark.parametrize("tp,m,topk,invalid", [(2, 3, 1, False), (4, 5, 2, True),
                                               (8, 3, 2, False), (1, 8, 2, True)])
def test_routing_invariants(tp, m, topk, invalid):
  mesh = make_mesh((tp,), ("tp",))
  ids = expert_ids(tp + m, tp * m, topk, invalid)
  r = jax.tree.map(np.asarray, routing_fn(mesh)(ids))
  s = m * topk
  assert r.group_sizes.shape == (tp, tp, G) and r.pair_index.shape == (tp, tp, s)
  assert r.row_index.shape == (tp, m, topk) and r.expert_order.shape == (tp, tp * s)
  assert all(a.dtype == np.int32 for a in r)
  order, sizes, sorted_keys = ref_routing(ids, tp)
  for rank in range(tp):  # the same on every rank, the NumPy routing
    np.testing.assert_array_equal(r.pair_index[rank], order)
    np.testing.assert_array_equal(r.group_sizes[rank], sizes)
    np.testing.assert_array_equal(r.expert_order[rank],
                                  np.argsort(sorted_keys.reshape(-1), kind="stable"))
  valid = ((ids >= 0) & (ids < G)).reshape(tp, s)
  np.testing.assert_array_equal(sizes.sum(1), valid.sum(1))
  if not invalid:
    assert (sizes.sum(1) == s).all()
  assert (sizes == 0).any()  # some expert is empty somewhere
  for p in range(tp):
    np.testing.assert_array_equal(np.sort(order[p]), np.arange(s))  # a permutation
    # row_index is the inverse: rank p's pair q sits at row row_index.flat[q] of segment p.
    np.testing.assert_array_equal(order[p][r.row_index[p].reshape(-1)], np.arange(s))
  # Expert-major: nondecreasing experts, each expert's rows in segment order.
  keys = sorted_keys.reshape(-1)[r.expert_order[0]]
  assert (np.diff(keys) >= 0).all()
  starts = np.flatnonzero(np.diff(keys, prepend=-1))
  for run in np.split(r.expert_order[0], starts[1:]):
    assert (np.diff(run) > 0).all()


def test_routing_of_gathered_ids_is_the_same():
  """gathered=True on every rank's ids [tp, m, topk] (replicated) gives the routing that the
  default all-gather of this rank's [m, topk] gives."""
  tp, m, topk = 4, 5, 2
  mesh = make_mesh((tp,), ("tp",))
  ids = expert_ids(11, tp * m, topk, invalid=True)

  def body(ids_all):
    return jax.tree.map(lambda a: a[None], moe_routing(ids_all, G, "tp", gathered=True))
  gathered = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("tp")))
  got = jax.tree.map(np.asarray, gathered(ids.reshape(tp, m, topk)))
  want = jax.tree.map(np.asarray, routing_fn(mesh)(ids))
  for field, a, b in zip(want._fields, got, want):
    np.testing.assert_array_equal(a, b, err_msg=field)


def test_routing_gathers_the_ids_with_the_fused_all_gather(fake_hopper):
  """impl="fused": the ids go through jaxflux's all-gather (a program with no XLA collective),
  and the routing is built from them as from lax.all_gather's."""
  mesh = make_mesh((2,), ("tp",))
  ids = expert_ids(12, 2 * 3, 2, invalid=False)

  def body(ids):
    return jax.tree.map(lambda a: a[None], moe_routing(ids, G, "tp", impl="fused"))
  f = jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
  jaxpr = jax.make_jaxpr(f)(ids)
  assert [target for target, _ in ffi_calls(jaxpr)] == ["jaxflux_all_gather"]
  assert "all_gather" not in {eqn.primitive.name for eqn in equations(jaxpr)}


# --- values and gradients ---------------------------------------------------------------------

def in_specs(transpose_w):
  """x, w1, w2, weights, ids: tokens sharded; w1 column-sharded along its intermediate dim,
  w2 row-sharded along it (laid out [G, out, in] with transpose_w)."""
  w1 = P(None, "tp", None) if transpose_w else P(None, None, "tp")
  w2 = P(None, None, "tp") if transpose_w else P(None, "tp", None)
  return P("tp"), w1, w2, P("tp"), P("tp")


def moe_mlp_fn(mesh, transpose_w, impl="xla", precision=None):
  """The MoE MLP on global arrays: all_gather_grouped_matmul -> tanh ->
  grouped_matmul_reduce_scatter, tokens sequence-parallel over 'tp'."""
  def body(x, w1, w2, weights, ids):
    routing = moe_routing(ids, G, "tp")
    h = all_gather_grouped_matmul(x, w1, routing, axis_name="tp", impl=impl,
                                  transpose_w=transpose_w, precision=precision)
    return grouped_matmul_reduce_scatter(jnp.tanh(h), w2, routing, weights, axis_name="tp",
                                         impl=impl, transpose_w=transpose_w,
                                         precision=precision)
  return jax.shard_map(body, mesh=mesh, in_specs=in_specs(transpose_w), out_specs=P("tp"))


def dense_mlp(x, w1, w2, weights, ids, transpose_w):
  """Each global token through its top-k experts' full MLPs, weighted and summed; ids outside
  [0, G) contribute nothing."""
  w1, w2 = jnp.asarray(w1), jnp.asarray(w2)
  if transpose_w:
    w1, w2 = w1.swapaxes(1, 2), w2.swapaxes(1, 2)
  valid = (ids >= 0) & (ids < G)
  e = jnp.clip(ids, 0, G - 1)
  h = jnp.tanh(jnp.einsum("tK,tkKI->tkI", x, w1[e]))
  out = jnp.einsum("tkI,tkIN->tkN", h, w2[e])
  return jnp.einsum("tkN,tk->tN", out, jnp.where(valid, weights, 0.0))


def value_and_grads(f, r, args):
  """f(*args), and the gradients of sum(f(*args) * r) w.r.t. x, w1, w2 and weights (one jit)."""
  def loss(*args):
    z = f(*args)
    return jnp.sum(z * r), z
  (_, z), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*args)
  return z, grads


def operands(seed, tp, m, topk, k, inter, n, transpose_w, invalid=False):
  tokens = tp * m
  x = rand(seed, (tokens, k))
  w1 = rand(seed + 1, (G, inter, k) if transpose_w else (G, k, inter), k ** -0.5)
  w2 = rand(seed + 2, (G, n, inter) if transpose_w else (G, inter, n), inter ** -0.5)
  weights = rand(seed + 3, (tokens, topk))
  return x, w1, w2, weights, expert_ids(seed + 4, tokens, topk, invalid)


def assert_close(actual, expected, tol):
  expected = np.asarray(expected, np.float64)
  np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=tol,
                             atol=tol * max(1.0, np.abs(expected).max()))


@pytest.mark.parametrize("tp,m,topk,transpose_w", [(2, 3, 1, False), (4, 5, 2, True),
                                                   (8, 3, 2, False), (1, 5, 2, True)])
def test_all_gather_grouped_matmul_matches_per_row_einsum(tp, m, topk, transpose_w):
  mesh = make_mesh((tp,), ("tp",))
  k, n = 6, 5  # per rank n
  x, w1, _, _, ids = operands(10 * tp + m, tp, m, topk, k, tp * n, 1, transpose_w, invalid=True)
  x_spec, w1_spec, *_ = in_specs(transpose_w)

  def body(x, w, ids):
    return all_gather_grouped_matmul(x, w, moe_routing(ids, G, "tp"), axis_name="tp",
                                     impl="xla", transpose_w=transpose_w)
  y = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w1_spec, P("tp")),
                            out_specs=P(None, "tp")))(x, w1, ids)
  assert y.shape == (tp * m * topk, tp * n) and y.dtype == jnp.float32
  # Segment p: rank p's pairs in stable expert order, each row times its expert's full weight
  # (rank r's output columns are w's n-slice r); pairs of no expert are zero rows.
  order, _, sorted_keys = ref_routing(ids, tp)
  w_full = np.asarray(w1, np.float64)
  if transpose_w:
    w_full = w_full.swapaxes(1, 2)
  tokens = (np.arange(tp)[:, None] * m + order // topk).reshape(-1)
  experts = sorted_keys.reshape(-1)
  rows = np.asarray(x, np.float64)[tokens]
  ref = np.einsum("rK,rKn->rn", rows, w_full[np.clip(experts, 0, G - 1)])
  ref[experts == G] = 0
  assert_close(y, ref, 1e-5)
  assert not np.asarray(y)[experts == G].any()


MLP_CASES = [  # (tp, m, topk, transpose_w, invalid ids, seed)
    (2, 3, 1, False, False, 0),
    (4, 5, 2, True, True, 1),
    (8, 3, 2, False, True, 2),
    (2, 8, 2, True, False, 3),
    (1, 5, 2, False, False, 4),
]


@pytest.mark.parametrize("tp,m,topk,transpose_w,invalid,seed", MLP_CASES)
def test_moe_mlp_values_and_grads_match_dense_reference(tp, m, topk, transpose_w, invalid, seed):
  mesh = make_mesh((tp,), ("tp",))
  k, inter, n = 8, 4 * tp, 6  # inter: the intermediate size over all ranks
  args = operands(100 + seed, tp, m, topk, k, inter, n, transpose_w, invalid)
  r = rand(200 + seed, (tp * m, n))
  f = moe_mlp_fn(mesh, transpose_w)
  ref = functools.partial(dense_mlp, transpose_w=transpose_w)
  z, grads = value_and_grads(f, r, args)
  z_ref, ref_grads = value_and_grads(ref, r, args)
  assert z.shape == (tp * m, n) and z.dtype == jnp.float32
  assert_close(z, z_ref, 1e-5)
  for name, got, want, arg in zip(("x", "w1", "w2", "weights"), grads, ref_grads, args):
    assert got.shape == arg.shape and got.dtype == arg.dtype, name
    assert_close(got, want, 1e-4)
  if invalid:  # pairs routed nowhere get no weight gradient
    assert not np.asarray(grads[3])[(args[4] < 0) | (args[4] >= G)].any()


@pytest.mark.parametrize("precision", [jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST])
def test_precision_reaches_every_xla_product(precision):
  """The XLA path multiplies in the precision it is given, forward and backward (weight
  gradients included), and computes the same values."""
  tp, m, topk = 2, 3, 2
  mesh = make_mesh((tp,), ("tp",))
  args = operands(600, tp, m, topk, 8, 4 * tp, 6, False)
  f = moe_mlp_fn(mesh, False, precision=precision)
  r = rand(601, (tp * m, 6))
  loss = lambda *a: jnp.sum(f(*a) * r)  # noqa: E731
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
  products = [e for e in equations(jaxpr) if e.primitive.name.startswith("ragged_dot")]
  # forward: one per segment per op; backward: the partner op's per segment and a weight
  # gradient (a ragged_dot's transpose) per op
  assert len(products) >= 4 * tp + 2, [e.primitive.name for e in products]
  assert {e.params["precision"] for e in products} == {(precision, precision)}
  z, grads = value_and_grads(f, r, args)
  z_ref, ref_grads = value_and_grads(functools.partial(dense_mlp, transpose_w=False), r, args)
  assert_close(z, z_ref, 1e-5)
  for got, want in zip(grads, ref_grads):
    assert_close(got, want, 1e-4)


def test_jit_traces_the_routing_once():
  tp, m, topk = 4, 3, 2
  mesh = make_mesh((tp,), ("tp",))
  traces = []
  f = moe_mlp_fn(mesh, False)

  @jax.jit
  def step(*args):
    traces.append(None)
    return f(*args)

  x, w1, w2, weights, _ = operands(300, tp, m, topk, 8, 4 * tp, 8, False)
  ref = jax.jit(functools.partial(dense_mlp, transpose_w=False))
  for seed in (1, 2, 3):
    ids = expert_ids(seed, tp * m, topk, invalid=seed == 3)
    assert_close(step(x, w1, w2, weights, ids), ref(x, w1, w2, weights, ids), 1e-5)
  assert len(traces) == 1


def test_bfloat16_in_bfloat16_out():
  tp, m, topk = 2, 4, 2
  mesh = make_mesh((tp,), ("tp",))
  args = operands(400, tp, m, topk, 8, 8, 8, False)
  bf16 = [jnp.asarray(a, jnp.bfloat16) for a in args[:3]] + list(args[3:])
  z = jax.jit(moe_mlp_fn(mesh, False))(*bf16)
  assert z.dtype == jnp.bfloat16
  assert_close(z, jax.jit(functools.partial(dense_mlp, transpose_w=False))(*args), 5e-2)


# --- the fused path, traced (nothing runs a kernel) -------------------------------------------

def ffi_targets(jaxpr) -> set:
  return {e.params["target_name"] for e in equations(jaxpr) if "target_name" in e.params}


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_forward_and_grad_trace(fake_hopper, tp):
  mesh = make_mesh((tp,), ("tp",))
  args = [jnp.asarray(a, jnp.bfloat16) if a.dtype == np.float32 else a
          for a in operands(500, tp, 4, 2, 16, 16 * tp, 16, False)]
  f = moe_mlp_fn(mesh, False, impl="fused")
  r = jnp.ones((tp * 4, 16), jnp.float32)
  loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * r)  # noqa: E731
  forward = ffi_targets(jax.make_jaxpr(f)(*args))
  backward = ffi_targets(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args))
  if tp == 1:  # the grouped GEMM alone; gather and combine in XLA
    assert forward == backward == {"jaxflux_grouped_gemm"}
  else:
    ops = {f"jaxflux_{_moe_fused._AG_OP}", f"jaxflux_{_moe_fused._RS_OP}"}
    assert forward == ops
    # the weight gradients, and the combine weights' copy-engine all-gather (no XLA collective)
    assert backward == ops | {"jaxflux_grouped_gemm", "jaxflux_all_gather"}


@pytest.mark.parametrize("tp", [1, 2])
def test_auto_is_the_tuning_tables_rule(fake_hopper, monkeypatch, tp):
  # impl="auto" asks the rule every op family shares: the MoE ops' takes the kernels at any tp;
  # without it, the reference (no jaxflux call at all).
  mesh = make_mesh((tp,), ("tp",))
  args = [jnp.asarray(a, jnp.bfloat16) if a.dtype == np.float32 else a
          for a in operands(510, tp, 4, 2, 16, 16 * tp, 16, False)]
  f = moe_mlp_fn(mesh, False, impl="auto")
  assert ffi_targets(jax.make_jaxpr(f)(*args)) == ffi_targets(
      jax.make_jaxpr(moe_mlp_fn(mesh, False, impl="fused"))(*args))
  monkeypatch.setattr(tuning, "AUTO_RULES", ())
  assert ffi_targets(jax.make_jaxpr(moe_mlp_fn(mesh, False, impl="auto"))(*args)) == set()


@pytest.mark.parametrize("tp", [1, 2])
def test_the_grouped_tile_override_reaches_every_kernel_call(fake_hopper, tp):
  # The MoE ops read override("grouped_matmul", tile=...) where they are called and hand it to
  # every grouped GEMM they trace, fused or not, forward and backward (dw included).
  mesh = make_mesh((tp,), ("tp",))
  args = [jnp.asarray(a, jnp.bfloat16) if a.dtype == np.float32 else a
          for a in operands(520, tp, 4, 2, 16, 16 * tp, 16, False)]
  r = jnp.ones((tp * 4, 16), jnp.float32)
  for tile in tuning.GROUPED_TILES:  # a function of its own per block: JAX caches its traces
    f = moe_mlp_fn(mesh, False, impl="fused")
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * r)  # noqa: E731
    with tuning.override("grouped_matmul", tile=tile):
      jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    tiles = [attrs["tile"] for _, attrs in ffi_calls(jaxpr) if "tile" in attrs]
    assert len(tiles) >= 4 and set(tiles) == {tuning.GROUPED_TILES.index(tile)}, (tile, tiles)


# --- errors -----------------------------------------------------------------------------------

def arr(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def trace(fn, *args, tp=2):
  """Traces fn(*per-device args) in a shard_map over 'tp' (every arg sharded on axis 0)."""
  mesh = make_mesh((tp,), ("tp",))
  specs = tuple(P("tp") for _ in args)
  global_args = [arr((a.shape[0] * tp,) + a.shape[1:], a.dtype) for a in args]
  return jax.eval_shape(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("tp")),
                        *global_args)


IDS = arr((3, 2), jnp.int32)  # m=3 tokens, topk=2 per rank: s=6


def ag(x, w, ids, **kw):
  return all_gather_grouped_matmul(x, w, moe_routing(ids, G, "tp"), axis_name="tp", **kw)


def rs(h, w, weights, ids, **kw):
  return grouped_matmul_reduce_scatter(h, w, moe_routing(ids, G, "tp"), weights,
                                       axis_name="tp", **kw)


@pytest.mark.parametrize("kw,x,w,error,match", [
    ({}, arr((3, 8, 1)), arr((G, 8, 4)), ValueError, r"x must have rank 2 \(\[rows, K\]\)"),
    ({}, arr((3, 8)), arr((8, 4)), ValueError, r"w must have rank 3 \(\[G, K, N\]"),
    ({}, arr((3, 8)), arr((G, 4, 8)), ValueError,
     r"x has K=8 .*but w has K=4 \(w.shape=\(4, 4, 8\), transpose_w=False\).*transpose_w=True"),
    ({"transpose_w": True}, arr((3, 8)), arr((G, 8, 4)), ValueError,
     r"w has K=4 .*transpose_w=True\).*pass transpose_w=False"),
    ({}, arr((3, 8)), arr((G + 1, 8, 4)), ValueError,
     r"w has G=5 experts .*routing counts rows for 4.*num_experts=5"),
    ({}, arr((4, 8)), arr((G, 8, 4)), ValueError, r"x has 4 tokens .*made for 3"),
    ({}, arr((3, 8), jnp.int32), arr((G, 8, 4)), TypeError, r"x must be a floating-point"),
    ({}, arr((3, 8), jnp.float8_e4m3fn), arr((G, 8, 4)), TypeError, r"FP8"),
    ({"impl": "cuda"}, arr((3, 8)), arr((G, 8, 4)), ValueError,
     r"impl='cuda' is not one of"),
    ({"transpose_w": 1}, arr((3, 8)), arr((G, 8, 4)), TypeError, r"transpose_w must be a Python"),
])
def test_all_gather_grouped_matmul_errors(kw, x, w, error, match):
  with pytest.raises(error, match=r"all_gather_grouped_matmul: .*" + match):
    trace(lambda x, ids: ag(x, w, ids, **kw), x, IDS)


@pytest.mark.parametrize("h,weights,error,match", [
    (arr((10, 4)), arr((3, 2)), ValueError, r"h must hold tp\*s = 2\*6 = 12 rows"),
    (arr((12, 4)), arr((3, 1)), ValueError, r"weights must have shape \[m, topk\] = \(3, 2\)"),
    (arr((12, 4)), arr((3, 2), jnp.int32), TypeError, r"weights must be a floating-point"),
    (arr((12, 5)), arr((3, 2)), ValueError, r"contraction sizes differ: h has K=5 .*but w has K=4"),
])
def test_grouped_matmul_reduce_scatter_errors(h, weights, error, match):
  w = jnp.zeros((G, 4, 8))

  def body(weights, ids):  # h's rows are every segment's: not sharded
    return rs(jnp.zeros(h.shape, h.dtype), w, weights, ids)
  with pytest.raises(error, match=r"grouped_matmul_reduce_scatter: " + match):
    trace(body, weights, IDS)


def test_routing_errors():
  with pytest.raises(ValueError, match=r"moe_routing: expert_ids must have rank 2.*\[:, None\]"):
    trace(lambda ids: moe_routing(ids[:, 0], G, "tp").row_index, IDS)
  with pytest.raises(TypeError, match=r"moe_routing: expert_ids must have an integer dtype"):
    trace(lambda ids: moe_routing(ids, G, "tp").row_index, arr((3, 2)))
  with pytest.raises(ValueError, match=r"moe_routing: num_experts=0 must be a positive"):
    trace(lambda ids: moe_routing(ids, 0, "tp").row_index, IDS)
  with pytest.raises(ValueError, match=r"with gathered=True expert_ids must be \[tp, m, topk\]"):
    trace(lambda ids: moe_routing(ids, G, "tp", gathered=True).row_index, IDS)
  with pytest.raises(ValueError, match=r"moe_routing: unknown axis_name='ep'"):
    trace(lambda ids: moe_routing(ids, G, "ep").row_index, IDS)
  with pytest.raises(ValueError, match=r"moe_routing: impl='auto' is not one of \('xla', "
                                       r"'fused'\)"):
    trace(lambda ids: moe_routing(ids, G, "tp", impl="auto").row_index, IDS)
  with pytest.raises(TypeError, match=r"routing must be the MoeRouting of moe_routing"):
    trace(lambda x, ids: all_gather_grouped_matmul(
        x, jnp.zeros((G, 8, 4)), tuple(moe_routing(ids, G, "tp")), axis_name="tp"),
        arr((3, 8)), IDS)


def test_routing_for_another_tp_is_refused():
  def body(x, ids):
    routing = moe_routing(ids, G, "tp")
    halved = MoeRouting(routing.group_sizes[:1], routing.pair_index[:1], routing.row_index,
                        routing.expert_order[:6])
    return all_gather_grouped_matmul(x, jnp.zeros((G, 8, 4)), halved, axis_name="tp")
  with pytest.raises(ValueError, match=r"routing.group_sizes has shape \(1, 4\), but the mesh "
                                       r"axis has tp=2 ranks"):
    trace(body, arr((3, 8)), IDS)


@pytest.mark.skipif(_platform.platform_reason() is None, reason="the fused kernels run here")
@pytest.mark.parametrize("op", ["all_gather_grouped_matmul", "grouped_matmul_reduce_scatter"])
def test_fused_raises_unavailable(op):
  w = jnp.zeros((G, 8, 8), jnp.bfloat16)
  if op == "all_gather_grouped_matmul":
    body, args = (lambda x, ids: ag(x, w, ids, impl="fused")), (arr((3, 8), jnp.bfloat16), IDS)
  else:
    body = lambda weights, ids: rs(jnp.zeros((12, 8), jnp.bfloat16), w, weights, ids,  # noqa
                                   impl="fused")
    args = (arr((3, 2)), IDS)
  with pytest.raises(jaxflux.FusedKernelUnavailableError,
                     match=re.escape(f"{op}(impl='fused'): ") + r".*(CUDA|GPU)"):
    trace(body, *args)


def test_forward_mode_is_refused():
  tp, m, topk = 2, 3, 2
  mesh = make_mesh((tp,), ("tp",))
  x, w1, w2, weights, ids = operands(600, tp, m, topk, 8, 8, 8, False)
  f = moe_mlp_fn(mesh, False)
  # Traced inside jit (nothing runs): jvp reaches each op with tangents attached.
  with pytest.raises(TypeError, match=r"jaxflux\.all_gather_grouped_matmul: can't apply "
                                      r"forward-mode autodiff"):
    jax.jit(lambda x: jax.jvp(lambda x: f(x, w1, w2, weights, ids), (x,), (x,)))(x)
  with pytest.raises(TypeError, match=r"jaxflux\.grouped_matmul_reduce_scatter: can't apply "
                                      r"forward-mode autodiff"):
    jax.jit(lambda v: jax.jvp(lambda v: f(x, w1, w2, v, ids), (v,), (v,)))(weights)
