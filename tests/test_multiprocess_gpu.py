"""The fused ops with one process per GPU (CUDA IPC workspace), 2 processes on one host:
values, back-to-back calls and gradients against float32 NumPy, and a peer that dies mid-run.
Skipped unless jaxflux.has_cuda() and at least 2 GPUs. See tests/multiprocess_gpu_worker.py.

The same with both processes on one GPU (`shared`): the ranks' kernels take turns on it, which
runs the fused ops' whole cross-rank protocol (IPC-mapped workspace, pushes, flags, bounded
waits) on a one-GPU machine, so a change to the fused kernels can be checked for correctness
without two GPUs. Those tests need one GPU; they say nothing of speed. Among them: a random
fuzz of all three fused ops (tests/fuzz_cases.py), the tensor-parallel MLP's forward and
backward in one program, and the same for the MoE ops' expert MLP."""
import importlib.util
import os
import pathlib
import re
import sys

import pytest

import fuzz_cases
import jaxflux
from test_multiprocess import describe, run_group

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multiprocess_gpu_worker.py"
LAUNCHER = ROOT / "examples" / "launch_multiprocess.py"


def _load_launcher(min_gpus):
  import jax
  if not jaxflux.has_cuda() or len(jax.devices("gpu")) < min_gpus:
    pytest.skip(f"needs at least {min_gpus} GPU(s) and a CUDA build of jaxflux")
  spec = importlib.util.spec_from_file_location("launch_multiprocess", LAUNCHER)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def launcher():
  return _load_launcher(2)


@pytest.fixture(scope="module")
def one_gpu_launcher():
  return _load_launcher(1)


def _run(launcher, tmp_path, mode, timeout, shared=False):
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",  # this process holds the GPUs too
             PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
  port = str(launcher.free_port())  # one coordinator port for the whole group
  commands = [[sys.executable, str(WORKER), port, "2", str(i), mode] + (["shared"] if shared else [])
              for i in range(2)]
  return run_group(launcher, commands, tmp_path, timeout, env=env, grace=30,
                   name=mode + ("_shared" if shared else ""))


def test_fused_ops_across_two_processes(launcher, tmp_path):
  results = _run(launcher, tmp_path, "check", timeout=180)
  assert [code for code, _ in results] == [0, 0], describe(results)
  for i, (_, out) in enumerate(results):
    assert f"WORKER OK {i}" in out, describe(results)
    for case in ("all_gather_matmul value", "matmul_reduce_scatter value", "gradient x",
                 "gradient w", "all_gather_matmul value, slots gathered in the program"):
      assert f"PASS {case}\n" in out, describe(results)
    assert out.count("PASS back-to-back call") == 12, describe(results)


def _assert_every_wait_timed_out(results):
  """The survivor's six cases (the worker's DIE_CASES: each kind of wait) each timed out."""
  assert results[0][0] == 0 and "WORKER OK 0" in results[0][1], describe(results)
  assert results[0][1].count("PASS dead peer, ") == 6, describe(results)


def test_a_dead_peer_fails_the_survivor_within_the_timeout(launcher, tmp_path):
  _assert_every_wait_timed_out(_run(launcher, tmp_path, "die", timeout=120))


def test_fused_ops_across_two_processes_sharing_one_gpu(one_gpu_launcher, tmp_path):
  results = _run(one_gpu_launcher, tmp_path, "check", timeout=180, shared=True)
  assert [code for code, _ in results] == [0, 0], describe(results)
  # Both ranks read the same device tables and make the same kernel choices.
  tuning_lines = [re.findall(r"^TUNING [0-9a-f]{16} [0-9a-f]{64}$", out, re.M) for _, out in results]
  assert len(tuning_lines[0]) == 1 and tuning_lines[0] == tuning_lines[1], describe(results)
  for i, (_, out) in enumerate(results):
    assert f"WORKER OK {i}" in out, describe(results)
    for case in ("all_gather_matmul value", "matmul_reduce_scatter value", "gradient x",
                 "gradient w"):
      assert f"PASS {case}\n" in out, describe(results)
    assert out.count("PASS back-to-back call") == 12, describe(results)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["matrix", "matrix_pingpong"])
def test_fused_op_matrix_across_two_processes_sharing_one_gpu(one_gpu_launcher, tmp_path, mode):
  """Every benchmark shape at M=1024, odd shapes, batch dims, fp16 and both ops' gradients;
  GEMM+RS's own rows under its own choice of schedule (cooperative), then forced ping-pong."""
  results = _run(one_gpu_launcher, tmp_path, mode, timeout=300, shared=True)
  assert [code for code, _ in results] == [0, 0], describe(results)
  for i, (_, out) in enumerate(results):
    assert f"WORKER OK {i}" in out and "FAIL" not in out, describe(results)
    assert out.count("PASS ag ") == 18 and out.count("PASS rs ") == 19, describe(results)


def test_matmul_all_reduce_across_two_processes_sharing_one_gpu(one_gpu_launcher, tmp_path):
  """GEMM+AllReduce against float32 NumPy in both processes, and both processes' copies of each
  output the same bits (the worker prints a digest of its copy per case)."""
  results = _run(one_gpu_launcher, tmp_path, "all_reduce", timeout=300, shared=True)
  assert [code for code, _ in results] == [0, 0], describe(results)
  for i, (_, out) in enumerate(results):
    assert f"WORKER OK {i}" in out and "FAIL" not in out, describe(results)
    # 5 row cases, 8 odd/batched/fp16 ones, the gradient case's 3 checks, 8 back-to-back calls
    assert out.count("PASS ar ") == 24, describe(results)
  digests = [re.findall(r"^DIGEST (.+) ([0-9a-f]{64})$", out, re.M) for _, out in results]
  assert len(digests[0]) == 14 and digests[0] == digests[1], describe(results)


def test_fp8_fused_ops_sharing_one_gpu(one_gpu_launcher, tmp_path):
  """FP8 all_gather_matmul, matmul_reduce_scatter and matmul_all_reduce, impl="fused": x e4m3 or
  e5m2 with an e4m3 weight given [n, K] (transpose_w=True), per-tensor scales that differ
  between the ranks and row-wise ones, odd shapes (matmul_all_reduce: M of 1, 3, 17, 100) and
  batch dims, against float32 NumPy on the dequantized values; all_gather_matmul's x_full the
  FP8 values bit for bit; every compiled program the fused custom call and no XLA all-gather /
  reduce-scatter (nor all-reduce for matmul_all_reduce); both processes' copies of each
  matmul_all_reduce output the same bits."""
  results = _run(one_gpu_launcher, tmp_path, "fp8", timeout=420, shared=True)
  assert [code for code, _ in results] == [0, 0], describe(results)
  for i, (_, out) in enumerate(results):
    assert f"WORKER OK {i}" in out and "FAIL" not in out, describe(results)
    # 2 formats x 2 scale kinds x 3 shapes: ag value, x_full, HLO; rs value, HLO
    assert out.count("PASS fp8 ag ") == 36 and out.count("PASS fp8 rs ") == 24, describe(results)
    # 2 formats x 2 scale kinds x 5 shapes: ar value, HLO
    assert out.count("PASS fp8 ar ") == 40, describe(results)
  digests = [re.findall(r"^DIGEST (fp8 ar .+) ([0-9a-f]{64})$", out, re.M) for _, out in results]
  assert len(digests[0]) == 20 and digests[0] == digests[1], describe(results)


# The quick tier runs bf16 (the two dtypes took 43 s on one H100,
# benchmarks/results/h100_gpu_test_durations.json); the full tier both.
@pytest.mark.parametrize("dtypes", [pytest.param(1, id="bfloat16"),
                                    pytest.param(2, id="bfloat16-float16",
                                                 marks=pytest.mark.slow)])
def test_moe_ops_across_two_processes_sharing_one_gpu(one_gpu_launcher, tmp_path, dtypes):
  """The fused MoE ops as one expert MLP, forward and backward, against a dense float32
  reference of the global data (the worker's MODE=moe, or moe_bfloat16)."""
  mode = "moe" if dtypes == 2 else "moe_bfloat16"
  results = _run(one_gpu_launcher, tmp_path, mode, timeout=300, shared=True)
  assert [code for code, _ in results] == [0, 0], describe(results)
  for i, (_, out) in enumerate(results):
    assert f"WORKER OK {i}" in out and "FAIL" not in out, describe(results)
    # dtypes x 4 cases x (hlo + 6 outputs), and 4 back-to-back checks per dtype
    assert out.count("PASS moe ") == dtypes * 4 * 7 + dtypes * 4, describe(results)


def test_moe_layer_on_the_fused_ops_sharing_one_gpu(one_gpu_launcher, tmp_path):
  """jaxflux.MoE with the experts' intermediate dimension and the tokens over 'tp' runs the fused
  MoE ops with no XLA collective, forward and backward (the router's kernel held fixed: its
  gradient is an all-reduce), against a dense float32 reference (the worker's MODE=moe_layer:
  top-1, 2 and 8, swiglu and gelu, empty experts)."""
  results = _run(one_gpu_launcher, tmp_path, "moe_layer", timeout=300, shared=True)
  assert [code for code, _ in results] == [0, 0], describe(results)
  for i, (_, out) in enumerate(results):
    assert f"WORKER OK {i}" in out and "FAIL" not in out, describe(results)
    # per case: the HLO, y, dx and each expert kernel (swiglu 3, gelu 2)
    assert out.count("PASS moe layer ") == 6 + 5 + 6, describe(results)


@pytest.mark.slow  # the full tier's ops chunk: 33 s on one H100
def test_a_dead_peer_sharing_one_gpu_fails_the_survivor(one_gpu_launcher, tmp_path):
  _assert_every_wait_timed_out(_run(one_gpu_launcher, tmp_path, "die", timeout=120, shared=True))


@pytest.mark.slow
def test_fuzz_across_two_processes_sharing_one_gpu(one_gpu_launcher, tmp_path):
  """tests/fuzz_cases.py's random cases of all three fused ops (450 at the default seed, each a
  fresh compile; JAXFLUX_FUZZ_SEED and JAXFLUX_FUZZ_CASES pass through to the workers), every
  element of each rank's output against the float64 reference. A failure lists every failed
  case with the environment that replays it."""
  seed, cases = fuzz_cases.from_env(tp=2)
  results = _run(one_gpu_launcher, tmp_path, "fuzz", timeout=420, shared=True)
  where = f"fuzz seed {seed}\n{describe(results)}"
  fails = "\n".join(line for _, out in results for line in out.splitlines()
                    if line.startswith("FAIL "))
  assert not fails, f"fuzz seed {seed}, failed cases:\n{fails}\n{where}"
  assert [code for code, _ in results] == [0, 0], where
  for i, (_, out) in enumerate(results):
    assert f"FUZZ SEED {seed} CASES {len(cases)}\n" in out, where
    assert f"WORKER OK {i}" in out, where
    assert out.count("PASS fuzz ") == len(cases), where


@pytest.mark.slow  # the full tier's ops chunk
def test_fused_mlp_across_two_processes_sharing_one_gpu(one_gpu_launcher, tmp_path):
  """Column-parallel all_gather_matmul, GELU, row-parallel matmul_reduce_scatter with
  impl="fused", forward and backward (jax.vjp) in one program, bf16 and fp16 at five shapes
  (odd rows, one row, batch dims), against float64 NumPy: z, dx, dw1, dw2 on each rank."""
  results = _run(one_gpu_launcher, tmp_path, "mlp", timeout=150, shared=True)
  assert [code for code, _ in results] == [0, 0], describe(results)
  for i, (_, out) in enumerate(results):
    assert f"WORKER OK {i}" in out and "FAIL" not in out, describe(results)
    assert out.count("PASS mlp ") == 2 * len(fuzz_cases.MLP_SHAPES) * 4, describe(results)
