"""benchmarks/fused_timeline.py's trace reading on a synthetic trace: GPU events only, named by
process and stream, ordered per GPU by start, times from the first GPU event. (Tracing the op
itself needs 2 GPUs: the script's main runs on the GPU machine.)"""
import pathlib

from conftest import load_script, write_trace

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "fused_timeline.py"


def test_gpu_events_of_a_synthetic_trace(tmp_path):
  timeline = load_script(SCRIPT, "fused_timeline")
  events = [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:1"}},
      {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/host:CPU"}},
      {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7"}},
      {"ph": "X", "pid": 2, "tid": 7, "ts": 130, "dur": 5, "name": "gemm_b"},
      {"ph": "X", "pid": 2, "tid": 8, "ts": 110, "dur": 40, "name": "MemcpyP2P"},
      {"ph": "X", "pid": 1, "tid": 9, "ts": 100, "dur": 10, "name": "gemm_a"},
      {"ph": "X", "pid": 3, "tid": 1, "ts": 0, "dur": 999, "name": "python"},  # host: ignored
  ]
  write_trace(tmp_path, events)
  assert timeline.gpu_events(tmp_path) == [
      ("/device:GPU:1", "9", 0, 10, "gemm_a"),
      ("/device:GPU:0", "8", 10, 40, "MemcpyP2P"),
      ("/device:GPU:0", "Stream #7", 30, 5, "gemm_b"),
  ]
