"""tests/fuzz_cases.py, the fused ops' fuzz harness, on CPU: its draws are deterministic,
replayable and cover every op, dtype and feature; its cases run through impl="xla" on a 2-device
CPU mesh and pass against the float64 reference; its check rejects wrong outputs (a partner's
shard, a moved row, one bad element, a NaN, too coarse a rounding, a wrong x_full); its tp=1
gradient references and the MLP's forward and backward agree with JAX's. Slow: every case of
the default draw, rounded as a correct kernel rounds it, passes its check.
"""
import dataclasses

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fuzz_cases as fc
from conftest import make_mesh

SEED = fc.DEFAULT_SEED


def rounded(expected: fc.Expected) -> np.ndarray:
  """What a correct kernel writes: each pushed part rounded to the output dtype, summed in
  float32, the sum rounded (or the product rounded once)."""
  dtype = fc.DTYPES[expected.out_dtype]
  if not expected.terms:
    return expected.y.astype(dtype)
  return sum(t.astype(dtype).astype(np.float32) for t in expected.terms).astype(dtype)


def bits(a) -> np.ndarray:
  return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def with_x_full(expected, y):
  return (y, expected.x_full) if expected.x_full is not None else y


# --- drawing ----------------------------------------------------------------------------------

def test_draws_are_deterministic_and_each_case_replays_alone():
  cases = fc.draw_cases(SEED)
  assert cases == fc.draw_cases(SEED)
  assert len(cases) == len(fc.OPS) * fc.CASES_PER_OP
  others = fc.draw_cases(SEED + 1)
  assert sum(a != b for a, b in zip(cases, others)) > 0.9 * len(cases)
  for case in cases[::37]:
    assert fc.draw_case(SEED, case.op, case.index, case.tp) == case
    first, again = fc.make_shards(case), fc.make_shards(case)
    for a, b in zip(first, again):
      assert a.keys() == b.keys()
      for name in a:
        assert a[name].dtype == b[name].dtype
        assert np.array_equal(bits(a[name]), bits(b[name])), name
  # The replay string a failure prints selects that case, and only it.
  case = cases[len(cases) // 2]
  env = dict(item.split("=") for item in case.replay().split())
  seed, (again,) = fc.from_env(tp=case.tp, environ=env)
  assert (seed, again) == (SEED, case)


def test_select_narrows_the_cases():
  cases = fc.draw_cases(SEED, per_op=10)
  assert fc.select(cases, None) == cases
  assert [(c.op, c.index) for c in fc.select(cases, "rs:2-4,ag:7")] == [
      ("all_gather_matmul", 7), ("matmul_reduce_scatter", 2), ("matmul_reduce_scatter", 3),
      ("matmul_reduce_scatter", 4)]
  assert [(c.op, c.index) for c in fc.select(cases, "matmul_all_reduce:1")] == [
      ("matmul_all_reduce", 1)]
  assert len(fc.select(cases, "3")) == 3 * len(fc.OPS)
  for bad in ("xx:1", "ag", "ag:1-", "-1"):
    with pytest.raises(ValueError, match="JAXFLUX_FUZZ_CASES"):
      fc.select(cases, bad)
  seed, narrowed = fc.from_env(tp=2, environ={"JAXFLUX_FUZZ_SEED": "7", "JAXFLUX_FUZZ_CASES": "2"})
  assert seed == 7 and [c.index for c in narrowed] == [0, 1] * len(fc.OPS)
  assert all(c.seed == 7 for c in narrowed)
  _, table = fc.from_env(tp=2, environ={"JAXFLUX_FUZZ_FORCE_CHOICES": "0"})
  assert not any(c.tuning for c in table)
  assert [dataclasses.replace(c, tuning=()) for c in fc.draw_cases(SEED)] == table


@pytest.mark.parametrize("tp, per_op", [(2, fc.cases_per_op(2)), (4, fc.cases_per_op(4)),
                                        (1, 40)])
def test_draws_cover_every_op_dtype_and_feature(tp, per_op):
  """The default seed's cases at the GPU tests' counts: the kernels' constraints hold on every
  case, and every feature the fuzz is for appears."""
  from jaxflux import tuning
  assert fc.TILE_ROWS == tuning.TILE_ROWS
  assert (fc.AG_TILES, fc.AR_TILES, fc.SWIZZLES) == (tuning.AG_TILES, tuning.AR_TILES,
                                                     tuning.SWIZZLES)
  cases = fc.draw_cases(SEED, tp=tp, per_op=per_op)
  for case in cases:
    if case.tuning:  # the override takes each forced choice at the case's shape
      with tuning.override(case.op, **dict(case.tuning)):
        _choose(tuning, case)
    granule = 16 if case.fp8 else 8
    assert case.k % granule == 0 and case.n % granule == 0, case
    assert 1 <= case.m and case.k <= fc.MAX_DIM and case.n <= fc.MAX_DIM, case
    assert case.work <= fc.MAX_WORK and case.elements <= fc.MAX_ELEMENTS, case
    assert case.x_rows % tp == 0 or case.op != "matmul_reduce_scatter", case
    if case.fp8:
      assert case.transpose_w, case
      assert ("tile", "cooperative_128x128_streamk") not in case.tuning, case  # not built
    if case.op != "all_gather_matmul":
      assert not case.return_gathered, case
  for op in fc.OPS:
    mine = [c for c in cases if c.op == op]
    seen = lambda f: {f(c) for c in mine}  # noqa: E731
    assert seen(lambda c: c.transpose_w) == {False, True}, op
    fp8 = [c for c in mine if c.fp8]
    assert {c.x_scale for c in fp8} == {"tensor", "row"}, op
    assert {c.w_scale for c in fp8} == {"tensor", "column"}, op
    assert {c.scalar_scales for c in fp8 if "tensor" in (c.x_scale, c.w_scale)} == {
        False, True}, op
    assert seen(lambda c: c.dtype) == {"bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"}, op
    if op == "all_gather_matmul":
      assert seen(lambda c: c.return_gathered) == {False, True}
    assert seen(lambda c: len(c.batch)) == {0, 1, 2}, op
    rows = seen(lambda c: c.m)
    assert 1 in rows, op
    assert any(r % 2 for r in rows) and any(r % fc.TILE_ROWS == 0 for r in rows), op
    assert any(r > fc.TILE_ROWS and r % fc.TILE_ROWS for r in rows), op
    dims = seen(lambda c: c.k) | seen(lambda c: c.n)
    assert {8, 16, 24} <= dims and max(dims) >= 2048, op
    forced = {field: {v for c in mine for f, v in c.tuning if f == field}
              for field in ("tile", "reduce", "push")}
    if tp == 1:
      assert not any(c.tuning for c in mine), op  # nothing to choose at tp=1
    elif op == "all_gather_matmul":
      assert forced["tile"] == set(fc.AG_TILES) and () in seen(lambda c: c.tuning)
    elif op == "matmul_reduce_scatter":
      if tp == 2:
        assert forced["reduce"] == {"epilogue", "pass"} and "chunked" in forced["push"]
      else:  # the epilogue reduction (and so a chunked push) serves tp=2 only
        assert forced["reduce"] == {"pass"} and forced["push"] == {"whole"}
    else:
      assert forced["tile"] == set(fc.AR_TILES) and "chunked" in forced["push"]


def _choose(tuning, case):
  """The op's kernel choice for this case, as the fused op asks for it."""
  batch, itemsize = int(np.prod(case.batch)), 2
  if case.op == "all_gather_matmul":
    return tuning.choose_all_gather_matmul(dtype=case.dtype, tp=case.tp,
                                           rows=batch * case.tp * case.m, k=case.k, n=case.n,
                                           sms=132, shard_rows=case.m)
  if case.op == "matmul_reduce_scatter":
    return tuning.choose_matmul_reduce_scatter(dtype=case.dtype, tp=case.tp, batch=batch,
                                               m=case.m, k=case.k, n=case.n, itemsize=itemsize)
  return tuning.choose_matmul_all_reduce(dtype=case.dtype, tp=case.tp, batch=batch, m=case.m,
                                         k=case.k, n=case.n, itemsize=itemsize)


def test_shards_are_fresh_random_data_of_the_right_shapes():
  for case in fc.draw_cases(SEED, per_op=6):
    shards = fc.make_shards(case)
    assert len(shards) == case.tp
    for r, shard in enumerate(shards):
      x, w = shard["x"], shard["w"]
      assert x.shape == case.x_shape and w.shape == case.w_shape, case
      assert x.dtype == fc.DTYPES[case.dtype] and w.dtype == fc.DTYPES[case.w_dtype], case
      for a in (x, w):
        values = a.astype(np.float64)
        assert np.isfinite(values).all() and np.count_nonzero(values) > 0.9 * values.size, case
      if case.fp8:
        xs, ws = shard["x_scale"], shard["w_scale"]
        tensor = () if case.scalar_scales else (1,)
        assert xs.shape == (x.shape[:-1] + (1,) if case.x_scale == "row" else tensor), case
        assert ws.shape == ((1, case.n) if case.w_scale == "column" else tensor), case
        assert xs.dtype == ws.dtype == np.float32 and (xs > 0).all() and (ws > 0).all(), case
        # Quantized from realistic values: neither saturated nor all subnormal.
        assert np.abs(x.astype(np.float32)).max() > float(ml_dtypes.finfo(x.dtype).max) / 8
    if case.fp8 and case.x_scale == "tensor":
      assert shards[0]["x_scale"] != shards[1]["x_scale"], case  # each rank its own scale
    # The ranks' shards are different slices of the global data.
    assert not np.array_equal(bits(shards[0]["x"]), bits(shards[1]["x"]))


# --- running cases through XLA ----------------------------------------------------------------

def _small_cases():
  """Each op's first small case (quick to compile and run on CPU) of each dtype it takes, with
  w as given and transposed."""
  picked = {}
  for c in fc.draw_cases(SEED):
    if c.work <= 2 ** 21 and c.elements <= 2 ** 18:
      picked.setdefault((c.op, c.dtype, c.transpose_w), c)
  return list(picked.values())


@pytest.mark.parametrize("case", _small_cases(), ids=lambda c: f"{fc.SHORT[c.op]}{c.index}")
def test_cases_pass_through_xla_on_two_cpu_devices(case):
  """The harness end to end as the GPU worker runs it (each rank its own shards, each rank's
  output checked), with impl="xla": the references and the bounds agree with JAX."""
  mesh = make_mesh((2,), ("tp",))
  shards = fc.make_shards(case)
  outs = fc.run_case(case, shards, mesh, impl="xla")
  assert sorted(outs) == [0, 1]
  for rank, got in outs.items():
    verdict = fc.check(fc.reference(case, shards, rank), got)
    assert verdict.ok, f"{case.describe()} rank {rank}: {verdict} ({case.replay()})"


# --- the check --------------------------------------------------------------------------------

def _case(op, **fields):
  """A case of `op` big enough that one element is a small share of the Frobenius norm."""
  base = fc.Case(op=op, index=0, seed=SEED, data_seed=11, tp=2, dtype="bfloat16", batch=(2,),
                 m=64, k=64, n=96, transpose_w=False, return_gathered=False)
  return dataclasses.replace(base, **fields)


@pytest.mark.parametrize("case", [
    _case("all_gather_matmul"), _case("all_gather_matmul", return_gathered=True, transpose_w=True),
    _case("matmul_reduce_scatter"), _case("matmul_all_reduce", dtype="float16"),
    _case("matmul_reduce_scatter", dtype="float8_e5m2", transpose_w=True, x_scale="row",
          w_scale="column"),
    _case("all_gather_matmul", dtype="float8_e4m3fn", transpose_w=True, x_scale="tensor",
          w_scale="tensor", return_gathered=True),
], ids=["ag", "ag-gathered", "rs", "ar-fp16", "rs-fp8", "ag-fp8-gathered"])
def test_check_accepts_rounding_and_rejects_wrong_outputs(case):
  shards = fc.make_shards(case)
  want = fc.reference(case, shards, 0)
  right = rounded(want)
  assert fc.check(want, with_x_full(want, right)).ok
  rng = np.random.default_rng(0)

  def rejected(y, x_full=None):
    got = (y, want.x_full if x_full is None else x_full) if want.x_full is not None else y
    return not fc.check(want, got).ok

  y = right.astype(np.float64)
  if case.op == "matmul_all_reduce":  # every rank holds the same sum: a missing peer instead
    assert rejected(want.terms[0])
  else:
    assert rejected(fc.reference(case, shards, 1).y)  # the partner's shard
  moved = y.copy()
  moved[..., 5, :] = y[..., 6, :]  # one row read from the next one
  assert rejected(moved)
  # Half the error the Frobenius bound allows, all in one element (where its own bound is
  # tightest): only the element check sees it.
  frobenius, element = fc.bounds(want)
  one = want.y.copy()
  one[np.unravel_index(np.argmin(element), y.shape)] += 0.5 * frobenius * np.linalg.norm(want.y)
  assert fc.relative_error(one, want.y) < frobenius
  assert rejected(one)
  for poison in (np.nan, np.inf):
    bad = y.copy()
    bad[(0,) * y.ndim] = poison
    assert rejected(bad)
  assert rejected(np.zeros_like(y))
  assert rejected(y[..., :-1, :])
  # An error of 2.5 units of roundoff on every element, as from a kernel a bit short of precision.
  coarse = want.y * (1 + 2.5 * fc.ROUNDING[want.out_dtype] * rng.choice([-1.0, 1.0], y.shape))
  assert rejected(coarse)
  if want.x_full is not None:
    assert rejected(y, np.concatenate([s["x"] for s in shards[::-1]], axis=-2))  # rank order
    flipped = want.x_full.copy()
    flipped.view(np.uint8).reshape(-1)[123] ^= 1
    assert rejected(y, flipped)


# --- the MLP ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlp_reference_matches_jax_on_two_cpu_devices(dtype):
  """The float64 MLP forward and backward the GPU worker checks against, computed by JAX
  (impl="xla") through fuzz_cases.mlp_with_grads: to float32 precision in float32, within
  MLP_TOL in bfloat16."""
  mesh = make_mesh((2,), ("tp",))
  batch, m, d, h = fc.MLP_SHAPES[2]
  data = fc.mlp_data(3, batch, 2 * m, d, h, "bfloat16")
  want = fc.mlp_reference(**data)
  tokens = P(*(None,) * len(batch), "tp", None)
  specs = (tokens, P(None, "tp"), P("tp", None), tokens)
  f = jax.jit(jax.shard_map(lambda *a: fc.mlp_with_grads(*a, impl="xla"), mesh=mesh,
                            in_specs=specs, out_specs=(tokens, tokens, P(None, "tp"),
                                                       P("tp", None))))
  cast = np.float32 if dtype == "float32" else fc.DTYPES[dtype]
  outs = f(*(jax.device_put(data[k].astype(cast), NamedSharding(mesh, s))
             for k, s in zip(("x", "w1", "w2", "ct"), specs)))
  for name, out in zip(("z", "dx", "dw1", "dw2"), outs):
    if dtype == "float32":
      assert fc.relative_error(out, want[name]) < 1e-5, name
    else:
      verdict = fc.mlp_check(out, want[name], dtype)
      assert verdict.ok and out.dtype == cast, f"{name}: {verdict}"
      # 5% off (a wrong scale, a dropped term) is far outside the bound.
      assert not fc.mlp_check(np.asarray(out, np.float64) * 1.05, want[name], dtype).ok, name


@pytest.mark.slow
def test_bounds_accept_correctly_rounded_outputs_of_every_case():
  """Every case of the default draw, rank 0's output rounded as a correct kernel rounds it,
  passes its check: the bounds cannot fail a correct kernel on its rounding."""
  failures = []
  for case in fc.draw_cases(SEED):
    shards = fc.make_shards(case)
    want = fc.reference(case, shards, 0)
    verdict = fc.check(want, with_x_full(want, rounded(want)))
    if not verdict.ok:
      failures.append(f"{case.op} {case.index} {case.describe()}: {verdict}")
  assert not failures, failures


def _tp1_grad_cases():
  """At tp=1: each op's first small bf16/fp16 case with w as given and transposed (and, for
  all_gather_matmul, with and without x_full)."""
  picked = {}
  for c in fc.draw_cases(SEED, tp=1, per_op=40):
    if not c.fp8 and c.work <= 2 ** 21 and c.elements <= 2 ** 18:
      picked.setdefault((c.op, c.transpose_w, c.return_gathered), c)
  return list(picked.values())


@pytest.mark.parametrize("case", _tp1_grad_cases(), ids=lambda c: f"{fc.SHORT[c.op]}{c.index}")
def test_gradient_references_match_xla_at_tp1(case):
  """tests/test_fuzz_gpu.py's gradient check (fuzz_cases.run_grads) with impl="xla" on one CPU
  device: its float64 gradients, x_full's share included, are JAX's."""
  mesh = make_mesh((1,), ("tp",))
  shards = fc.make_shards(case)
  (got,) = fc.run_case(case, shards, mesh, impl="xla").values()
  assert fc.check(fc.reference(case, shards, 0), got).ok
  for name, verdict in fc.run_grads(case, shards, mesh, impl="xla"):
    assert verdict.ok, f"{case.describe()} {name}: {verdict}"


def test_subnormal_outputs_are_bounded_by_half_their_step():
  """Below float16's smallest normal the rounding is absolute, half the subnormal step 2^-24:
  a correctly rounded subnormal passes, one a step further off fails. (A dW of tiny products at
  one row, replay JAXFLUX_FUZZ_CASES=ar:28 at tp=1, has such elements.)"""
  y = np.full((4, 4), 3.733e-7)
  want = fc.Expected(y=y, terms=(), magnitude=np.abs(y).astype(np.float32),
                     out_dtype="float16", fp8=False)
  rounded = y.astype(np.float16)  # 6 * 2^-24 = 3.576e-7
  assert fc.check(want, rounded).ok
  assert not fc.check(want, rounded.astype(np.float64) - 2.0 ** -24).ok


def test_the_one_row_weight_gradient_case_passes_through_xla():
  (case,) = fc.select(fc.draw_cases(SEED, tp=1, per_op=40), "ar:28")
  assert (case.dtype, case.m, case.transpose_w) == ("float16", 1, True)
  mesh = make_mesh((1,), ("tp",))
  for name, verdict in fc.run_grads(case, fc.make_shards(case), mesh, impl="xla"):
    assert verdict.ok, f"{case.describe()} {name}: {verdict}"
