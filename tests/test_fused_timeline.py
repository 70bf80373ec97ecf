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


def test_own_rows_modes_call_the_own_rows_kernel_and_only_for_gemm_rs():
  import jax
  import numpy as np
  import pytest
  from jax.sharding import Mesh

  import jaxflux
  timeline = load_script(SCRIPT, "fused_timeline")
  mesh = Mesh(np.asarray(jax.devices()[:2]), ("tp",))
  with pytest.raises(SystemExit, match="own-rows modes are gemm_rs's"):
    timeline.fused_call("ag_gemm", "own_rows_c", mesh)
  with pytest.raises(SystemExit, match="own-rows modes"):
    timeline.fused_call("gemm_rs", "own_rows_typo", mesh)
  if jaxflux.has_cuda():
    pytest.skip("the wiring check below needs the no-GPU error")
  x = jax.ShapeDtypeStruct((256, 128), jax.numpy.bfloat16)
  w = jax.ShapeDtypeStruct((128, 64), jax.numpy.bfloat16)
  for mode in timeline.OWN_ROWS_MODES:
    with pytest.raises(jaxflux.FusedKernelUnavailableError, match="gemm_own_rows"):
      jax.eval_shape(timeline.fused_call("gemm_rs", mode, mesh), x, w)


def test_own_rows_modes_pass_c_only_when_named(monkeypatch):
  """own_rows_chunked reads no C: "_c" is also in "_chunked" (sessions 9-10 passed one)."""
  import jax
  import numpy as np
  from jax.sharding import Mesh

  from jaxflux.ops import gemm as gemm_module
  timeline = load_script(SCRIPT, "fused_timeline")
  seen = {}

  def fake_own_rows(x, w, c=None, *, chunked=False, scheduler="fused", schedule="cooperative",
                    transpose_w=False):
    assert not transpose_w  # the timeline's modes take the weight as the forward op does
    seen[mode] = (c is not None, chunked, scheduler, schedule)
    return x @ w

  monkeypatch.setattr(gemm_module, "gemm_own_rows", fake_own_rows)
  mesh = Mesh(np.asarray(jax.devices()[:2]), ("tp",))
  x = jax.ShapeDtypeStruct((256, 128), jax.numpy.float32)
  w = jax.ShapeDtypeStruct((128, 64), jax.numpy.float32)
  for mode in timeline.OWN_ROWS_MODES:
    jax.eval_shape(timeline.fused_call("gemm_rs", mode, mesh), x, w)
  coop, pp = "cooperative", "pingpong"
  assert seen == {"own_rows": (False, False, "fused", coop),
                  "own_rows_c": (True, False, "fused", coop),
                  "own_rows_chunked": (False, True, "fused", coop),
                  "own_rows_c_chunked": (True, True, "fused", coop),
                  "own_rows_c_chunked_cutlass_scheduler": (True, True, "cutlass", coop),
                  "own_rows_pingpong": (False, False, "fused", pp),
                  "own_rows_c_pingpong": (True, False, "fused", pp),
                  "own_rows_chunked_pingpong": (False, True, "fused", pp),
                  "own_rows_c_chunked_pingpong": (True, True, "fused", pp)}


def test_gemm_summary_tells_the_schedulers_apart():
  timeline = load_script(SCRIPT, "fused_timeline")
  fused = "_ZN7cutlass13device_kernelI...AgGemmSchedulerTag..."
  plain = "_ZN7cutlass13device_kernelI...PersistentTileSchedulerSm90..."
  events = [("g0", "s", 0, 10.0, plain), ("g0", "s", 10, 20.0, fused), ("g0", "s", 30, 3.0, "x"),
            ("g1", "s", 0, 12.0, plain), ("g1", "s", 12, 22.0, fused), ("g1", "s", 40, 30.0, fused)]
  assert timeline.gemm_summary(events) == [("CUTLASS-scheduler GEMM", 2, 11.0),
                                           ("fused-scheduler GEMM", 3, 22.0)]
