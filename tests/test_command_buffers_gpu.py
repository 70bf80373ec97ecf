"""The tp=1 kernels (jaxflux_gemm, jaxflux_grouped_gemm) declare their workspace as a result
but are not command-buffer compatible (in a decode loop their buffers move every step, and XLA
recording them again each time made generation slower; docs/design.md, "Command buffers"):
XLA's command buffers leave them out, the host runs each call every step, and the outputs are
bitwise those of the same program with command buffers off."""
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
def test_left_out_of_command_buffers_and_bitwise_as_without():
  """With command buffers on (XLA's default) as off, the host runs every call of every run (a
  captured call would run only to be recorded), and every run's output has the same bits."""
  on = run_worker("", seed=3)
  off = run_worker("--xla_gpu_enable_command_buffer=", seed=3)
  runs = on["runs"]
  for target, calls in on["calls_per_run"].items():
    assert calls >= 2, (target, calls)  # a forward and a backward call each
    assert off["host_executions"][target] == runs * calls, off
    assert on["host_executions"][target] == runs * calls, on
  assert len(on["digests"]) == 1 and on["digests"] == off["digests"]
