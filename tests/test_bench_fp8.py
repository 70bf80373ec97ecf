"""The FP8 GEMM-only table (`python -m jaxflux.bench --op gemm --dtype float8_e4m3fn`) on CPU:
its rows, arguments, data, quantizing pass, JSON and printed table, with a stand-in for the FP8
kernels (jaxflux.ops.gemm.gemm needs a GPU); the timings on GPU come from benchmarks/gpu_check.sh.
"""
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflux import bench
from jaxflux.bench import fp8_table, gemm_table
from jaxflux.ops import gemm as gemm_module
from jaxflux.bench.rows import Row, build_rows

SHAPES = {"ag_gemm": [{"name": "tiny-ag", "K": 64, "N": 96}],
          "gemm_rs": [{"name": "tiny-rs", "K": 128, "N": 32}], "M": [64]}
ON_CPU = jax.default_backend() == "cpu"


@pytest.fixture(scope="module")
def shapes_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("bench_fp8") / "shapes.json"
  path.write_text(json.dumps(SHAPES))
  return path


def _fake_gemm(calls):
  """Stands in for jaxflux.ops.gemm.gemm's FP8 form on CPU: checks the arguments against the FP8
  contract and computes what the kernel must, recording (kernel, accumulate) per call."""
  def gemm(x, wt, *, kernel, c=None, transpose_w, x_scale, w_scale, out_dtype, accumulate):
    assert kernel in ("cutlass", "all_gather_matmul", "own_rows", "matmul_all_reduce")
    assert transpose_w
    assert (c is not None) == (kernel == "own_rows") and out_dtype == jnp.bfloat16
    # Only CUTLASS's kernel takes a forced accumulation; the fused ones run as built.
    assert accumulate is None or (kernel == "cutlass" and accumulate in ("promoted", "fast"))
    assert x.dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2) and wt.dtype == jnp.float8_e4m3fn
    assert x_scale.shape == x.shape[:-1] + (1,) and w_scale.shape == (1, wt.shape[0])
    assert x_scale.dtype == w_scale.dtype == jnp.float32
    if c is not None:
      assert c.dtype == jnp.bfloat16 and c.shape == x.shape[:-1] + (wt.shape[0],)
    calls.append((kernel, accumulate))
    y = (x.astype(jnp.float32) * x_scale) @ (wt.astype(jnp.float32) * w_scale.T).T
    return (y if c is None else y + c.astype(jnp.float32)).astype(out_dtype)
  return gemm


def _run(shapes_file, out, *extra):
  argv = ["--op", "gemm", "--dtype", "float8_e4m3fn", "--shapes-file", str(shapes_file),
          "--M", "64", "--iters", "3", "--warmup", "1", "--repeats", "2", "--out", str(out),
          *extra]
  result = bench.run(argv, log=lambda *a, **k: None)
  return result, json.loads(open(result["output"]).read())


def test_fp8_rows_are_the_ag_and_rs_gemms_with_the_weight_transposed():
  args = SimpleNamespace(op="gemm", M=None, shapes=None, dtype="float8_e4m3fn", sizes_mib=None,
                         of=None)
  rows = build_rows(args, SHAPES, 2)
  assert [(r.of, r.M) for r in rows] == ([("ag_gemm", m) for m in (2048, 4096, 8192, 16384)] +
                                         [("gemm_rs", m) for m in (2048, 4096, 8192, 16384)])
  assert all(r.fp8 and r.itemsize == 1 for r in rows)
  ag, rs = rows[0], rows[4]
  assert ag.per_device_shapes == {"x": [2048, 64], "wt": [48, 64], "out": [2048, 48]}
  assert rs.per_device_shapes == {"x": [2048, 64], "wt": [32, 64], "out": [2048, 32],
                                  "own_rows": {"x": [1024, 64], "c": [1024, 32],
                                               "out": [1024, 32]}}
  args.of = ["gemm_ar"]  # on request: GEMM+AllReduce's GEMM at decode and prefill rows
  ar = build_rows(args, SHAPES, 2)
  assert [r.M for r in ar[:7]] == [1, 8, 32, 128, 512, 2048, 8192]
  assert ar[0].per_device_shapes == {"x": [1, 64], "wt": [32, 64], "out": [1, 32]}


def test_fp8_arguments():
  args = bench.parse_args(["--op", "gemm", "--dtype", "float8_e5m2"])
  assert args.variants == ["xla_fp8_fast", "xla_fp8_promoted", "fp8_gemm_only",
                           "cutlass_fp8_fast", "cutlass_fp8_promoted", "quantize"]
  assert bench.parse_args(["--op", "gemm"]).variants[0] == "xla"  # bf16: the table as before
  for bad in (["--op", "gemm", "--dtype", "float8_e4m3fn", "--variants", "xla"],
              ["--op", "gemm", "--variants", "xla_fp8_fast"],
              ["--op", "ag_gemm", "--dtype", "float8_e4m3fn"],
              ["--op", "gemm", "--dtype", "float9"]):
    with pytest.raises(SystemExit):
      bench.parse_args(bad)


@pytest.mark.parametrize("x_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_quantize_pass_uses_the_format_and_writes_the_weight_transposed(x_dtype):
  kx, kw = jax.random.split(jax.random.key(3))
  xb = (3.0 * jax.random.normal(kx, (96, 64), jnp.float32)).astype(jnp.bfloat16)
  wb = (0.02 * jax.random.normal(kw, (64, 48), jnp.float32)).astype(jnp.bfloat16)
  x8, wt8, sx, sw = jax.jit(fp8_table.quantize_pass, static_argnums=2)(xb, wb, x_dtype)
  assert x8.dtype == x_dtype and x8.shape == (96, 64)
  assert wt8.dtype == jnp.float8_e4m3fn and wt8.shape == (48, 64)
  assert sx.shape == sw.shape == () and sx.dtype == jnp.float32
  for q, s, a, dtype in ((x8, sx, xb, x_dtype), (wt8, sw, wb.T, jnp.float8_e4m3fn)):
    fmax = float(jnp.finfo(dtype).max)
    q32 = np.asarray(q, np.float32)
    # The largest magnitude lands just under the format's largest: the range is well used.
    assert 0.9 * fmax <= np.abs(q32).max() <= fmax
    assert float(s) == float(jnp.asarray(s, jnp.bfloat16))  # a bf16 value: exact in every form
    got, want = q32 * float(s), np.asarray(a, np.float32)
    # Rounding to nearest: half a mantissa step, or half the smallest step among subnormals.
    step = 2.0 ** -(4 if dtype == jnp.float8_e4m3fn else 3)
    tiny = float(jnp.finfo(dtype).smallest_subnormal) / 2
    assert np.all(np.abs(got - want) <= (step * np.abs(want) + tiny * float(s)) * (1 + 1e-6))


@pytest.mark.slow
def test_fp8_table_run_with_fake_kernels(shapes_file, tmp_path, monkeypatch):
  calls = []
  monkeypatch.setattr(gemm_module, "gemm", _fake_gemm(calls))
  monkeypatch.setattr(gemm_module, "FP8_ACCUMULATE", {"float8_e4m3fn": "fast"}, raising=False)
  result, on_disk = _run(shapes_file, tmp_path / "f.json")
  assert on_disk["settings"]["dtype"] == "float8_e4m3fn"
  assert on_disk["settings"]["fp8"]["w_layout"].startswith("[N, K]")
  ag, rs = on_disk["rows"]
  assert (ag["of"], rs["of"], ag["dtype"]) == ("ag_gemm", "gemm_rs", "float8_e4m3fn")
  products = fp8_table.PRODUCTS
  for r in (ag, rs):
    assert r["accumulate"] == "fast"
    assert set(r["ms"]) == set(products) | {"quantize"}
    assert all(t > 0 for t in r["ms"].values()), r["errors"]
    # Against the float32 product of the same FP8 values: the bf16 output's rounding only.
    assert set(r["rel_err"]) == set(products)
    assert all(0 < e < 1e-2 for e in r["rel_err"].values()), r["rel_err"]
    ratios = r["ratios"]
    # The fused kernels against XLA accumulating as they do (fast for e4m3 here).
    assert ratios["fp8_gemm_only_vs_xla_fp8"] == pytest.approx(
        r["ms"]["fp8_gemm_only"] / r["ms"]["xla_fp8_fast"], rel=1e-4)
    for acc in ("fast", "promoted"):
      assert ratios[f"cutlass_fp8_{acc}_vs_xla_fp8_{acc}"] == pytest.approx(
          r["ms"][f"cutlass_fp8_{acc}"] / r["ms"][f"xla_fp8_{acc}"], rel=1e-4)
    assert ratios["quantize_vs_fp8_gemm_only"] == pytest.approx(
        r["ms"]["quantize"] / r["ms"]["fp8_gemm_only"], rel=1e-4)
    assert r["tflops"]["quantize"] is None and r["tflops"]["xla_fp8_fast"] > 0
    if ON_CPU:  # XLA's CPU dot: no cuBLASLt call to record
      assert r["xla_fp8_fast_custom_calls"] == [] and r["xla_fp8_promoted_triton_gemm"] is False
      assert r["warnings"] == []
  assert ag["quantize_tbps"] == pytest.approx(3 * (64 * 64 + 64 * 48) / ag["ms"]["quantize"] / 1e9,
                                              rel=1e-4)
  # The AG kernel on all rows; GEMM+RS: the peer rows by CUTLASS, the own rows adding them; both
  # as built. CUTLASS's GEMM alone in each mode.
  assert set(calls) == {("all_gather_matmul", None), ("cutlass", None), ("own_rows", None),
                        ("cutlass", "fast"), ("cutlass", "promoted")}
  summary = on_disk["summary"]
  assert summary["ag_gemm"]["fp8_gemm_only_vs_xla_fp8"]["mean"] == pytest.approx(
      ag["ratios"]["fp8_gemm_only_vs_xla_fp8"], rel=1e-4)
  assert summary["gemm_rs"]["rel_err_fp8_gemm_only"]["worst"] == pytest.approx(
      rs["rel_err"]["fp8_gemm_only"], rel=1e-4)
  text = gemm_table.format_gemm_table(result)
  assert text.startswith("of ") and "gemm_rs rel_err_xla_fp8_promoted: mean" in text
  assert "tiny-rs" in text


def test_fp8_gemm_only_calls_gemm_as_the_contract_says(monkeypatch):
  """GEMM+RS's composition on its inputs: the peer rows' partial added by the own-rows kernel,
  equal to its reference view (peer rows' product + own rows' product)."""
  calls = []
  monkeypatch.setattr(gemm_module, "gemm", _fake_gemm(calls))
  row = Row("gemm", "t", 64, 128, 32, 2, "float8_e5m2", "gemm_rs")
  mesh = bench.make_mesh(1)
  (arrays,) = bench.make_inputs(row, mesh, 1, seed=0)
  assert arrays["x"].dtype == jnp.float8_e5m2 and arrays["wt"].shape == (32, 64)
  np.testing.assert_array_equal(np.asarray(arrays["x_peer"], np.float32),
                                np.asarray(arrays["x"], np.float32)[:32])
  variant = bench.make_variant("fp8_gemm_only", row)
  got = variant.fn(*(arrays[n] for n in variant.inputs))
  want = variant.reference_view(jax.jit(variant.reference)(
      *(arrays[n] for n in variant.reference_inputs)))
  assert got.shape == (32, 32) and calls == [("cutlass", None), ("own_rows", None)]
  assert np.linalg.norm(np.asarray(got, np.float32) - want) <= 1e-2 * np.linalg.norm(want)


def test_fp8_dispatch_timing_takes_the_quantizing_pass_s_several_outputs(shapes_file, tmp_path):
  _, on_disk = _run(shapes_file, tmp_path / "d.json", "--timing", "dispatch", "--of", "ag_gemm",
                    "--variants", "xla_fp8_promoted,quantize")
  (row,) = on_disk["rows"]
  assert row["ms"]["xla_fp8_promoted"] > 0 and row["ms"]["quantize"] > 0
  assert row["errors"]["fp8_gemm_only"] == "not requested"


def test_fp8_table_without_kernels_records_why(shapes_file, tmp_path):
  if not ON_CPU:
    pytest.skip("checks the reasons off GPU")
  _, on_disk = _run(shapes_file, tmp_path / "n.json", "--of", "gemm_rs",
                    "--variants", "xla_fp8_fast,fp8_gemm_only")
  (row,) = on_disk["rows"]
  assert row["ms"]["xla_fp8_fast"] > 0 and row["ms"]["fp8_gemm_only"] is None
  assert row["errors"]["fp8_gemm_only"]
  assert on_disk["summary"]["gemm_rs"]["fp8_gemm_only_vs_xla_fp8"]["mean"] is None


def test_xla_fp8_without_an_fp8_gemm_is_flagged_on_gpu(shapes_file, tmp_path, monkeypatch):
  """On GPU, an XLA variant whose compiled program holds no FP8 GEMM (cuBLASLt's FP8 matmul or
  a Triton GEMM) is reported: it would time something else. CPU's dot stands in for that case."""
  from jaxflux.bench import measure
  monkeypatch.setattr(measure, "is_gpu", lambda: True)
  result, on_disk = _run(shapes_file, tmp_path / "w.json", "--of", "ag_gemm",
                         "--variants", "xla_fp8_promoted")
  (row,) = on_disk["rows"]
  assert len(row["warnings"]) == 1 and row["warnings"][0].startswith(
      "xla_fp8_promoted: neither an FP8 cuBLASLt matmul nor a Triton GEMM")
  assert "warning: tiny-ag M=64: xla_fp8_promoted: neither" in gemm_table.format_gemm_table(result)


def test_fp8_gemm_ar_rows_run_the_all_reduce_gemm(monkeypatch):
  """gemm_ar rows: fp8_gemm_only is GEMM+AllReduce's GEMM as tuned (decode: swap-AB)."""
  calls = []
  monkeypatch.setattr(gemm_module, "gemm", _fake_gemm(calls))
  row = Row("gemm", "t", 8, 128, 32, 2, "float8_e4m3fn", "gemm_ar")
  (arrays,) = bench.make_inputs(row, bench.make_mesh(1), 1, seed=0)
  variant = bench.make_variant("fp8_gemm_only", row)
  got = variant.fn(*(arrays[n] for n in variant.inputs))
  want = jax.jit(variant.reference)(*(arrays[n] for n in variant.reference_inputs))
  assert got.shape == (8, 32) and calls == [("matmul_all_reduce", None)]
  assert np.linalg.norm(np.asarray(got, np.float32) - want) <= 1e-2 * np.linalg.norm(want)
