"""FP8 operands of all_gather_matmul, matmul_reduce_scatter and matmul_all_reduce on the XLA
reference path, against an independent NumPy float32 computation on fresh random FP8 data: both
FP8 formats in every pairing, per-tensor and row-wise scales, the weight given either way round
(transpose_w), a batch axis, odd sizes, tp = 2 and 4. Also the public transpose_w of non-FP8
calls, values and gradients."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxflux
from conftest import mesh_of

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
M, K_LOCAL, N_LOCAL = 3, 5, 5  # rows per rank, contraction and output columns per rank (odd)
K_AG, N_RS = 20, 7             # all_gather_matmul's whole K, matmul_reduce_scatter's whole N


def _fp8(rng, shape, dtype):
  """Fresh float32 values of a few binades, quantized to `dtype`."""
  values = rng.standard_normal(shape) * rng.choice([0.25, 1.0, 4.0], size=shape)
  return jnp.asarray(values, jnp.float32).astype(dtype)


def _f32(a):
  return np.asarray(a).astype(np.float32)


def _scale(rng, shape):
  return jnp.asarray(rng.uniform(0.25, 4.0, size=shape), jnp.float32)


def _rel_err(got, want) -> float:
  got, want = _f32(got), _f32(want)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _run(mesh, body, args, in_specs, out_specs):
  """Jitted shard_map of `body` with each global argument placed as its in_spec says (the mesh
  of jax.make_mesh has Explicit axes)."""
  placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs))
  return f(*placed)


def _ag_case(rng, tp, x_dtype, w_dtype, scales, batch, transpose_w):
  """Global operands of an all_gather_matmul, the in_specs that give each rank its shard and
  the NumPy float32 reference of y."""
  lead = (batch,) if batch else ()
  x = _fp8(rng, lead + (tp * M, K_AG), x_dtype)
  w = _fp8(rng, (K_AG, tp * N_LOCAL), w_dtype)
  bl = (None,) * len(lead)
  if scales == "tensor":  # one scale per rank's shard, different on each rank
    xs, xs_spec = _scale(rng, (tp,)), P("tp")
    xs_rows = np.repeat(_f32(xs), M)[:, None]
    ws, ws_spec = _scale(rng, (tp,)), P("tp")
    ws_cols = np.repeat(_f32(ws), N_LOCAL)[None, :]
  else:  # row-wise: x_scale [..., m, 1] per rank, w_scale [1, n] per rank
    xs, xs_spec = _scale(rng, lead + (tp * M, 1)), P(*bl, "tp", None)
    xs_rows = _f32(xs)
    ws, ws_spec = _scale(rng, (1, tp * N_LOCAL)), P(None, "tp")
    ws_cols = _f32(ws)
  want = (_f32(x) * xs_rows) @ (_f32(w) * ws_cols)
  w_arg, w_spec = (w.T, P("tp", None)) if transpose_w else (w, P(None, "tp"))
  args = (x, w_arg, xs, ws)
  in_specs = (P(*bl, "tp", None), w_spec, xs_spec, ws_spec)
  return args, in_specs, P(*bl, None, "tp"), want


def _rs_case(rng, tp, x_dtype, w_dtype, scales, batch, transpose_w):
  """Global operands of a matmul_reduce_scatter (x sharded on K, w on its rows), the in_specs
  and the NumPy float32 reference of z: the sum over ranks of each rank's scaled product."""
  lead = (batch,) if batch else ()
  rows = tp * M
  x = _fp8(rng, lead + (rows, tp * K_LOCAL), x_dtype)
  w = _fp8(rng, (tp * K_LOCAL, N_RS), w_dtype)
  bl = (None,) * len(lead)
  if scales == "tensor":
    xs, xs_spec = _scale(rng, (tp,)), P("tp")
    ws, ws_spec = _scale(rng, ()), P()  # one weight scale shared by every rank
    x_rows = [np.full(lead + (rows, 1), v, np.float32) for v in _f32(xs)]
    w_cols = [np.full((1, N_RS), _f32(ws), np.float32)] * tp
  else:  # each rank its own row and column scales
    xs, xs_spec = _scale(rng, lead + (rows, tp)), P(*bl, None, "tp")
    ws, ws_spec = _scale(rng, (tp, N_RS)), P("tp", None)
    x_rows = [_f32(xs)[..., r:r + 1] for r in range(tp)]
    w_cols = [_f32(ws)[r:r + 1] for r in range(tp)]
  ks = [slice(r * K_LOCAL, (r + 1) * K_LOCAL) for r in range(tp)]
  want = sum((_f32(x)[..., ks[r]] * x_rows[r]) @ (_f32(w)[ks[r]] * w_cols[r]) for r in range(tp))
  w_arg, w_spec = (w.T, P(None, "tp")) if transpose_w else (w, P("tp", None))
  args = (x, w_arg, xs, ws)
  in_specs = (P(*bl, None, "tp"), w_spec, xs_spec, ws_spec)
  return args, in_specs, P(*bl, "tp", None), want


def _ar_case(rng, tp, x_dtype, w_dtype, scales, batch, transpose_w, rows=None):
  """Global operands of a matmul_all_reduce (x sharded on K, w on its rows), the in_specs and
  the NumPy float32 reference of y (replicated): the sum over ranks of each rank's scaled
  product. Its rows need not divide by tp: by default an odd count that does not."""
  lead = (batch,) if batch else ()
  rows = tp * M + 1 if rows is None else rows
  x = _fp8(rng, lead + (rows, tp * K_LOCAL), x_dtype)
  w = _fp8(rng, (tp * K_LOCAL, N_RS), w_dtype)
  bl = (None,) * len(lead)
  if scales == "tensor":  # each rank its own scales, shapes () and (1,)
    xs, xs_spec = _scale(rng, (tp,)), P("tp")
    ws, ws_spec = _scale(rng, (tp,)), P("tp")
    x_rows = [np.full(lead + (rows, 1), v, np.float32) for v in _f32(xs)]
    w_cols = [np.full((1, N_RS), v, np.float32) for v in _f32(ws)]
  else:  # each rank its own row and column scales
    xs, xs_spec = _scale(rng, lead + (rows, tp)), P(*bl, None, "tp")
    ws, ws_spec = _scale(rng, (tp, N_RS)), P("tp", None)
    x_rows = [_f32(xs)[..., r:r + 1] for r in range(tp)]
    w_cols = [_f32(ws)[r:r + 1] for r in range(tp)]
  ks = [slice(r * K_LOCAL, (r + 1) * K_LOCAL) for r in range(tp)]
  want = sum((_f32(x)[..., ks[r]] * x_rows[r]) @ (_f32(w)[ks[r]] * w_cols[r]) for r in range(tp))
  w_arg, w_spec = (w.T, P(None, "tp")) if transpose_w else (w, P("tp", None))
  args = (x, w_arg, xs, ws)
  in_specs = (P(*bl, None, "tp"), w_spec, xs_spec, ws_spec)
  return args, in_specs, P(), want


OPS = {
    "all_gather_matmul": (jaxflux.all_gather_matmul, _ag_case),
    "matmul_reduce_scatter": (jaxflux.matmul_reduce_scatter, _rs_case),
    "matmul_all_reduce": (jaxflux.matmul_all_reduce, _ar_case),
}
# (x dtype, w dtype, tp, scales, batch, transpose_w): every dtype pairing with the weight both
# ways round; tp, scale kind and batch each take both values in both weight layouts.
CASES = [
    (E4M3, E4M3, 2, "tensor", None, False), (E4M3, E4M3, 4, "rows", 3, True),
    (E5M2, E4M3, 4, "rows", None, False), (E5M2, E4M3, 2, "tensor", 3, True),
    (E4M3, E5M2, 2, "rows", 3, False), (E4M3, E5M2, 4, "tensor", None, True),
    (E5M2, E5M2, 4, "tensor", 3, False), (E5M2, E5M2, 2, "rows", None, True),
]


def _case_id(case):
  x_dtype, w_dtype, tp, scales, batch, transpose_w = case
  return (f"{jnp.dtype(x_dtype).name[7:]}x{jnp.dtype(w_dtype).name[7:]}-tp{tp}-{scales}"
          f"{'-batch' if batch else ''}{'-wT' if transpose_w else ''}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("op", OPS)
def test_reference_matches_numpy_float32(op, case):
  fn, make = OPS[op]
  x_dtype, w_dtype, tp, scales, batch, transpose_w = case
  rng = np.random.default_rng(CASES.index(case) + 100 * list(OPS).index(op))
  args, in_specs, out_spec, want = make(rng, tp, x_dtype, w_dtype, scales, batch, transpose_w)
  body = lambda x, w, xs, ws: fn(x, w, "tp", x_scale=xs, w_scale=ws, impl="xla",  # noqa: E731
                                 transpose_w=transpose_w,
                                 preferred_element_type=jnp.float32)
  got = _run(mesh_of((tp,), ("tp",)), body, args, in_specs, out_spec)
  assert got.dtype == jnp.float32 and got.shape == want.shape
  assert _rel_err(got, want) < 2e-6


@pytest.mark.parametrize("op", OPS)
def test_default_output_is_bfloat16_and_auto_runs_the_reference(op):
  fn, make = OPS[op]
  rng = np.random.default_rng(7)
  args, in_specs, out_spec, want = make(rng, 2, E4M3, E4M3, "rows", 2, True)
  body = lambda x, w, xs, ws: fn(x, w, "tp", x_scale=xs, w_scale=ws,  # noqa: E731
                                 transpose_w=True)
  got = _run(mesh_of((2,), ("tp",)), body, args, in_specs, out_spec)
  assert got.dtype == jnp.bfloat16
  assert _rel_err(got, want) < 8e-3  # bfloat16's rounding, 2**-9 relative


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("scales", ["tensor", "rows"])
def test_all_reduce_sums_each_ranks_own_scaled_partial(rows, scales):
  """matmul_all_reduce: odd row counts (one row: decode), every rank's result the whole sum
  (out_specs P() checks it is typed replicated), each rank's partial under its own scales."""
  tp = 4
  rng = np.random.default_rng(20 + rows)
  args, in_specs, out_spec, want = _ar_case(rng, tp, E4M3, E4M3, scales, None, True, rows=rows)
  body = lambda x, w, xs, ws: jaxflux.matmul_all_reduce(  # noqa: E731
      x, w, "tp", x_scale=xs, w_scale=ws, impl="xla", transpose_w=True,
      preferred_element_type=jnp.float32)
  got = _run(mesh_of((tp,), ("tp",)), body, args, in_specs, out_spec)
  assert got.shape == (rows, N_RS) and got.dtype == jnp.float32
  assert _rel_err(got, want) < 2e-6
  # Rank 0's scales applied to every rank's partial are far off: the test tells them apart.
  x, wt, xs, ws = (_f32(a) for a in args)
  xs0 = xs[0] if scales == "tensor" else xs[:, :1]
  ws0 = ws[0] if scales == "tensor" else ws[:1]
  assert _rel_err(got, (x * xs0) @ (wt.T * ws0)) > 0.1


@pytest.mark.parametrize("scale_shape", [(), (1,)], ids=["shape()", "shape(1,)"])
def test_per_tensor_x_scale_of_each_rank_stays_with_its_rows(scale_shape):
  """all_gather_matmul gathers x_scale with x: rank r's rows are scaled by rank r's scale."""
  tp = 4
  rng = np.random.default_rng(11)
  x = _fp8(rng, (tp * M, 16), E4M3)
  w = _fp8(rng, (16, tp * N_LOCAL), E4M3)
  scales = jnp.asarray([0.5, 2.0, 8.0, 0.125], jnp.float32)  # rank r's shard gets scales[r]

  def body(x, w, xs):  # xs: this rank's scale, as shape () or (1,)
    return jaxflux.all_gather_matmul(x, w, "tp", x_scale=xs.reshape(scale_shape),
                                     w_scale=jnp.ones((1,), jnp.float32), impl="xla",
                                     preferred_element_type=jnp.float32)

  got = _run(mesh_of((tp,), ("tp",)), body, (x, w, scales),
             (P("tp", None), P(None, "tp"), P("tp")), P(None, "tp"))
  want = (_f32(x) * np.repeat(_f32(scales), M)[:, None]) @ _f32(w)
  assert _rel_err(got, want) < 2e-6
  # Rank 0's scale applied to every rank's rows is far off: the test tells the two apart.
  assert _rel_err(got, float(scales[0]) * _f32(x) @ _f32(w)) > 0.5


@pytest.mark.parametrize("transpose_w", [False, True])
def test_return_gathered_gives_x_full_in_fp8(transpose_w):
  tp = 2
  rng = np.random.default_rng(5)
  args, in_specs, out_spec, want = _ag_case(rng, tp, E5M2, E4M3, "rows", 3, transpose_w)
  x = args[0]

  def body(x, w, xs, ws):
    y, x_full = jaxflux.all_gather_matmul(x, w, "tp", x_scale=xs, w_scale=ws, impl="xla",
                                          return_gathered=True, transpose_w=transpose_w,
                                          preferred_element_type=jnp.float32)
    return y, x_full[None]  # x_full varies over tp, like lax.all_gather's result: stack it

  y, x_full = _run(mesh_of((tp,), ("tp",)), body, args, in_specs, (out_spec, P("tp")))
  assert _rel_err(y, want) < 2e-6
  assert x_full.dtype == jnp.float8_e5m2 and x_full.shape == (tp,) + x.shape
  for copy in np.asarray(x_full):
    np.testing.assert_array_equal(_f32(copy), _f32(x))


# --- transpose_w on non-FP8 calls (the public keyword) ------------------------------------------

@pytest.mark.parametrize("op", OPS)
def test_transpose_w_values_and_grads(op):
  """w given as [N, K]: the same product as w [K, N], and the gradient with respect to the
  transposed weight is the transpose of the plain one (float32, against jnp on global arrays)."""
  tp, rng = 2, np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((2, 6, 8)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((8, 6)), jnp.float32)
  probe = jnp.asarray(rng.standard_normal((2, 6, 6)), jnp.float32)
  if op == "all_gather_matmul":
    specs, out = (P(None, "tp", None), P("tp", None)), P(None, None, "tp")
  elif op == "matmul_all_reduce":
    specs, out = (P(None, None, "tp"), P(None, "tp")), P()
  else:
    specs, out = (P(None, None, "tp"), P(None, "tp")), P(None, "tp", None)
  mesh = mesh_of((tp,), ("tp",))
  f = jax.shard_map(lambda x, wt: OPS[op][0](x, wt, "tp", transpose_w=True, impl="xla"),
                    mesh=mesh, in_specs=specs, out_specs=out)

  def loss(matmul):
    return lambda x, wt: jnp.sum(jnp.sin(matmul(x, wt)) * probe)

  with jax.set_mesh(mesh):
    x_, wt_ = (jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w.T), specs))
    got = jax.jit(f)(x_, wt_)
    grads = jax.jit(jax.grad(loss(f), (0, 1)))(x_, wt_)
  np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5)
  want = jax.grad(loss(lambda x, wt: x @ wt.T), (0, 1))(x, w.T)
  for g, r in zip(grads, want):
    assert float(jnp.abs(r).max()) > 0
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)
