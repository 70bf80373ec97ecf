"""`python -m jaxflux.bench --op grouped_gemm` on CPU: arguments, routings, the row and ratio
arithmetic, the table, and tiny runs end to end (the fused variant null with its reason, or a
stand-in for it)."""
import json
import pathlib
import re
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflux import bench
from jaxflux.bench import grouped_roofline as gr
from jaxflux.bench import grouped_table as gt
from jaxflux.bench import routings

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHAPES = {"grouped_gemm": [{"name": "tiny-moe", "K": 32, "N": 16, "experts": 4},
                           {"name": "other", "K": 8, "N": 8, "experts": 2}]}
ON_CPU = jax.default_backend() == "cpu"
QUIET = {"log": lambda *a, **k: None}


@pytest.fixture(scope="module")
def shapes_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("grouped") / "shapes.json"
  path.write_text(json.dumps(SHAPES))
  return path


def _run(shapes_file, out, *extra):
  argv = ["--op", "grouped_gemm", "--shapes-file", str(shapes_file), "--shapes", "tiny-moe",
          "--M", "64", "--iters", "2", "--warmup", "1", "--repeats", "2", "--out", str(out),
          *extra]
  result = bench.run(argv, **QUIET)
  return json.loads(pathlib.Path(result["output"]).read_text())


# --- arguments ----------------------------------------------------------------------------------

def test_arguments():
  args = bench.parse_args(["--op", "grouped_gemm"])
  assert args.variants == ["fused", "ragged_dot", "dense", "tokamax", "fused_fp8",
                           "fused_cooperative_128x256", "fused_pingpong_128x128"]
  assert args.routing is None
  args = bench.parse_args(["--op", "grouped_gemm", "--backward", "--routing", "dirichlet",
                           "--dtype", "float16", "--M", "128,256"])
  assert sorted(args.variants) == sorted(bench.OP_VARIANTS["grouped_gemm"])
  assert (args.routing, args.dtype, args.M) == (["dirichlet"], "float16", [128, 256])
  args = bench.parse_args(["--op", "grouped_gemm", "--variants", "dense", "--backward"])
  assert args.variants == ["dense", "fused_bwd", "ragged_dot_bwd", "dense_bwd", "tokamax_bwd"]
  for bad in (["--routing", "zipf"], ["--variants", "xla"], ["--tp", "2"], ["--dtype", "int32"],
              ["--dtype", "float8_e4m3fn"], ["--of", "ag_gemm"]):
    with pytest.raises(SystemExit):
      bench.parse_args(["--op", "grouped_gemm", *bad])
  for bad in (["--routing", "even"], ["--backward"]):  # grouped_gemm's own options
    with pytest.raises(SystemExit):
      bench.parse_args(["--op", "gemm", *bad])


# --- routing ------------------------------------------------------------------------------------

@pytest.mark.parametrize("M,G", [(16384, 8), (16384, 128), (64, 4), (5, 8), (0, 3), (1001, 64)])
def test_routings_sum_to_M_without_negatives(M, G):
  even = routings.even_sizes(M, G)
  assert sum(even) == M and max(even) - min(even) <= (1 if M % G else 0)
  assert even == sorted(even, reverse=True)  # the remainder on the first experts
  for seed in (0, 1, 7):
    sizes = routings.dirichlet_sizes(M, G, seed)
    assert len(sizes) == G and sum(sizes) == M and min(sizes) >= 0
    assert all(isinstance(s, int) for s in sizes)


def test_dirichlet_is_deterministic_and_skewed():
  a = routings.dirichlet_sizes(16384, 64, seed=0)
  assert a == routings.dirichlet_sizes(16384, 64, seed=0)
  assert a != routings.dirichlet_sizes(16384, 64, seed=1)
  assert max(a) > 2 * 16384 // 64  # Dirichlet(0.5): some experts take far more than M/G
  # The same shares at every M: twice the rows, about twice each expert's.
  b = routings.dirichlet_sizes(32768, 64, seed=0)
  assert all(abs(y - 2 * x) <= 2 for x, y in zip(a, b))
  assert routings.group_sizes("dirichlet", 100, 4, 3) == routings.dirichlet_sizes(100, 4, 3)
  with pytest.raises(ValueError, match="unknown routing"):
    routings.group_sizes("zipf", 100, 4, 0)


def test_round_to_total_is_largest_remainder():
  # 10 * (0.15, 0.25, 0.6) = 1.5, 2.5, 6: floors 1, 2, 6 and one row short; the tie of .5
  # goes to the lower index.
  assert routings.round_to_total(np.array([0.15, 0.25, 0.6]), 10) == [2, 2, 6]
  assert routings.round_to_total(np.array([1.0, 1.0, 1.0]), 7) == [3, 2, 2]
  assert routings.round_to_total(np.array([0.0, 1.0]), 5) == [0, 5]


# --- rows, inputs, variants ---------------------------------------------------------------------

def _args(**kw):
  base = dict(op="grouped_gemm", M=None, shapes=None, routing=None, dtype="bfloat16", seed=0)
  return SimpleNamespace(**{**base, **kw})


def test_rows_from_the_shapes_file():
  shapes = json.loads((ROOT / "benchmarks" / "shapes.json").read_text())
  rows = gt.build_rows(_args(), shapes)
  assert [(r.name, r.experts) for r in rows[::2]] == [
      ("mixtral-fc1", 8), ("mixtral-fc2", 8), ("deepseek-v2-lite-fc1", 64),
      ("qwen3-30b-a3b-fc1", 128), ("qwen3-30b-a3b-fc2", 128)]
  assert [r.routing for r in rows[:2]] == ["even", "dirichlet"]
  assert all(r.M == 16384 and sum(r.group_sizes) == 16384 for r in rows)
  assert (rows[0].K, rows[0].N, rows[0].group_sizes) == (4096, 14336, (2048,) * 8)
  rows = gt.build_rows(_args(M=[64, 128], shapes=["other"], routing=["even"]), SHAPES)
  assert [(r.name, r.M, r.group_sizes) for r in rows] == [("other", 64, (32, 32)),
                                                          ("other", 128, (64, 64))]
  with pytest.raises(ValueError, match="unknown name"):
    gt.build_rows(_args(shapes=["nope"]), SHAPES)


def _row(M=64, K=32, N=16, sizes=(16, 0, 40, 8), routing="dirichlet"):
  return gt.GroupedRow("t", M, K, N, len(sizes), routing, "bfloat16", tuple(sizes))


def test_each_variant_rotates_its_own_input_sets():
  row = _row()
  counts = {v: (gt.make_variant(v).inputs, n)
            for v, n in (("dense", 3), ("ragged_dot", 1), ("ragged_dot_bwd", 2))}
  mesh = bench.make_mesh(1)
  sets = gt.make_inputs(row, mesh, counts, seed=0)
  # ragged_dot_bwd reads x, w, dy from sets 0 and 1; dense x and w_dense from sets 0 to 2.
  assert [sorted(s) for s in sets] == [["dy", "group_sizes", "w", "w_dense", "x"]] * 2 + [
      ["group_sizes", "w_dense", "x"]]
  assert sets[0]["w"].shape == (4, 32, 16) and sets[0]["group_sizes"].dtype == jnp.int32
  assert sets[1]["group_sizes"] is sets[0]["group_sizes"]
  assert not np.array_equal(np.asarray(sets[0]["x"]), np.asarray(sets[1]["x"]))
  # Rotation as the GEMM table's: enough sets for rotate_mib, at most 8; the shapes' full size
  # needs one (mixtral-fc1's grouped weight is 0.9 GiB), its dense weight and x two.
  assert gt.set_count(row, ("x", "w"), 256) == 8 and gt.set_count(row, ("x", "w"), 0) == 1
  big = _row(16384, 4096, 14336, (2048,) * 8)
  assert gt.set_count(big, ("x", "w", "group_sizes"), 256) == 1
  assert gt.set_count(big, ("x", "w_dense"), 256) == 2


def test_backward_variants_drop_the_forward():
  """A *_bwd variant computes dx and dw only: the forward's product, unused, is not lowered."""
  row = _row()
  mesh = bench.make_mesh(1)
  (inputs,) = gt.make_inputs(row, mesh, {"v": (("x", "w", "w_dense", "dy"), 1)}, seed=0)

  def products(name):
    variant = gt.make_variant(name)
    text = jax.jit(variant.fn).lower(*(inputs[n] for n in variant.inputs)).as_text()
    return len(re.findall(r"\b(?:dot_general|ragged_dot)\b", text))

  assert products("ragged_dot") == 1 and products("dense") == 1
  assert products("ragged_dot_bwd") == 2 and products("dense_bwd") == 2


def test_references_are_the_per_expert_products():
  """The float32 references the variants are checked against, against float64 NumPy."""
  sizes = (5, 0, 9, 2)
  row = _row(M=16, K=6, N=3, sizes=sizes)
  rng = np.random.default_rng(0)
  x, dy = rng.standard_normal((16, 6)), rng.standard_normal((16, 3))
  w = rng.standard_normal((4, 6, 3))
  y_want, dx_want, dw_want = np.zeros((16, 3)), np.zeros((16, 6)), np.zeros_like(w)
  for g, (a, b) in enumerate(zip(np.cumsum((0,) + sizes), np.cumsum(sizes))):
    y_want[a:b], dx_want[a:b], dw_want[g] = x[a:b] @ w[g], dy[a:b] @ w[g].T, x[a:b].T @ dy[a:b]
  f32 = [jnp.asarray(a, jnp.float32) for a in (x, w, np.asarray(sizes), dy)]
  y = gt._reference("ragged_dot", row)(*f32[:3])
  dx, dw = gt._reference("fused_bwd", row)(*f32)
  for got, want in ((y, y_want), (dx, dx_want), (dw, dw_want)):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  dx, dw = gt._reference("dense_bwd", row)(f32[0], f32[1][0], f32[3])
  np.testing.assert_allclose(np.asarray(dw), x.T @ dy, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dx), dy @ w[0].T, rtol=1e-5, atol=1e-5)


# --- the record ---------------------------------------------------------------------------------

def test_row_ratio_and_table_arithmetic():
  row = _row()
  samples = {"fused": [1.0, 1.2, 1.1], "ragged_dot": [4.0, 4.4], "dense": [0.8],
             "fused_bwd": [2.0], "dense_bwd": [1.5]}
  errors = {"ragged_dot_bwd": "failed while timing: X"}
  record = gt.summarize_row(row, samples, errors, {"fused": 1e-3}, {}, {}, {"fused": 2})
  flops = 2 * 64 * 32 * 16
  assert record["ms"]["fused"] == 1.1 and record["ms"]["ragged_dot"] == pytest.approx(4.2)
  assert record["spread_ms"]["fused"] == [1.0, 1.2]
  assert record["spread_ms"]["ragged_dot_bwd"] is None
  assert record["tflops"]["fused"] == pytest.approx(flops / 1.1e-3 / 1e12)
  assert record["tflops"]["fused_bwd"] == pytest.approx(2 * flops / 2.0e-3 / 1e12)
  assert record["flops"] == {"forward": flops, "backward": 2 * flops}
  ratios = record["ratios"]
  assert ratios["fused_vs_dense"] == pytest.approx(0.8 / 1.1)
  assert ratios["fused_vs_dense"] == pytest.approx(record["tflops"]["fused"] /
                                                   record["tflops"]["dense"])
  assert ratios["ragged_over_fused"] == pytest.approx(4.2 / 1.1)
  assert ratios["ragged_dot_vs_dense"] == pytest.approx(0.8 / 4.2)
  assert ratios["fused_bwd_vs_dense_bwd"] == pytest.approx(0.75)
  assert ratios["ragged_over_fused_bwd"] is None and ratios["ragged_dot_bwd_vs_dense_bwd"] is None
  assert record["errors"] == {"ragged_dot_bwd": "failed while timing: X",
                              "fused_cooperative_128x256": "not requested",
                              "fused_pingpong_128x128": "not requested",
                              "tokamax": "not requested", "tokamax_bwd": "not requested",
                              "fused_fp8": "not requested"}
  assert [record[k] for k in ("group_sizes_min", "group_sizes_max", "empty_groups")] == [0, 40, 1]
  assert record["warnings"] == []
  # A time below moving the bytes once at 10 TB/s: the calls were dropped.
  fast = gt.summarize_row(row, {"dense": [1e-9]}, {}, {}, {}, {}, {})
  assert fast["errors"]["fused"] == "not requested" and "dense: " in fast["warnings"][0]

  other = gt.summarize_row(_row(routing="even", sizes=(16,) * 4),
                           {"fused": [2.0], "ragged_dot": [3.0], "dense": [1.0]}, {}, {}, {}, {},
                           {})
  summary = gt.summarize_table([record, other])
  assert summary["fused_vs_dense"] == {"rows": 2, "of_rows": 2, "mean": pytest.approx(
      (0.8 / 1.1 + 0.5) / 2), "worst": 0.5, "worst_row": "t M=64 even"}
  assert summary["fused_bwd_vs_dense_bwd"]["rows"] == 1
  assert "ragged_over_fused_bwd" not in summary
  result = {"rows": [record, other], "summary": summary,
            "settings": {"variants": ["fused", "ragged_dot", "dense", "fused_bwd"]}}
  text = gt.format_table(result)
  assert "forward (2*M*K*N)" in text and "backward, dx and dw (4*M*K*N)" in text
  assert re.search(r"t +64 dirichlet +4 +0-40 +1\.100 +4\.200 +- +0\.800 .* 0\.727 +3\.82", text)
  assert "fused_vs_dense: mean 0.614, worst 0.500 (t M=64 even), 2 of 2 rows" in text
  assert "ragged_dot_bwd: failed while timing: X" in text
  result["settings"]["variants"] = ["dense"]
  assert "backward" not in gt.format_table(result)


# --- end to end ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_run_without_the_fused_kernel(shapes_file, tmp_path):
  if not ON_CPU:
    pytest.skip("checks the reasons off GPU")
  result = _run(shapes_file, tmp_path, "--backward", "--rotate-mib", "0")
  assert result["command"].startswith("python -m jaxflux.bench --op grouped_gemm")
  assert {"date", "machine", "versions", "definitions"} <= set(result)
  assert result["output"].split("/")[-1].startswith("grouped_gemm_cpu_tp1_")
  settings = result["settings"]
  assert settings["op"] == "grouped_gemm" and settings["tp"] == 1
  assert settings["grouped_gemm"]["routing"] == ["even", "dirichlet"]
  even, skewed = result["rows"]
  assert (even["routing"], skewed["routing"]) == ("even", "dirichlet")
  assert even["group_sizes"] == [16] * 4 and sum(skewed["group_sizes"]) == 64
  assert skewed["group_sizes"] == routings.dirichlet_sizes(64, 4, 0)
  for row in (even, skewed):
    assert row["ms"]["fused"] is None and row["ms"]["fused_bwd"] is None
    for v in ("fused", "fused_fp8"):
      assert row["errors"][v].startswith("FusedKernelUnavailableError"), row["errors"][v]
    assert row["ratios"]["fused_vs_dense"] is None and row["ratios"]["ragged_over_fused"] is None
    for v in ("ragged_dot", "dense", "ragged_dot_bwd", "dense_bwd"):
      assert row["ms"][v] > 0 and row["tflops"][v] > 0 and row["rel_err"][v] < 1e-2, v
      assert len(row["samples_ms"][v]) == 2
    assert row["ratios"]["ragged_dot_vs_dense"] == pytest.approx(
        row["ms"]["dense"] / row["ms"]["ragged_dot"], rel=1e-4)
  assert result["summary"]["ragged_dot_vs_dense"]["rows"] == 2


def test_run_with_a_stand_in_fused_kernel(shapes_file, tmp_path, monkeypatch):
  """impl="fused" replaced by the XLA path: the fused columns, their ratios and checks fill in,
  and each variant rotates its own input sets."""
  real = gt._grouped
  monkeypatch.setattr(gt, "_grouped",
                      lambda x, w, sizes, impl, **kw: real(x, w, sizes, "xla", **kw))
  result = _run(shapes_file, tmp_path / "g.json", "--routing", "dirichlet",
                "--variants", "fused,ragged_dot,dense,fused_bwd,fused_fp8", "--timing",
                "dispatch")
  (row,) = result["rows"]
  assert row["input_sets"] == {v: 8 for v in ("fused", "ragged_dot", "dense", "fused_bwd",
                                              "fused_fp8")}
  for v in ("fused", "fused_bwd", "fused_fp8"):
    assert row["ms"][v] > 0 and row["rel_err"][v] < 1e-2, v
  assert row["ratios"]["fp8_over_bf16"] == pytest.approx(
      row["ms"]["fused"] / row["ms"]["fused_fp8"], rel=1e-4)
  assert row["ratios"]["fused_vs_dense"] == pytest.approx(row["ms"]["dense"] / row["ms"]["fused"],
                                                          rel=1e-4)
  assert row["ratios"]["ragged_over_fused"] == pytest.approx(
      row["ms"]["ragged_dot"] / row["ms"]["fused"], rel=1e-4)
  assert row["errors"] == {v: "not requested" for v in (
      "ragged_dot_bwd", "dense_bwd", "fused_cooperative_128x256", "fused_pingpong_128x128",
      "tokamax", "tokamax_bwd")}
  assert row["calls_per_run"]["fused"] == 2
  # The roofline: both rates measured before the rows, each grouped variant's fraction.
  rates = result["rates"]
  assert rates["dense_tflops"] > 0 and rates["weight_read_tbps"] > 0 and not rates["errors"]
  want = gr.roofline(row, rates)  # from the written values (6 digits)
  assert row["roofline"]["ms"] == pytest.approx(want["ms"], rel=1e-4)
  assert row["roofline"]["fraction"] == pytest.approx(want["fraction"], rel=1e-4)
  assert set(row["roofline"]["fraction"]) == {"fused", "ragged_dot"}
  assert result["summary"]["fused_of_roofline"]["rows"] == 1


def test_roofline_is_the_slower_of_compute_and_the_weight_read():
  rates = {"dense_tflops": 500.0, "weight_read_tbps": 2.0}
  record = {"M": 1024, "K": 512, "N": 256, "experts": 8, "dtype": "bfloat16",
            "ms": {"fused": 1.0, "ragged_dot": 4.0, "tokamax": None, "fused_bwd": 2.0}}
  nbytes = (8 * 512 * 256 + 1024 * 512 + 1024 * 256) * 2
  roof = gr.roofline(record, rates)
  # compute 268M FLOP / 500 TFLOP/s = 0.54 us; bytes 3.7 MB / 2 TB/s = 1.8 us: the weight read
  assert roof["bound"] == "memory" and roof["bytes"] == nbytes
  assert roof["ms"] == pytest.approx(nbytes / 2e9)
  assert roof["fraction"] == {"fused": pytest.approx(roof["ms"]),
                              "ragged_dot": pytest.approx(roof["ms"] / 4)}
  assert roof["fraction_fwd_bwd"] == {"fused": pytest.approx(3 * roof["ms"] / 3.0)}
  record.update(M=8192, K=4096, N=4096)  # 275 GFLOP: 0.55 ms of compute, 0.33 of bytes
  roof = gr.roofline(record, rates)
  assert roof["bound"] == "compute"
  assert roof["ms"] == pytest.approx(2 * 8192 * 4096 * 4096 / 500e9)
  assert gr.roofline(record, {"dense_tflops": None, "weight_read_tbps": 2.0}) is None


def test_tokamax_variant_without_tokamax(shapes_file, tmp_path, monkeypatch):
  """Where tokamax is not installed the variant is null with the reason (pip install tokamax)."""
  monkeypatch.setitem(sys.modules, "tokamax", None)  # import tokamax raises ImportError
  result = _run(shapes_file, tmp_path / "t.json", "--routing", "even",
                "--variants", "ragged_dot,tokamax")
  (row,) = result["rows"]
  assert row["ms"]["tokamax"] is None and row["ratios"]["tokamax_over_fused"] is None
  assert "tokamax is not installed" in row["errors"]["tokamax"]
  assert "pip install tokamax" in row["errors"]["tokamax"]


def test_tokamax_variant_with_a_stand_in(shapes_file, tmp_path, monkeypatch):
  """tokamax.ragged_dot replaced by lax.ragged_dot: its columns, ratio, check and roofline fill
  in, forward and backward."""
  monkeypatch.setattr(gt, "_tokamax", jax.lax.ragged_dot)
  real = gt._grouped
  monkeypatch.setattr(gt, "_grouped",
                      lambda x, w, sizes, impl, **kw: real(x, w, sizes, "xla", **kw))
  result = _run(shapes_file, tmp_path / "t.json", "--routing", "dirichlet",
                "--variants", "fused,tokamax", "--backward")
  (row,) = result["rows"]
  for v in ("tokamax", "tokamax_bwd"):
    assert row["ms"][v] > 0 and row["rel_err"][v] < 1e-2, v
  assert row["ratios"]["tokamax_over_fused"] == pytest.approx(
      row["ms"]["tokamax"] / row["ms"]["fused"], rel=1e-4)
  assert row["ratios"]["tokamax_over_fused_bwd"] > 0
  assert set(row["roofline"]["fraction_fwd_bwd"]) == {"fused", "tokamax"}
  assert "tokamax_fwd_bwd_of_roofline" in result["summary"]
