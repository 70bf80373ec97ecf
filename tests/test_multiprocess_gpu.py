"""The fused ops with one process per GPU (CUDA IPC workspace), 2 processes on one host:
values, back-to-back calls and gradients against float32 NumPy, and a peer that dies mid-run.
Skipped unless jaxflux.has_cuda() and at least 2 GPUs. See tests/multiprocess_gpu_worker.py."""
import importlib.util
import os
import pathlib
import sys

import pytest

import jaxflux
from test_multiprocess import describe, run_group

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multiprocess_gpu_worker.py"
LAUNCHER = ROOT / "examples" / "launch_multiprocess.py"


@pytest.fixture(scope="module")
def launcher():
  import jax
  if not jaxflux.has_cuda() or len(jax.devices("gpu")) < 2:
    pytest.skip("needs at least 2 GPUs and a CUDA build of jaxflux")
  spec = importlib.util.spec_from_file_location("launch_multiprocess", LAUNCHER)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _run(launcher, tmp_path, mode, timeout):
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",  # this process holds the GPUs too
             PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
  port = str(launcher.free_port())  # one coordinator port for the whole group
  commands = [[sys.executable, str(WORKER), port, "2", str(i), mode] for i in range(2)]
  return run_group(launcher, commands, tmp_path, timeout, env=env, grace=30, name=mode)


def test_fused_ops_across_two_processes(launcher, tmp_path):
  results = _run(launcher, tmp_path, "check", timeout=180)
  assert [code for code, _ in results] == [0, 0], describe(results)
  for i, (_, out) in enumerate(results):
    assert f"WORKER OK {i}" in out, describe(results)
    for case in ("all_gather_matmul value", "matmul_reduce_scatter value", "gradient x",
                 "gradient w", "all_gather_matmul value, slots gathered in the program"):
      assert f"PASS {case}\n" in out, describe(results)
    assert out.count("PASS back-to-back call") == 12, describe(results)


def test_a_dead_peer_fails_the_survivor_within_the_timeout(launcher, tmp_path):
  results = _run(launcher, tmp_path, "die", timeout=90)
  assert results[0][0] == 0 and "PASS dead peer" in results[0][1], describe(results)
