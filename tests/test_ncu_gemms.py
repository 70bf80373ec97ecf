"""benchmarks/ncu_gemms.py's reading of Nsight Compute CSV reports, on a synthetic report in
ncu's --csv --page raw layout (profiling needs a GPU and ncu), and its cuBLAS variant on CPU."""
import pathlib

import pytest
from conftest import load_script

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "ncu_gemms.py"

HEADER = ('"ID","Process ID","Kernel Name","gpu__time_duration.sum","sm__cycles_elapsed.max",'
          '"dram__bytes_read.sum","dram__bytes_write.sum","lts__t_sector_hit_rate.pct",'
          '"sm__throughput.avg.pct_of_peak_sustained_elapsed"')


def _report(units: str, *rows: str) -> str:
  return "\n".join(["==PROF== Connected to process 123", HEADER, units, *rows,
                    "==PROF== Disconnected from process 123"])


def test_last_kernel_is_summarized_in_fixed_units():
  ncu = load_script(SCRIPT, "ncu_gemms")
  text = _report('"","","","usecond","cycle","Mbyte","Kbyte","%","%"',
                 '"0","123","autotune_candidate","50.00","75,000","10.0","512","40.0","20.0"',
                 '"1","123","cutlass::device_kernel<X>","200.00","360,000","1,234.5","2,048",'
                 '"71.5","88.25"')
  units, rows = ncu.parse_report(text)
  assert units["gpu__time_duration.sum"] == "usecond" and len(rows) == 2
  s = ncu.summarize_kernel(rows[-1], units)
  assert s["kernel"].startswith("cutlass::device_kernel")
  assert s["time_us"] == pytest.approx(200.0)
  assert s["cycles"] == 360_000 and s["clock_mhz"] == pytest.approx(1800.0)
  assert s["hbm_read_mb"] == pytest.approx(1234.5) and s["hbm_write_mb"] == pytest.approx(2.048)
  assert s["l2_hit_pct"] == 71.5 and s["sm_throughput_pct"] == 88.25


def test_nanosecond_and_byte_units_and_an_empty_report():
  ncu = load_script(SCRIPT, "ncu_gemms")
  units, rows = ncu.parse_report(_report('"","","","nsecond","cycle","byte","byte","%","%"',
                                         '"0","1","k","1000","1500","3000000","0","1","2"'))
  s = ncu.summarize_kernel(rows[0], units)
  assert s["time_us"] == pytest.approx(1.0) and s["clock_mhz"] == pytest.approx(1500.0)
  assert s["hbm_read_mb"] == pytest.approx(3.0)
  assert ncu.parse_report("==PROF== nothing profiled") == ({}, [])


def test_cublas_variant_runs_on_cpu(capsys):
  ncu = load_script(SCRIPT, "ncu_gemms")
  ncu.run("cublas", 16, 32, 8, calls=2)
  assert "cublas 16x32x8: 2 calls after a warm-up call" in capsys.readouterr().out


def test_program_output_around_the_report_is_ignored():
  ncu = load_script(SCRIPT, "ncu_gemms")
  text = ("W1130 some jax warning\nncu_gemms: cutlass 8x8x8: 3 calls\n"
          + _report('"","","","usecond","cycle","Mbyte","Mbyte","%","%"',
                    '"0","1","k","2.0","3000","1","1","1","1"') + "\ntrailing program line\n")
  units, rows = ncu.parse_report(text)
  assert len(rows) == 1 and ncu.summarize_kernel(rows[0], units)["clock_mhz"] == 1500.0


def test_own_rows_variants_are_the_kernels_own():
  """ncu_gemms.py lists its variants itself (its CLI imports no jaxflux) and parses the own-rows
  ones with jaxflux.ops.gemm.own_rows_variant: the two lists must not drift apart."""
  from jaxflux.ops.gemm import OWN_ROWS_VARIANTS
  ncu = load_script(SCRIPT, "ncu_gemms")
  assert {v for v in ncu.VARIANTS if v.startswith("own_rows")} == set(OWN_ROWS_VARIANTS)


def test_time_reports_medians_and_ratios_to_the_first_variant():
  ncu = load_script(SCRIPT, "ncu_gemms")
  rows = ncu.report_times({"a": [10.0, 12.0, 11.0], "b": [22.0, 20.0, 30.0]})
  assert [r["variant"] for r in rows] == ["a", "b"]
  assert rows[0]["median_us"] == 11.0 and rows[0]["ratio_to_first"] == 1.0
  assert rows[1]["median_us"] == 22.0 and rows[1]["min_us"] == 20.0
  assert rows[1]["ratio_to_first"] == pytest.approx(2.0)


def test_time_runs_on_cpu_and_records_its_command(tmp_path, capsys):
  import json
  ncu = load_script(SCRIPT, "ncu_gemms")
  out = tmp_path / "t.json"
  argv = ["time", "cublas", "16", "32", "8", "--calls", "2", "--rounds", "3", "--json", str(out)]
  ncu.main(argv)
  ncu.main(argv)  # a second shape (here the same) appends to the file
  assert "16x32x8, 3 rounds of 2 calls" in capsys.readouterr().out
  results = json.loads(out.read_text())
  assert len(results) == 2 and results[0]["command"] == "benchmarks/ncu_gemms.py " + " ".join(argv)
  assert len(results[0]["round_times_us"]["cublas"]) == 3
  with pytest.raises(SystemExit, match="unknown variant"):
    ncu.main(["time", "cublas,nope", "16", "32", "8"])


def test_kmajor_variants_take_the_weight_transposed():
  """cublas_kmajor multiplies by the [N, K] weight contracted in place: the same product as
  cublas with the [K, N] one (CPU); `time` hands each variant the weight it takes."""
  import jax
  import numpy as np
  ncu = load_script(SCRIPT, "ncu_gemms")
  x, w, c = ncu.operands(16, 32, 24)
  _, wt, _ = ncu.operands(16, 32, 24, "own_rows_c_chunked_pingpong_kmajor")
  assert wt.shape == (24, 32) and w.shape == (32, 24)
  want = np.asarray(ncu.make_call("cublas")(x, w, c), np.float32)
  got = np.asarray(ncu.make_call("cublas_kmajor")(x, jax.numpy.asarray(w.T), c), np.float32)
  np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
  assert np.linalg.norm(want) > 0
  times = ncu.time_variants(["cublas", "cublas_kmajor"], 16, 32, 24, calls=2, rounds=2)
  assert [len(t) for t in times.values()] == [2, 2]
  assert ncu.kmajor("own_rows_c_kmajor") and not ncu.kmajor("own_rows_c")


def test_table_shapes_are_the_per_device_gemms():
  """ag_gemm: the gathered rows times the weight's N/tp columns; gemm_rs: K/tp, all M rows for
  the device's GEMM, M/tp rows for the own rows it reduces into."""
  ncu = load_script(SCRIPT, "ncu_gemms")
  ag = ncu.table_shapes("ag_gemm", [2048], 2, "device", ["llama70b-qkv"])
  assert ag == [("llama70b-qkv", 2048, (2048, 8192, 5120))]
  rs = ncu.table_shapes("gemm_rs", [4096, 8192], 4, "own_rows", ["gpt3-fc2"])
  assert rs == [("gpt3-fc2", 4096, (1024, 12288, 12288)), ("gpt3-fc2", 8192, (2048, 12288, 12288))]
  assert ncu.table_shapes("gemm_rs", [4096], 2, "device", ["llama70b-out"])[0][2] == (4096, 4096, 8192)
  with pytest.raises(SystemExit, match="own_rows with --op gemm_rs"):
    ncu.table_shapes("ag_gemm", [2048], 2, "own_rows")
  with pytest.raises(SystemExit, match="unknown"):
    ncu.table_shapes("ag_gemm", [2048], 2, "device", ["nope"])


def test_table_runs_on_cpu_into_one_json(tmp_path, capsys):
  import json
  ncu = load_script(SCRIPT, "ncu_gemms")
  shapes = tmp_path / "shapes.json"
  shapes.write_text(json.dumps({"ag_gemm": [{"name": "tiny", "K": 32, "N": 16}], "gemm_rs": []}))
  out = tmp_path / "table.json"
  ncu.main(["table", "--op", "ag_gemm", "--M", "8,16", "--variants", "cublas", "--calls", "2",
            "--rounds", "2", "--shapes-file", str(shapes), "--json", str(out)])
  record = json.loads(out.read_text())
  assert record["op"] == "ag_gemm" and record["ratios_to"] == "cublas"
  assert record["rows_planned"] == len(record["results"]) == 2
  assert [(r["M"], r["gemm"]) for r in record["results"]] == [
      (8, {"m": 8, "k": 32, "n": 8}), (16, {"m": 16, "k": 32, "n": 8})]
  assert all(r["rows"][0]["ratio_to_first"] == 1.0 for r in record["results"])
  assert "tiny" in capsys.readouterr().out


def test_config_variants_name_the_kernels_configs():
  from jaxflux.ops.gemm import AG_GEMM_CONFIGS
  ncu = load_script(SCRIPT, "ncu_gemms")
  configs = [v for v in ncu.VARIANTS if v.startswith("ag_gemm_only_config")]
  assert len(configs) == len(AG_GEMM_CONFIGS)
