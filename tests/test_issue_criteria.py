"""benchmarks/issue_criteria.py on synthetic benchmark records: a table that meets every limit
passes, one row over a per-row limit fails naming that row, a missing variant or M makes a
criterion incomplete rather than passing."""
import json
import pathlib

from conftest import load_script

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "issue_criteria.py"
M_LIST = (1024, 2048, 4096, 8192, 16384)


def _row(op, name, M, **ms):
  gemm, comm, jaxflux = ms.get("gemm"), ms.get("comm"), ms.get("jaxflux")
  eff = None if None in (gemm, comm, jaxflux) else (gemm + comm - jaxflux) / comm
  return {"op": op, "name": name, "M": M, "K": 8192, "N": 8192, "tp": 2, "dtype": "bfloat16",
          "ms": ms, "overlap_efficiency": eff}


def _good(op, name, M):
  """A row inside every limit: GEMM-only and jaxflux 1% over the GEMM, XLA 20% over it."""
  return _row(op, name, M, gemm=1.0, gemm_only=1.01, comm=0.2, xla=1.2, jaxflux=1.01,
              auto=1.01, pallas=1.1)


def _write(tmp_path, rows, name="r.json"):
  path = tmp_path / name
  path.write_text(json.dumps({"rows": rows}))
  return str(path)


def _status(verdicts):
  return {v.name.split(",")[0].split(" /")[0]: v.status for v in verdicts}


def test_a_table_within_every_limit_passes(tmp_path):
  criteria = load_script(SCRIPT, "issue_criteria")
  rows = [_good("ag_gemm", s, M) for s in ("a", "b") for M in M_LIST]
  verdicts = criteria.evaluate(criteria.load_rows([_write(tmp_path, rows)], "ag_gemm"),
                               "ag_gemm")
  assert [v.status for v in verdicts] == ["PASS"] * 6
  assert criteria.main([_write(tmp_path, rows)]) == 0


def test_one_slow_row_fails_the_per_row_limit_and_is_named(tmp_path):
  criteria = load_script(SCRIPT, "issue_criteria")
  rows = [_good("gemm_rs", s, M) for s in ("a", "b") for M in M_LIST]
  rows[3] = _row("gemm_rs", "a", 8192, gemm=1.0, gemm_only=1.01, comm=0.2, xla=1.2,
                 jaxflux=1.07, auto=1.07)  # 1.07x the GEMM: over GEMM+RS's 1.06 per row
  verdicts = criteria.evaluate(criteria.load_rows([_write(tmp_path, rows)], "gemm_rs"),
                               "gemm_rs")
  fused = next(v for v in verdicts if v.name.startswith("jaxflux / GEMM alone"))
  assert fused.status == "FAIL" and fused.misses == ["a M=8192 1.070"]
  # The mean over 8 rows (1.0175) is still inside GEMM+RS's 1.04, and no row is slower than XLA.
  assert "mean 1.018" in fused.figure
  speedup = next(v for v in verdicts if v.name.startswith("XLA unfused"))
  assert speedup.status == "PASS"
  assert len(verdicts) == 5  # no Pallas criterion for GEMM+RS
  assert criteria.main([_write(tmp_path, rows)]) == 1


def test_missing_variants_or_M_values_are_incomplete_not_passing(tmp_path):
  criteria = load_script(SCRIPT, "issue_criteria")
  rows = [_good("ag_gemm", "a", M) for M in (2048, 8192)]  # no 1024, 4096, 16384
  rows[0]["ms"]["pallas"] = None
  verdicts = criteria.evaluate(criteria.load_rows([_write(tmp_path, rows)], "ag_gemm"),
                               "ag_gemm")
  assert all(v.status == "INCOMPLETE" for v in verdicts)
  pallas = next(v for v in verdicts if "Pallas" in v.name)
  assert "a M=2048" in pallas.figure


def test_a_row_measured_twice_keeps_the_later_file(tmp_path):
  criteria = load_script(SCRIPT, "issue_criteria")
  first = _write(tmp_path, [_good("ag_gemm", "a", 2048)], "first.json")
  slow = _row("ag_gemm", "a", 2048, gemm=1.0, gemm_only=1.01, comm=0.2, xla=1.2, jaxflux=1.3)
  second = _write(tmp_path, [slow], "second.json")
  rows = criteria.load_rows([first, second], "ag_gemm")
  assert len(rows) == 1 and rows[0]["ms"]["jaxflux"] == 1.3
