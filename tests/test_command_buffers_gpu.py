"""The tp=1 kernels (jaxflux_gemm, jaxflux_grouped_gemm) declare their workspace as a result
and are command-buffer compatible: XLA captures them into CUDA graphs with the ops around them,
and the outputs are bitwise those of the same program with command buffers off."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent


def run_worker(xla_flags: str, seed: int, **env_vars) -> dict:
  """command_buffer_worker.py's report, run in a fresh process with `xla_flags` added and
  `env_vars` set."""
  env = {**os.environ, **env_vars}
  env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS", ""), xla_flags]))
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), str(HERE.parent),
                                                    env.get("PYTHONPATH", "")]))
  done = subprocess.run([sys.executable, str(HERE / "command_buffer_worker.py"), str(seed)],
                        env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-4000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_captured_into_command_buffers_and_bitwise_as_without():
  """XLA runs a captured handler only to record it and replays the graph after: over the runs
  the host executes each call at most once (a recapture), against every run with command
  buffers off; every run's output has the same bits either way. (The compiled HLO doesn't show
  the capture: XLA forms command buffers from the thunks, after HLO.)"""
  on = run_worker("", seed=3)
  off = run_worker("--xla_gpu_enable_command_buffer=", seed=3)
  runs = on["runs"]
  for target, calls in on["calls_per_run"].items():
    assert calls >= 2, (target, calls)  # a forward and a backward call each
    assert off["host_executions"][target] == runs * calls, off
    assert on["host_executions"][target] <= calls, on
  assert len(on["digests"]) == 1 and on["digests"] == off["digests"]
