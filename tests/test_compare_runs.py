"""benchmarks/compare_runs.py: two benchmark records compared row by row, variant by variant."""
import json
import pathlib

from conftest import load_script

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "compare_runs.py"


def _record(times):
  rows = [{"op": "ag_gemm", "name": name, "M": m, "K": 8, "N": 8, "tp": 2, "dtype": "bfloat16",
           "ms": ms} for (name, m), ms in times.items()]
  return {"rows": rows}


def _write(tmp_path, name, record):
  path = tmp_path / name
  path.write_text(json.dumps(record))
  return str(path)


def test_ratios_limit_and_missing_rows(tmp_path, capsys):
  m = load_script(SCRIPT, "compare_runs")
  a = _record({("s", 64): {"xla": 1.0, "jaxflux": 2.0, "pallas": None},
               ("s", 128): {"xla": 4.0, "jaxflux": 4.0}})
  b = _record({("s", 64): {"xla": 1.1, "jaxflux": 2.02}})
  entries = m.compare(a, b, None)
  assert [(e["row"], e["variant"]) for e in entries] == [
      ("ag_gemm s M=64", "xla"), ("ag_gemm s M=64", "jaxflux"), ("ag_gemm s M=128", "xla"),
      ("ag_gemm s M=128", "jaxflux")]
  assert entries[0]["ratio"] == 1.1 / 1.0 and entries[1]["ratio"] == 2.02 / 2.0
  assert entries[2]["ratio"] is None  # B lacks the row
  pa, pb = _write(tmp_path, "a.json", a), _write(tmp_path, "b.json", b)
  # Only jaxflux, only the row both have: 1% slower passes a 3% limit, fails a 0.5% one.
  b_full = _record({("s", 64): {"jaxflux": 2.02}, ("s", 128): {"jaxflux": 4.0}})
  pb_full = _write(tmp_path, "b_full.json", b_full)
  assert m.main([pa, pb_full, "--variants", "jaxflux", "--limit", "1.03"]) == 0
  assert m.main([pa, pb_full, "--variants", "jaxflux", "--limit", "1.005"]) == 1
  assert "<- over the limit" in capsys.readouterr().out
  assert m.main([pa, pb]) == 1  # a row missing from B fails even without a limit
  assert "<- not in B" in capsys.readouterr().out
