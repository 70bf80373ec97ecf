"""benchmarks/profile_summary.py on a synthetic trace: per-GPU span, busy time (overlap counted
once), category and kernel totals."""
import json
import pathlib

import pytest

from conftest import load_script, write_trace

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "profile_summary.py"


@pytest.fixture(scope="module")
def summary():
  return load_script(SCRIPT, "profile_summary")


def test_busy_time_counts_overlap_once(summary):
  assert summary.busy_time([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25


def test_summary_of_a_two_stream_gpu(summary, tmp_path, capsys):
  events = [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
      # stream 1: a GEMM from 0 to 100 us; stream 2: an NCCL kernel 50..90 (hidden) and a copy
      {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 100, "name": "sm90_xmma_gemm_bf16"},
      {"ph": "X", "pid": 1, "tid": 2, "ts": 50, "dur": 40, "name": "ncclDevKernel_AllGather"},
      {"ph": "X", "pid": 1, "tid": 2, "ts": 120, "dur": 10, "name": "Memcpy DtoD"},
      {"ph": "X", "pid": 1, "tid": 1, "ts": 130, "dur": 5, "name": "sm90_xmma_gemm_bf16"},
      {"ph": "X", "pid": 2, "tid": 3, "ts": 0, "dur": 999, "name": "python"},  # host: ignored
  ]
  write_trace(tmp_path, events)
  result = summary.main([str(tmp_path), "--out", str(tmp_path / "s.json")])
  gpu = result["/device:GPU:0"]
  assert gpu["span_us"] == 135 and gpu["busy_us"] == 115
  assert gpu["by_category"] == {"gemm": 105, "nccl": 40, "copy": 10}
  assert gpu["by_kernel"][0] == {"name": "sm90_xmma_gemm_bf16", "total_us": 105, "count": 2}
  assert "/device:GPU:0: span 0.135 ms, busy 0.115 ms" in capsys.readouterr().out
  assert json.loads((tmp_path / "s.json").read_text())["devices"]["/device:GPU:0"]["busy_us"] == 115
