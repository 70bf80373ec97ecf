"""benchmarks/render_tables.py: the READMEs' result tables match benchmarks/results/, and the
rendering itself on tiny fake results."""
import json
import pathlib

import pytest

from conftest import load_script

render = load_script(pathlib.Path(__file__).parent.parent / "benchmarks" / "render_tables.py",
                     "render_tables")


def test_readme_tables_are_up_to_date():
  assert render.main(["--check"]) == 0, "run: python benchmarks/render_tables.py"


def _op_row(name, M, xla, jaxflux, gemm=None):
  return {"name": name, "M": M, "ms": {"xla": xla, "jaxflux": jaxflux, "gemm": gemm}}


def _run(rows, **extra):
  return {"command": "python -m jaxflux.bench", "date": "2030-01-02T03:04:05Z",
          "machine": {"device_count": 2, "device_kinds": ["NVIDIA H200"],
                      "driver_version": "1.2"},
          "versions": {"jax": "9.9"}, "settings": {"timing": "device"}, "rows": rows, **extra}


@pytest.fixture
def results(tmp_path):
  def write(name, runs):
    (tmp_path / name).write_text(json.dumps({"description": "d", "runs": runs}))
  write("h200x2_ag_gemm_tp2.json", [
      _run([_op_row("a", 2048, 1.2, 1.0, 0.9), _op_row("a", 4096, 2.0, 2.5, 1.8)], table=True),
      _run([_op_row("a", 256, 0.1, 0.2)])])
  write("h200x2_train_llama70b_8l.json", [
      {**_run([]), "mode": m, "group": "g", "step_ms_median": t, "step_ms_min": t - 1,
       "timed_steps": 10, "tokens_per_s": 1000.0}
      for m, t in (("jaxflux", 100.0), ("xla", 110.0))])
  return tmp_path


def test_render_blocks_from_fake_results(results):
  text = ("intro\n<!-- table:ops_h200x2 -->\nold\n<!-- end table:ops_h200x2 -->\nmiddle\n"
          "<!-- table:gemm_h200 -->\n<!-- end table:gemm_h200 -->\n"
          "<!-- table:train_h200x2 -->\nx\n<!-- end table:train_h200x2 -->\nend\n")
  out = render.render_text(text, results)
  assert out.startswith("intro\n<!-- table:ops_h200x2 -->\n") and out.endswith("\nend\n")
  assert "old" not in out and "\nmiddle\n" in out
  # Only the run marked table: 1.2 and 0.8 -> mean 1.00, XLA faster on the M=4096 row.
  assert "| AG+GEMM | 2 (1 shapes × M 2048–4096) | 1.00× (0.80×–1.20×) | a M=4096 |" in out
  assert "| 1.25 (1.39) |" in out  # fused / GEMM alone: (1.0/0.9 + 2.5/1.8) / 2, worst 1.39
  assert "below 2048 tokens on 1 of 1 (worst 0.50×, a M=256)" in out
  assert "| GEMM+RS | not measured yet |" in out
  assert "2×H200, jax 9.9, driver 1.2, 2030-01-02, device clock" in out
  assert "Not measured yet: `benchmarks/results/h200_gemm_table.json`" in out
  assert "| g | jaxflux | 10 | 100.0 | 99.0 | 1,000 | 1.100 | — |" in out
  assert render.render_text(out, results) == out  # stable


def _gemm_row(of, name, M, gemm_only, own_rows=None, tbps=None):
  ratios = {"gemm_only_vs_xla": gemm_only}
  if own_rows is not None:
    ratios["own_rows_vs_xla_own_rows_c"] = own_rows
  return {"of": of, "name": name, "M": M, "ratios": ratios,
          **({"weight_tbps": {"xla": tbps[0], "gemm_only": tbps[1]}} if tbps else {})}


def test_render_gemm_table_from_a_bench_record(results):
  record = _run([_gemm_row("ag_gemm", "a", 2048, 1.04), _gemm_row("ag_gemm", "a", 4096, 0.98),
                 _gemm_row("gemm_rs", "r", 2048, 1.0, own_rows=0.99)])
  (results / "h200_gemm_table.json").write_text(json.dumps(record))  # a bare record works too
  # GEMM+AR: the decode rows from their own file, the rest from the other one.
  ar = [_gemm_row("gemm_ar", "r", 8, 1.5, tbps=(4.0, 2.0)), _gemm_row("gemm_ar", "r", 512, 1.02)]
  (results / "h200_gemm_all_reduce.json").write_text(json.dumps(_run(ar)))
  decode = [_gemm_row("gemm_ar", "r", 1, 1.1, tbps=(4.0, 3.5)),
            _gemm_row("gemm_ar", "r", 128, 1.0, tbps=(3.0, 3.0))]
  (results / "h200_gemm_decode.json").write_text(json.dumps(_run(decode)))
  out = render.render_gemm(results)
  assert "| AG+GEMM | 2 | 1.010 (1.040, a M=2048) | — |" in out
  assert "| GEMM+RS | 1 | 1.000 (1.000, r M=2048) | 0.990 (0.990, r M=2048) |" in out
  assert "| GEMM+AR, M > 128 | 1 | 1.020 (1.020, r M=512) | — |" in out
  assert "| GEMM+AR, M ≤ 128 | 2 | 1.050 (1.100, r M=1) | — |" in out
  assert "M ≤ 128 (2 rows), weight read: cuBLAS 3.0–4.0 TB/s, GEMM-only 3.0–3.5 TB/s" in out
  assert out.count("`benchmarks/results/h200_gemm_table.json`") == 1


def test_unknown_table_name_fails(results):
  with pytest.raises(ValueError, match="unknown table"):
    render.render_text("<!-- table:nope -->\n<!-- end table:nope -->\n", results)
