"""Smoke test of `python -m jaxflux.bench`, in-process on the 8 virtual CPU devices, tiny shapes.

Checks the JSON record (keys, positive times of the XLA variants, nulls with reasons for the
variants that need a GPU or a fused kernel) and the derived numbers, not performance.
"""
import json
import math

import jax
import pytest

from jaxflux import bench

SHAPES = {
    "ag_gemm": [{"name": "tiny-ag", "K": 64, "N": 64}],
    "gemm_rs": [{"name": "tiny-rs", "K": 64, "N": 64}],
    "M": [64],
}
TOP_KEYS = {"command", "argv", "date", "machine", "versions", "settings", "definitions", "rows",
            "output"}
ROW_KEYS = {"op", "name", "M", "K", "N", "tp", "dtype", "per_device", "ms", "spread_ms",
            "samples_ms", "gbps", "speedup_vs_xla", "speedup_vs_xla_all", "rel_err", "errors",
            "warnings", "calls_per_run", "input_sets"}
ON_CPU = jax.default_backend() == "cpu"


@pytest.fixture(scope="module")
def shapes_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("bench") / "shapes.json"
  path.write_text(json.dumps(SHAPES))
  return path


def _run(op, shapes_file, out, *extra):
  argv = ["--op", op, "--shapes-file", str(shapes_file), "--iters", "3", "--warmup", "1",
          "--repeats", "2", "--out", str(out), *extra]
  result = bench.run(argv, log=lambda *a, **k: None)
  on_disk = json.loads(open(result["output"]).read())
  assert on_disk["rows"][0]["name"] == result["rows"][0]["name"]
  assert TOP_KEYS <= set(on_disk), TOP_KEYS - set(on_disk)
  return on_disk


def _check_common(result, op):
  assert result["command"].startswith("python -m jaxflux.bench --op " + op)
  assert result["date"].endswith("Z")
  machine, versions = result["machine"], result["versions"]
  assert machine["platform"] == jax.default_backend()
  assert machine["device_count"] == len(jax.devices())
  assert versions["jax"] == jax.__version__
  assert {"jaxlib", "jaxflux", "jaxflux_cuda_built"} <= set(versions)
  assert "hostname" not in json.dumps(result).lower()
  (row,) = result["rows"]
  assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
  assert row["op"] == op and row["tp"] == len(jax.devices()) and row["dtype"] == "bfloat16"
  assert row["ms"]["xla"] > 0
  lo, hi = row["spread_ms"]["xla"]
  assert 0 < lo <= row["ms"]["xla"] <= hi
  assert len(row["samples_ms"]["xla"]) == 2
  return row


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs"])
@pytest.mark.slow
def test_gemm_ops(op, shapes_file, tmp_path):
  result = _run(op, shapes_file, tmp_path)
  row = _check_common(result, op)
  tp = row["tp"]
  assert (row["M"], row["K"], row["N"]) == (64, 64, 64)
  if op == "ag_gemm":
    assert row["per_device"] == {"x": [64 // tp, 64], "w": [64, 64 // tp], "out": [64, 64 // tp]}
  else:
    assert row["per_device"] == {"x": [64, 64 // tp], "w": [64 // tp, 64], "out": [64 // tp, 64]}
  for v in ("gemm", "comm", "xla", "auto"):
    assert row["ms"][v] > 0, (v, row["errors"].get(v))
  for v in ("gemm", "xla", "auto"):
    assert row["tflops"][v] > 0
  assert row["gbps"]["comm"] > 0
  assert row["rel_err"]["auto"] < 1e-2
  assert math.isfinite(row["overlap_efficiency_all"]["xla"])
  expected_e = (row["ms"]["gemm"] + row["ms"]["comm"] - row["ms"]["xla"]) / row["ms"]["comm"]
  assert row["overlap_efficiency_all"]["xla"] == pytest.approx(expected_e, rel=1e-3, abs=1e-4)
  assert result["output"].split("/")[-1].startswith(f"{op}_{'cpu' if ON_CPU else 'gpu'}_tp{tp}_")
  if ON_CPU:
    assert row["ms"]["jaxflux"] is None and row["errors"]["jaxflux"]
    assert row["speedup_vs_xla"] is None and row["overlap_efficiency"] is None
    assert row["ms"]["xla_windowed"] is None and "GPU" in row["errors"]["xla_windowed"]
    if op == "ag_gemm":
      assert row["ms"]["pallas"] is None and "GPU" in row["errors"]["pallas"]
    else:
      assert "pallas" not in row["ms"]


def test_all_gather(shapes_file, tmp_path):
  out = tmp_path / "ag.json"
  result = _run("all_gather", shapes_file, out)
  assert result["output"] == str(out)
  row = _check_common(result, "all_gather")
  assert (row["M"], row["K"]) == (64, 64)
  shard_bytes = 64 // row["tp"] * 64 * 2
  assert row["comm_bytes_per_device"] == (row["tp"] - 1) * shard_bytes
  assert row["gbps"]["xla"] == pytest.approx(
      row["comm_bytes_per_device"] / row["ms"]["xla"] / 1e6, rel=1e-3)
  if ON_CPU:
    assert row["ms"]["jaxflux"] is None and row["errors"]["jaxflux"]


def test_all_gather_sizes_mib(tmp_path):
  result = bench.run(["--op", "all_gather", "--sizes-mib", "0.0625", "--iters", "2",
                      "--warmup", "1", "--repeats", "1", "--variants", "xla",
                      "--out", str(tmp_path / "s.json")], log=lambda *a, **k: None)
  (row,) = result["rows"]
  assert row["M"] // row["tp"] * row["K"] * 2 == 65536
  assert row["ms"]["xla"] > 0 and row["errors"]["jaxflux"] == "not requested"


def test_dispatch_timing_and_gspmd(shapes_file, tmp_path):
  result = _run("gemm_rs", shapes_file, tmp_path, "--timing", "dispatch",
                "--variants", "xla,xla_gspmd")
  (row,) = result["rows"]
  assert result["settings"]["timing"] == "dispatch"
  assert row["ms"]["xla_gspmd"] > 0 and row["rel_err"]["xla_gspmd"] < 1e-2
  assert row["calls_per_run"]["xla"] == 3


def test_summary_math():
  row = bench.Row("ag_gemm", "t", 1024, 512, 256, 2, "bfloat16")
  samples = {"gemm": [1.0, 1.2, 0.9], "comm": [0.5], "xla": [1.5], "jaxflux": [1.1]}
  record = bench.summarize_row(row, list(bench.DEFAULT_VARIANTS), samples, {}, {}, {}, {}, 1)
  assert record["ms"]["gemm"] == 1.0 and record["spread_ms"]["gemm"] == [0.9, 1.2]
  assert record["speedup_vs_xla"] == pytest.approx(1.5 / 1.1)
  assert record["overlap_efficiency"] == pytest.approx((1.0 + 0.5 - 1.1) / 0.5)
  assert record["overlap_efficiency_all"]["xla"] == pytest.approx(0.0)
  assert record["tflops"]["jaxflux"] == pytest.approx(2 * 1024 * 512 * 256 / 2 / 1.1e-3 / 1e12)
  assert record["gbps"]["comm"] == pytest.approx(512 * 512 * 2 / 0.5e-3 / 1e9)
  assert record["errors"]["pallas"] == "not run"


def test_bad_arguments(shapes_file, tmp_path):
  with pytest.raises(ValueError, match="not divisible by tp"):
    bench.run(["--op", "ag_gemm", "--shapes-file", str(shapes_file), "--M", "3",
               "--variants", "xla", "--out", str(tmp_path)], log=lambda *a, **k: None)
  with pytest.raises(ValueError, match="unknown name"):
    bench.run(["--op", "ag_gemm", "--shapes-file", str(shapes_file), "--shapes", "nope",
               "--variants", "xla", "--out", str(tmp_path)], log=lambda *a, **k: None)
  with pytest.raises(SystemExit):
    bench.parse_args(["--op", "ag_gemm", "--variants", "bogus"])


@pytest.mark.slow
def test_windowed_child_merge(shapes_file, tmp_path, monkeypatch):
  # The child process normally runs on GPU only; the hook lets it run here (where XLA ignores
  # the windowed-einsum flags) so that the subprocess round trip and the merge are exercised.
  monkeypatch.setenv("JAX_NUM_CPU_DEVICES", str(len(jax.devices())))
  result = _run("ag_gemm", shapes_file, tmp_path, "--variants", "gemm,comm,xla,xla_windowed",
                "--_windowed-anywhere")
  (row,) = result["rows"]
  assert row["ms"]["xla_windowed"] > 0, row["errors"].get("xla_windowed")
  assert "xla_windowed" not in row["errors"]
  assert row["rel_err"]["xla_windowed"] < 1e-2
  detail = row["xla_windowed_detail"]
  assert detail["xla_ms_in_child"] > 0 and detail["windowed_loop_in_hlo"] is not None
  assert row["speedup_vs_xla_all"]["xla_windowed"] == pytest.approx(
      detail["xla_ms_in_child"] / row["ms"]["xla_windowed"], rel=1e-3)
  assert math.isfinite(row["overlap_efficiency_all"]["xla_windowed"])


class _FakePallas:
  """Stands in for collective_matmul_mgpu so the sweep logic runs on CPU: one config fails as
  a shared-memory overflow would, one computes wrong values, the rest are right."""
  import enum as _enum

  class MatmulDimension(_enum.IntEnum):
    M = 0
    N = 1

  class TuningConfig:
    def __init__(self, **kw):
      self.__dict__.update(kw)

  @staticmethod
  def all_gather_lhs_matmul(lhs, rhs, axis_name, *, config, dtype):
    from jax import lax
    if config.tile_n == 64:
      raise ValueError("Requested 300000 bytes exceeds available shared memory")
    y = lax.all_gather(lhs, axis_name, axis=0, tiled=True) @ rhs
    return (-y if config.tile_m == 64 else y).astype(dtype)


def test_pallas_sweep_logic(shapes_file, tmp_path, monkeypatch):
  monkeypatch.setattr(bench.variants, "is_gpu", lambda: True)
  monkeypatch.setattr(bench.variants, "_pallas_module", lambda: _FakePallas)
  result = _run("ag_gemm", shapes_file, tmp_path, "--variants", "xla,pallas", "--chain", "perturb")
  (row,) = result["rows"]
  sweep = row["pallas_sweep"]
  assert len(sweep) == len(bench.PALLAS_CONFIGS)
  assert "shared memory" in sweep["tm128_tn64_tk64_s4_wgN_minorM_w8"]["error"]
  assert "wrong result" in sweep["tm64_tn128_tk64_s4_wgM_minorM_w4"]["error"]
  good = {k: v["ms"] for k, v in sweep.items() if "ms" in v}
  assert len(good) == 3 and row["pallas_config"] in good
  assert row["ms"]["pallas"] > 0 and row["rel_err"]["pallas"] < 1e-2
  assert math.isfinite(row["speedup_vs_xla_all"]["pallas"])


def test_device_timing_needs_a_gpu(shapes_file, tmp_path):
  if not ON_CPU:
    pytest.skip("checks the error off GPU")
  with pytest.raises(SystemExit, match="--timing device reads the GPUs' clocks"):
    bench.run(["--op", "ag_gemm", "--shapes-file", str(shapes_file), "--timing", "device",
               "--variants", "xla", "--out", str(tmp_path)], log=lambda *a, **k: None)


def test_device_clock_words_and_elapsed_time():
  import numpy as np
  from jaxflux.bench import device_clock

  t0 = np.array([5, (1 << 32) + 7], np.uint64)          # two devices' timers, ns
  t1 = t0 + np.array([4_000_000, 6_000_000], np.uint64)
  words = lambda t: np.stack([t & np.uint64(0xFFFFFFFF), t >> np.uint64(32)], 1).astype(np.uint32)
  np.testing.assert_array_equal(device_clock.DeviceClock.nanoseconds(words(t0)), t0)
  # The slowest device's 6 ms over 3 calls.
  assert device_clock.elapsed_ms_per_call(words(t0), words(t1), 3) == pytest.approx(2.0)
  assert device_clock.spin_ns_for(10) == 20_000_000 + 10 * 300_000
  assert device_clock.spin_ns_for(10**9) == device_clock.SPIN_MAX_NS


def test_device_mode_times_with_the_clock_and_checks_the_queue(monkeypatch):
  """Timed's device mode, with a fake clock: the time comes from the clock reads, and a host
  that queued its calls slower than the idle read lasted is flagged."""
  import numpy as np
  from jax.sharding import Mesh
  from jaxflux.bench import device_clock, timing
  from jaxflux.bench.variants import Variant

  class FakeClock:
    def __init__(self):
      self.now = 0

    def read(self, spin_ns=0):
      self.now += spin_ns + 1_000_000 * (spin_ns == 0)   # 1 ms between the reads
      t = np.array([self.now] * 2, np.uint64)
      return jax.numpy.asarray(np.stack([t, 0 * t], 1).astype(np.uint32))

  mesh = Mesh(np.asarray(jax.devices()[:2]), ("tp",))
  x = jax.device_put(jax.numpy.ones((2, 4)), jax.sharding.NamedSharding(mesh, jax.P("tp")))
  timed = timing.Timed(Variant("xla", lambda a: a * 2, ("x",)), mesh, [{"x": x}], 4,
                        "dispatch", "perturb")
  timed.run().block_until_ready()  # compiled before the timed run
  timed.clock = FakeClock()
  timed.clock.read()  # its first array transfer is slow too
  # A minute of idle time: queuing 4 calls fits in it even on a loaded machine.
  monkeypatch.setattr(device_clock, "spin_ns_for", lambda calls: 60 * 10**9)
  assert timed.time_ms() == pytest.approx(0.25)  # 1 ms over 4 calls
  assert timed.queue_filled is True
  monkeypatch.setattr(device_clock, "spin_ns_for", lambda calls: 0)  # no time to queue
  timed.time_ms()
  assert timed.queue_filled is False


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs"])
def test_transposed_weight_input_is_the_weight_transposed(op):
  """jaxflux_wt's input `wt` is made from `w` (so its output is checked against xla's), with
  the sharding the transposed weight has on each device."""
  import numpy as np
  from jaxflux.bench import inputs
  from jaxflux.bench.rows import Row

  tp = 2
  row = Row(op=op, name="t", M=16, K=24, N=32, tp=tp, dtype="float32")
  mesh = inputs.make_mesh(tp)
  (arrays,) = inputs.make_inputs(row, mesh, 1, seed=3)
  np.testing.assert_array_equal(np.asarray(arrays["wt"]), np.asarray(arrays["w"]).T)
  w_spec, wt_spec = arrays["w"].sharding.spec, arrays["wt"].sharding.spec
  assert tuple(wt_spec) == tuple(reversed(tuple(w_spec)))


# --op gemm: the single-device GEMM table.

def _fake_gemm(x, w, *, kernel, c=None, transpose_w=False):
  """Stands in for jaxflux.ops.gemm.gemm on CPU: the product each kernel computes."""
  import jax.numpy as jnp
  assert kernel in ("cutlass", "all_gather_matmul", "own_rows", "matmul_all_reduce")
  assert not transpose_w
  assert (c is not None) == (kernel == "own_rows")
  y = jnp.dot(x, w, preferred_element_type=jnp.float32)
  return (y if c is None else y + c.astype(jnp.float32)).astype(x.dtype)


def test_gemm_table_rows_are_the_per_device_gemms_at_tp2():
  from types import SimpleNamespace
  from jaxflux.bench.rows import build_rows
  shapes = {"ag_gemm": [{"name": "a", "K": 64, "N": 96}],
            "gemm_rs": [{"name": "r", "K": 128, "N": 32}], "M": [7]}
  args = SimpleNamespace(op="gemm", M=None, shapes=None, dtype="bfloat16", sizes_mib=None)
  rows = build_rows(args, shapes, 2)
  assert [(r.of, r.name, r.M) for r in rows] == (
      [("ag_gemm", "a", m) for m in (2048, 4096, 8192, 16384)] +
      [("gemm_rs", "r", m) for m in (2048, 4096, 8192, 16384)] +
      [("gemm_ar", "r", m) for m in (1, 8, 32, 128, 512, 2048, 8192)])
  ag, rs, ar = rows[0], rows[4], rows[8]
  assert ar.per_device_shapes == {"x": [1, 64], "w": [64, 32], "out": [1, 32]}
  assert ag.per_device_shapes == {"x": [2048, 64], "w": [64, 48], "out": [2048, 48]}
  assert rs.per_device_shapes == {"x": [2048, 64], "w": [64, 32], "out": [2048, 32],
                                  "own_rows": {"x": [1024, 64], "c": [1024, 32],
                                               "out": [1024, 32]}}
  assert rs.comm_bytes_per_device == 0 and rs.key()[-1] == "gemm_rs"
  args.M, args.shapes = [256], ["r"]
  assert [(r.of, r.M) for r in build_rows(args, shapes, 2)] == [("gemm_rs", 256), ("gemm_ar", 256)]
  args.of = ["gemm_ar"]
  args.M = [3]  # every device holds all rows: any M
  assert [(r.of, r.M) for r in build_rows(args, shapes, 2)] == [("gemm_ar", 3)]
  args.of = None
  with pytest.raises(ValueError, match="not divisible by tp"):
    build_rows(args, shapes, 2)


def test_gemm_table_ratio_summary():
  from jaxflux.bench import gemm_table
  def row(of, name, M, ms):
    r = bench.Row("gemm", name, M, 64, 64, 2, "bfloat16", of)
    samples = {v: [t, t * 1.1] for v, t in ms.items() if t is not None}
    return gemm_table.summarize_gemm_row(r, samples, {}, {}, {}, {}, 1)
  rows = [row("ag_gemm", "a", 2048, {"xla": 1.0, "gemm_only": 1.05, "cutlass": 1.02}),
          row("ag_gemm", "a", 4096, {"xla": 2.0, "gemm_only": 1.9}),
          row("gemm_rs", "r", 2048, {"xla": 1.0, "gemm_only": 1.2, "xla_own_rows": 0.5,
                                     "own_rows": 0.55}),
          row("gemm_rs", "r", 4096, {"xla": 1.0, "gemm_only": None, "xla_own_rows": 0.5,
                                     "own_rows": 0.45})]
  assert rows[0]["ms"]["gemm_only"] == pytest.approx(1.05 * 1.05)  # median of 2 samples
  assert "own_rows" not in rows[0]["ms"] and rows[3]["errors"]["gemm_only"] == "not requested"
  assert rows[2]["tflops"]["own_rows"] == pytest.approx(
      rows[2]["tflops"]["gemm_only"] / 2 * rows[2]["ms"]["gemm_only"] / rows[2]["ms"]["own_rows"])
  summary = gemm_table.summarize_table(rows)
  ag = summary["ag_gemm"]["gemm_only_vs_xla"]
  assert ag["mean"] == pytest.approx((1.05 + 0.95) / 2) and ag["worst"] == pytest.approx(1.05)
  assert ag["worst_row"] == "a M=2048" and (ag["rows"], ag["of_rows"]) == (2, 2)
  assert "own_rows_vs_xla_own_rows" not in summary["ag_gemm"]
  cutlass = summary["ag_gemm"]["cutlass_vs_xla"]  # measured on one of the two rows
  assert (cutlass["rows"], cutlass["of_rows"]) == (1, 2) and cutlass["mean"] == pytest.approx(1.02)
  rs = summary["gemm_rs"]
  assert rs["gemm_only_vs_xla"]["rows"] == 1 and rs["gemm_only_vs_xla"]["of_rows"] == 2
  assert rs["own_rows_vs_xla_own_rows"]["mean"] == pytest.approx((1.1 + 0.9) / 2)
  assert "gemm_rs own_rows_vs_xla_own_rows: mean 1.000, worst 1.100 (r M=2048)" in (
      gemm_table.format_gemm_table({"rows": rows, "summary": summary}))


@pytest.mark.slow
def test_gemm_table_run_with_fake_kernels(shapes_file, tmp_path, monkeypatch):
  from jaxflux.bench import gemm_table
  monkeypatch.setattr(gemm_table, "_gemm", _fake_gemm)
  result = _run("gemm", shapes_file, tmp_path / "g.json", "--M", "64")
  assert result["settings"]["variants"] == ["xla", "gemm_only", "cutlass", "streamk", "swap_ab",
                                            "xla_own_rows", "xla_own_rows_c", "own_rows"]
  assert result["env"] == {k: v for k, v in result["env"].items() if k == "XLA_FLAGS"}
  ag, rs, ar = result["rows"]
  assert (ag["of"], rs["of"], ar["of"]) == ("ag_gemm", "gemm_rs", "gemm_ar")
  assert ag["tp"] == rs["tp"] == ar["tp"] == 2
  # gemm_ar rows: every row on the device, the weight [K/tp, N]; its read rate per variant.
  assert ar["per_device"] == {"x": [64, 32], "w": [32, 64], "out": [64, 64]}
  assert set(ar["ms"]) == {"xla", "gemm_only", "cutlass", "streamk", "swap_ab"}
  for v, t in ar["ms"].items():
    assert ar["weight_tbps"][v] == pytest.approx(32 * 64 * 2 / t / 1e9, rel=1e-4)
  for v in ("streamk", "swap_ab"):
    assert ar["ratios"][f"{v}_vs_xla"] == pytest.approx(ar["ms"][v] / ar["ms"]["xla"], rel=1e-4)
  assert "weight_tbps" not in rs
  for r in (ag, rs, ar):
    assert all(t > 0 for t in r["ms"].values()), r["errors"]
    assert all(e < 1e-2 for e in r["rel_err"].values()) and set(r["rel_err"]) == set(r["ms"])
    for v in ("gemm_only", "cutlass"):
      assert r["ratios"][f"{v}_vs_xla"] == pytest.approx(r["ms"][v] / r["ms"]["xla"], rel=1e-4)
  for ref in ("xla_own_rows", "xla_own_rows_c"):
    assert rs["ratios"][f"own_rows_vs_{ref}"] == pytest.approx(
        rs["ms"]["own_rows"] / rs["ms"][ref], rel=1e-4)
    assert result["summary"]["gemm_rs"][f"own_rows_vs_{ref}"]["rows"] == 1


def test_gemm_table_without_kernels_records_why(shapes_file, tmp_path):
  if not ON_CPU:
    pytest.skip("checks the reasons off GPU")
  result = _run("gemm", shapes_file, tmp_path / "g.json", "--M", "64",
                "--variants", "xla,gemm_only,own_rows", "--of", "ag_gemm,gemm_rs")
  ag, rs = result["rows"]
  assert ag["ms"]["xla"] > 0 and ag["ms"]["gemm_only"] is None and ag["errors"]["gemm_only"]
  assert rs["ms"]["own_rows"] is None and rs["errors"]["own_rows"]
  assert rs["errors"]["xla_own_rows"] == "not requested"
  assert result["summary"]["ag_gemm"]["gemm_only_vs_xla"]["mean"] is None
  with pytest.raises(SystemExit):
    bench.parse_args(["--op", "gemm", "--variants", "jaxflux"])
