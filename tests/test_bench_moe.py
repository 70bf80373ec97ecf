"""`python -m jaxflux.bench --op moe` on CPU: arguments, rows, the train step, the checks, the row
and ratio arithmetic, the table, and tiny runs end to end (the fused variant null with its
reason, or a stand-in for it)."""
import json
import pathlib
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflux
from jaxflux import bench
from jaxflux.bench import moe_record as mr, moe_table as mt

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHAPES = {"moe": [{"name": "tiny", "hidden": 16, "intermediate": 8, "experts": 4, "top_k": 2,
                   "activation": "swiglu"},
                  {"name": "tiny-gelu", "hidden": 8, "intermediate": 8, "experts": 8, "top_k": 3,
                   "activation": "gelu", "norm_topk_prob": False}]}
ON_CPU = jax.default_backend() == "cpu"
QUIET = {"log": lambda *a, **k: None}


@pytest.fixture(scope="module")
def shapes_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("moe") / "shapes.json"
  path.write_text(json.dumps(SHAPES))
  return path


def _run(shapes_file, out, *extra):
  argv = ["--op", "moe", "--shapes-file", str(shapes_file), "--shapes", "tiny", "--M", "32",
          "--iters", "2", "--warmup", "1", "--repeats", "2", "--out", str(out), *extra]
  result = bench.run(argv, **QUIET)
  return json.loads(pathlib.Path(result["output"]).read_text())


def _row(name="tiny", M=32, activation="swiglu", norm=True):
  return mt.MoERow(name, M, 16, 8, 4, 2, activation, norm, "bfloat16")


# --- arguments and rows -------------------------------------------------------------------------

def test_arguments():
  args = bench.parse_args(["--op", "moe"])
  assert args.variants == ["fused", "ragged_dot", "fused_gemms"]
  assert args.M is None and args.tp is None
  args = bench.parse_args(["--op", "moe", "--tp", "1", "--M", "256,512", "--variants",
                           "ragged_dot", "--dtype", "float16"])
  assert (args.M, args.variants, args.dtype) == ([256, 512], ["ragged_dot"], "float16")
  for bad in (["--tp", "2"], ["--variants", "dense"], ["--variants", "xla"], ["--dtype", "int32"],
              ["--dtype", "float8_e4m3fn"], ["--routing", "even"], ["--backward"],
              ["--of", "ag_gemm"], ["--sizes-mib", "1"], ["--iters", "0"]):
    with pytest.raises(SystemExit):
      bench.parse_args(["--op", "moe", *bad])


def test_rows_from_the_shapes_file():
  shapes = json.loads((ROOT / "benchmarks" / "shapes.json").read_text())
  args = SimpleNamespace(M=None, shapes=None, dtype="bfloat16")
  rows = mt.build_rows(args, shapes)
  by_name = {r.name: r for r in rows}
  assert {"mixtral", "qwen3-30b-a3b"} <= set(by_name)
  assert all(r.M == 4096 and r.dtype == "bfloat16" for r in rows)
  mixtral, qwen = by_name["mixtral"], by_name["qwen3-30b-a3b"]
  assert (mixtral.hidden, mixtral.intermediate, mixtral.experts, mixtral.top_k,
          mixtral.activation, mixtral.norm_topk_prob) == (4096, 14336, 8, 2, "swiglu", True)
  assert (qwen.hidden, qwen.intermediate, qwen.experts, qwen.top_k) == (2048, 768, 128, 8)
  assert mixtral.weight_names == ("gate", "wi_0", "wi_1", "wo")
  assert mixtral.shapes["wi_0"] == (8, 4096, 14336) and mixtral.shapes["wo"] == (8, 14336, 4096)
  # 3x the forward: router 2*M*H*E, three expert projections 2*M*k*H*I each.
  assert mixtral.flops == 3 * (2 * 4096 * 4096 * 8 + 3 * 2 * 4096 * 2 * 4096 * 14336)
  rows = mt.build_rows(SimpleNamespace(M=[8, 16], shapes=["tiny-gelu"], dtype="float16"), SHAPES)
  assert [(r.name, r.M, r.activation, r.norm_topk_prob, r.dtype) for r in rows] == [
      ("tiny-gelu", 8, "gelu", False, "float16"), ("tiny-gelu", 16, "gelu", False, "float16")]
  assert rows[0].weight_names == ("gate", "wi", "wo")
  with pytest.raises(ValueError, match="unknown name"):
    mt.build_rows(SimpleNamespace(M=None, shapes=["nope"], dtype="bfloat16"), SHAPES)


# --- the step and the checks --------------------------------------------------------------------

@pytest.mark.slow
def test_the_step_is_value_and_grad_of_the_loss():
  """The variant's outputs: the loss terms and the gradients of mean(y * ct) + 0.01 * aux w.r.t.
  the params and x, as computed directly with the layer."""
  row = _row()
  (inputs,) = mt.make_inputs(row, bench.make_mesh(1), 1, seed=0)
  assert inputs["x"].dtype == jnp.bfloat16 and inputs["gate"].dtype == jnp.float32
  assert {n: inputs[n].shape for n in row.shapes} == row.shapes
  variant = mt.make_variant("ragged_dot", row)
  assert variant.inputs == ("x", "ct", "gate", "wi_0", "wi_1", "wo")
  losses, grads = jax.jit(variant.fn)(*(inputs[n] for n in variant.inputs))
  layer = mt._layer(row, "xla")
  params = {n: inputs[n] for n in row.weight_names}

  def loss(params, x):
    y, state = layer.apply({"params": params}, x, mutable=["intermediates"])
    aux = state["intermediates"]["load_balancing_loss"][0]
    return jnp.mean(y.astype(jnp.float32) * inputs["ct"].astype(jnp.float32)) + 0.01 * aux, aux

  (want, aux), (dparams, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
      params, inputs["x"])
  np.testing.assert_allclose(np.asarray(losses), [want, want - 0.01 * aux, aux], rtol=1e-5)
  assert sorted(grads) == ["gate", "wi_0", "wi_1", "wo", "x"]
  for name, want_grad in {**dparams, "x": dx}.items():
    assert grads[name].dtype == want_grad.dtype
    np.testing.assert_allclose(np.asarray(grads[name], np.float32),
                               np.asarray(want_grad, np.float32), rtol=1e-5, atol=1e-7)
  # The router's (token, expert) pairs: k per token.
  rows = mt.expert_rows(row, inputs)
  assert len(rows) == 4 and sum(rows) == 32 * 2 and min(rows) >= 0


def test_compare_and_rel_diff():
  grads = {"gate": jnp.ones((2, 3)), "x": jnp.full((4,), 2.0)}
  other = {"gate": jnp.ones((2, 3)) * 1.01, "x": jnp.full((4,), 2.0)}
  checks = mr.compare((jnp.array([1.1, 0.5, 2.0]), other), (jnp.array([1.0, 0.4, 2.0]), grads))
  assert checks["loss_rel_diff"] == pytest.approx(0.1)
  assert checks["output_loss_rel_diff"] == pytest.approx(0.25)
  assert checks["grad_rel_diff"]["gate"] == pytest.approx(0.01, rel=1e-4)
  assert checks["grad_rel_diff"]["x"] == 0.0
  assert checks["grad_rel_diff_max"] == pytest.approx(0.01, rel=1e-4)
  assert mr._rel_diff(0.0, 0.0) == 0.0 and mr._rel_diff(1.0, 0.0) is None
  assert mr._rel_diff(float("nan"), 1.0) is None


def test_row_ratio_and_table_arithmetic():
  row = _row()
  losses = {"fused": {"total": 1.01, "output": 0.01, "load_balancing": 100.0},
            "ragged_dot": {"total": 1.0, "output": 0.0, "load_balancing": 100.0}}
  checks = {"loss_rel_diff": 0.01, "output_loss_rel_diff": 0.2, "grad_rel_diff": {"x": 1e-3},
            "grad_rel_diff_max": 1e-3}
  record = mr.summarize_row(row, {"fused": [1.0, 1.2, 1.1], "ragged_dot": [3.0, 3.6]}, {},
                            losses, checks, {"fused": 2}, {}, 1, [30, 34, 0, 0])
  assert record["ms"] == {"fused": 1.1, "ragged_dot": pytest.approx(3.3), "fused_gemms": None}
  assert record["gemm_share"] is None and record["outside_gemms_share"] is None
  assert record["ratios"]["ragged_over_fused"] == pytest.approx(3.0)
  assert record["spread_ms"]["fused"] == [1.0, 1.2]
  assert record["tflops"]["fused"] == pytest.approx(row.flops / 1.1e-3 / 1e12)
  assert record["loss"] == {"fused": 1.01, "ragged_dot": 1.0}
  assert record["loss_terms"]["ragged_dot"]["load_balancing"] == 100.0
  assert (record["expert_rows_min"], record["expert_rows_max"], record["routed_rows"]) == (
      0, 34, 64)
  assert record["errors"] == {"fused_gemms": "not requested"}
  # The output term differs by more than MOE_MAX_REL_DIFF: a warning.
  assert [w.split(" ")[0] for w in record["warnings"]] == ["output_loss_rel_diff"]

  only = mr.summarize_row(_row(M=64), {"ragged_dot": [2.0]}, {"fused": "E: no kernel"},
                          {"ragged_dot": losses["ragged_dot"]}, None, {}, {}, 1, None)
  assert only["ms"]["fused"] is None and only["ratios"]["ragged_over_fused"] is None
  assert only["loss"] == {"fused": None, "ragged_dot": 1.0} and only["grad_rel_diff"] is None
  assert only["errors"] == {"fused": "E: no kernel", "fused_gemms": "not requested"}
  assert only["warnings"] == []
  fast = mr.summarize_row(row, {"ragged_dot": [1e-9]}, {}, {}, None, {}, {}, 1, None)
  assert fast["errors"]["fused"] == "not requested" and "ragged_dot: " in fast["warnings"][0]

  # The fused step's GEMMs alone: its share of the step, the rest outside them.
  gemms = mr.summarize_row(row, {"fused": [2.0], "fused_gemms": [1.5]}, {}, {}, None, {}, {},
                           1, None)
  assert gemms["gemm_share"] == 0.75 and gemms["outside_gemms_share"] == pytest.approx(0.25)
  assert gemms["tflops"]["fused_gemms"] == pytest.approx(row.gemm_flops / 1.5e-3 / 1e12)
  assert mr.summarize_table([gemms])["outside_gemms_share"]["worst"] == pytest.approx(0.25)

  summary = mr.summarize_table([record, only])
  assert summary["ragged_over_fused"] == {"rows": 1, "of_rows": 2, "mean": pytest.approx(3.0),
                                          "worst": pytest.approx(3.0), "worst_row": "tiny M=32"}
  assert summary["grad_rel_diff_max"] == {"rows": 1, "of_rows": 2, "worst": 1e-3,
                                          "worst_row": "tiny M=32"}
  text = mr.format_table({"rows": [record, only], "summary": summary})
  line = r"\ntiny +32 +4 +2 +0-34 +1\.100 +3\.300 +3\.00 .* 1 +1\.0e-02 +1\.0e-03\n"
  assert re.search(line, text)
  assert "ragged_over_fused: mean 3.000, worst 3.000 (tiny M=32), 1 of 2 rows" in text
  assert "fused: E: no kernel" in text and "warning: output_loss_rel_diff" in text


# --- end to end ---------------------------------------------------------------------------------

def test_run_without_the_fused_kernel(shapes_file, tmp_path):
  if not ON_CPU:
    pytest.skip("checks the reasons off GPU")
  result = _run(shapes_file, tmp_path)
  assert result["command"].startswith("python -m jaxflux.bench --op moe")
  assert {"date", "machine", "versions", "definitions", "settings"} <= set(result)
  assert result["output"].split("/")[-1].startswith("moe_cpu_tp1_")
  settings = result["settings"]
  assert settings["op"] == "moe" and settings["tp"] == 1 and settings["timing"] == "loop"
  assert settings["moe"]["aux_weight"] == 0.01 and settings["moe"]["param_dtype"] == "float32"
  (row,) = result["rows"]
  assert (row["name"], row["M"], row["experts"], row["top_k"]) == ("tiny", 32, 4, 2)
  assert row["ms"]["fused"] is None and row["loss"]["fused"] is None
  assert row["errors"]["fused"].startswith("FusedKernelUnavailableError")
  assert row["ratios"]["ragged_over_fused"] is None and row["loss_rel_diff"] is None
  assert row["grad_rel_diff"] is None
  assert row["ms"]["ragged_dot"] > 0 and len(row["samples_ms"]["ragged_dot"]) == 2
  terms = row["loss_terms"]["ragged_dot"]
  assert all(np.isfinite(v) for v in terms.values()) and np.isfinite(row["loss"]["ragged_dot"])
  assert terms["total"] == pytest.approx(terms["output"] + 0.01 * terms["load_balancing"],
                                         rel=1e-4)
  assert row["input_sets"] == 1  # loop mode's perturb chain: one set
  assert sum(row["expert_rows"]) == 64 and row["warnings"] == []


@pytest.mark.slow
def test_run_with_a_stand_in_fused_kernel(shapes_file, tmp_path, monkeypatch):
  """impl="fused" replaced by the XLA path: the fused columns, the ratio and the checks fill in
  (zero differences: the same program), and the variants rotate the same input sets."""
  real = mt._layer
  monkeypatch.setattr(mt, "_layer", lambda row, impl: real(row, "xla"))
  monkeypatch.setattr(mt, "_grouped",
                      lambda x, w, sizes: jaxflux.grouped_matmul(x, w, sizes, impl="xla"))
  result = _run(shapes_file, tmp_path / "m.json", "--timing", "dispatch", "--rotate-mib", "0.02")
  (row,) = result["rows"]
  assert row["input_sets"] > 1
  assert row["calls_per_run"] == {"fused": 2, "ragged_dot": 2, "fused_gemms": 2}
  # the step's GEMMs alone: timed, their share of the step and the rest outside them
  assert row["ms"]["fused_gemms"] > 0 and row["tflops"]["fused_gemms"] > 0
  assert row["gemm_share"] == pytest.approx(row["ms"]["fused_gemms"] / row["ms"]["fused"],
                                            rel=1e-4)
  assert row["outside_gemms_share"] == pytest.approx(1 - row["gemm_share"], rel=1e-4)
  assert row["ms"]["fused"] > 0 and row["ms"]["ragged_dot"] > 0
  assert row["ratios"]["ragged_over_fused"] == pytest.approx(
      row["ms"]["ragged_dot"] / row["ms"]["fused"], rel=1e-4)
  assert row["loss"]["fused"] == row["loss"]["ragged_dot"]
  assert row["loss_rel_diff"] == 0 and row["output_loss_rel_diff"] == 0
  assert row["grad_rel_diff"] == {n: 0 for n in ("gate", "wi_0", "wi_1", "wo", "x")}
  assert row["grad_rel_diff_max"] == 0 and row["errors"] == {} and row["warnings"] == []
  assert result["summary"]["ragged_over_fused"]["rows"] == 1
