"""jaxflux with one process per device group: jax.distributed on localhost, CPU only.

Each test starts local processes (the interpreter running pytest) that join one
jax.distributed job through a coordinator on 127.0.0.1, with cross-process CPU collectives
through gloo, so meshes span processes as they span hosts on a cluster:

- tests/multiprocess_worker.py: both ops (impl="auto") in a jitted shard_map and column -> row
  MLPs of jaxflux.Dense and jaxflux.nnx.Linear, values and gradients against float64 NumPy, on
  a tp mesh over all processes' devices and on ('dp', 'tp') meshes with tp inside a process
  and tp across processes.
- examples/launch_multiprocess.py: the training example as 2 processes x 2 devices.

Every run is bounded: a process that fails takes the others down within a grace period, and
a run past its timeout is killed (see launch_multiprocess.launch).
"""

import os
import pathlib
import socket
import sys

import pytest

from conftest import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multiprocess_worker.py"
LAUNCHER = ROOT / "examples" / "launch_multiprocess.py"


@pytest.fixture(scope="module")
def launcher():
  return load_script(LAUNCHER, "launch_multiprocess")


@pytest.fixture(autouse=True)
def _gloo_can_bind():
  # gloo listens on the address this machine's hostname resolves to (it has no loopback
  # option reachable through JAX's public config), so a host without that fails in gloo.
  try:
    socket.getaddrinfo(socket.gethostname(), None)
  except OSError as e:
    pytest.skip(f"gloo needs the hostname {socket.gethostname()!r} to resolve: {e}")


def child_env(**extra):
  env = dict(os.environ, JAX_PLATFORMS="cpu", **extra)
  # The children import jaxflux from this checkout, installed or not.
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  return env


def run_group(launcher, commands, tmp_path, timeout, env=None, grace=10, name="process"):
  """Runs the commands as one group (environment `env`, default child_env()); returns
  [(exit status, output)] per process."""
  logs = [open(tmp_path / f"{name}{i}.log", "w+") for i in range(len(commands))]
  try:
    codes = launcher.launch(commands, [env or child_env()] * len(commands), timeout=timeout,
                            grace=grace, stdouts=logs)
    outputs = []
    for log in logs:
      log.seek(0)
      outputs.append(log.read())
  finally:
    for log in logs:
      log.close()
  return list(zip(codes, outputs))


def describe(results):
  return "\n".join(f"--- process {i} (exit {code}):\n{out[-4000:]}"
                   for i, (code, out) in enumerate(results))


@pytest.mark.parametrize("num_processes, local_devices, meshes", [
    (2, 2, ["tp4", "dp2xtp2-tp-in-process", "dp2xtp2-tp-across"]),
    (4, 1, ["tp4", "dp2xtp2-tp-across"]),
], ids=["2procs-x-2devices", "4procs-x-1device"])
@pytest.mark.slow
def test_ops_and_layers_across_processes(launcher, tmp_path, num_processes, local_devices, meshes):
  port = launcher.free_port()
  commands = [[sys.executable, str(WORKER), str(port), str(num_processes), str(i),
               str(local_devices)] for i in range(num_processes)]
  results = run_group(launcher, commands, tmp_path, timeout=75)

  assert all(code == 0 for code, _ in results), describe(results)
  cases = ("all_gather_matmul value", "matmul_reduce_scatter value", "op gradients",
           "linen Dense MLP", "nnx Linear MLP")
  for i, (_, out) in enumerate(results):
    assert f"WORKER OK {i}" in out, describe(results)
    passed = {line[len("PASS "):] for line in out.splitlines() if line.startswith("PASS ")}
    assert passed == {f"{m} {c}" for m in meshes for c in cases}, describe(results)
  # The point of the exercise: tp groups whose devices live in different processes.
  assert "tp spans processes: True" in results[0][1], describe(results)


@pytest.mark.slow
def test_training_example_two_processes(launcher, tmp_path):
  # 2 processes x 2 CPU devices, dp=2 across processes x tp=2 inside each; a few steps of the
  # jaxflux model and of the flax.linen.Dense reference, whose losses must match.
  example = ["--steps", "2", "--batch", "4", "--seq", "16", "--hidden", "32", "--heads", "4",
             "--layers", "1", "--ffn", "64", "--vocab", "32", "--tp", "2"]
  log = tmp_path / "launcher.log"
  with open(log, "w") as out:
    codes = launcher.launch(
        [[sys.executable, str(LAUNCHER), "-n", "2", "--cpu-devices", "2", "--platform", "cpu",
          "--timeout", "100", "--", *example]],
        [child_env()], timeout=110, stdouts=[out])
  text = log.read_text()
  assert codes == [0], text
  assert "mesh: dp=2 x tp=2 on cpu (4 devices, 2 process(es))" in text, text
  assert "MATCH" in text and "MISMATCH" not in text, text
  # Only process 0 reports.
  assert text.count("final losses:") == 1, text


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs"])
@pytest.mark.slow
def test_benchmark_two_processes(launcher, tmp_path, op):
  # `python -m jaxflux.bench` as 2 processes x 2 CPU devices, tp=4 across them: every process
  # runs the rows, process 0 alone writes the JSON, with every XLA variant timed and auto's
  # output checked against xla's.
  import json

  shapes = tmp_path / "shapes.json"
  shapes.write_text(json.dumps({op: [{"name": "tiny", "K": 64, "N": 64}], "M": [64]}))
  out = tmp_path / "bench.json"
  bench_args = ["--op", op, "--shapes-file", str(shapes), "--iters", "3", "--warmup", "1",
                "--repeats", "2", "--variants", "gemm,comm,xla,jaxflux,auto", "--out", str(out)]
  log = tmp_path / "launcher.log"
  with open(log, "w") as stdout:
    codes = launcher.launch(
        [[sys.executable, str(LAUNCHER), "-n", "2", "--cpu-devices", "2", "--platform", "cpu",
          "--timeout", "100", "--bench", "--", *bench_args]],
        [child_env()], timeout=110, stdouts=[stdout])
  text = log.read_text()
  assert codes == [0], text
  assert text.count("[bench] wrote") == 1, text  # only process 0 reports
  record = json.loads(out.read_text())
  assert record["settings"]["processes"] == 2 and record["settings"]["tp"] == 4
  assert record["machine"]["device_count"] == 4
  (row,) = record["rows"]
  for variant in ("gemm", "comm", "xla", "auto"):
    assert row["ms"][variant] > 0, row
  assert row["rel_err"]["auto"] < 1e-2, row
  assert row["ms"]["jaxflux"] is None and "fused" in row["errors"]["jaxflux"].lower(), row
