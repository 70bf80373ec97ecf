"""The benchmark's GPU clock (jaxflux/bench/device_clock.py, `--timing device`) on GPUs: reads
are in stream order and honour the idle time, and a timed run agrees with the host's wall clock
on a call long enough that the host cannot show. Skipped unless jaxflux.has_cuda() and 2 GPUs."""
import time

import numpy as np
import pytest

from jaxflux import bench
from jaxflux.bench.device_clock import DeviceClock
from gpu_util import gpu_mesh

pytestmark = pytest.mark.gpu


def test_reads_follow_stream_order_and_the_idle_time():
  mesh = gpu_mesh()
  clock = DeviceClock(mesh)
  clock.read(0).block_until_ready()
  clock.read(5_000_000).block_until_ready()  # compiled
  start = clock.read(5_000_000)  # idles 5 ms, then reads
  end = clock.read()
  t0, t1 = DeviceClock.nanoseconds(start), DeviceClock.nanoseconds(end)
  assert len(t0) == mesh.size and np.all(t1 > t0)
  # The first read stamps when its 5 ms idle ends; the second, queued behind it, runs at once.
  assert np.all(t1 - t0 < 5_000_000)
  begin = time.perf_counter()
  clock.read(20_000_000).block_until_ready()
  assert time.perf_counter() - begin >= 0.019


def test_device_timing_agrees_with_wall_time_on_a_long_call(tmp_path):
  """A 16k x 16k x 8k bf16 GEMM per device takes milliseconds; host dispatch is invisible there,
  so the two timers must agree within 10%."""
  gpu_mesh()
  shapes = tmp_path / "shapes.json"
  shapes.write_text('{"ag_gemm": [{"name": "big", "K": 8192, "N": 32768}], "gemm_rs": [], '
                    '"M": [16384]}')
  common = ["--op", "ag_gemm", "--shapes-file", str(shapes), "--variants", "gemm,xla",
            "--iters", "10", "--warmup", "10", "--repeats", "3", "--rotate-mib", "0"]
  device = bench.run(common + ["--timing", "device", "--out", str(tmp_path / "d.json")],
                     log=lambda *a, **k: None)["rows"][0]
  wall = bench.run(common + ["--timing", "dispatch", "--out", str(tmp_path / "w.json")],
                   log=lambda *a, **k: None)["rows"][0]
  assert all(device["device_queue_filled"].values()), device["device_queue_filled"]
  for v in ("gemm", "xla"):
    assert device["ms"][v] == pytest.approx(wall["ms"][v], rel=0.10), (device["ms"], wall["ms"])
