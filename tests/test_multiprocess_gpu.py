"""The fused ops with one process per GPU (CUDA IPC workspace), 2 processes on one host:
values, back-to-back calls and gradients against float32 NumPy, and a peer that dies mid-run.
Skipped unless jaxflux.has_cuda() and at least 2 GPUs. See tests/multiprocess_gpu_worker.py.

The same with tp = 2, 4 or 8 processes on one GPU (`shared`): the ranks' kernels take turns on
it, which runs the fused ops' whole cross-rank protocol (IPC-mapped workspace, pushes, flags,
bounded waits) on a one-GPU machine, so a change to the fused kernels can be checked for
correctness without several GPUs. Those tests need one GPU; they say nothing of speed. The quick
tier runs each fused op once at tp=2 and at tp=4, in one launch per group size; every other
test is the full tier's, tp=2 in its ops chunk, tp 4 and 8 in its tp4 and tp8 chunks (`ranks`).
Among them: a random fuzz of all three fused ops (tests/fuzz_cases.py), the tensor-parallel
MLP's forward and backward in one program, and the same for the MoE ops' expert MLP."""
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


def _run(launcher, tmp_path, mode, timeout, shared=False, tp=2, **env_vars):
  """Runs the worker's `mode` in `tp` processes (one GPU each, or all on GPU 0 with `shared`),
  `env_vars` added to their environment."""
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",  # this process holds the GPUs too
             PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
             **env_vars)
  port = str(launcher.free_port())  # one coordinator port for the whole group
  commands = [[sys.executable, str(WORKER), port, str(tp), str(i), mode]
              + (["shared"] if shared else []) for i in range(tp)]
  return run_group(launcher, commands, tmp_path, timeout, env=env, grace=30,
                   name=f"{mode}_tp{tp}" + ("_shared" if shared else ""))


def ranks(quick=(2,), slow=(4, 8)):
  """Parametrizes a shared-GPU test over its group sizes `tp`: `quick` ones in the quick tier,
  `slow` ones in the full tier only (its tp4 and tp8 chunks). Four or eight processes on one GPU
  take turns on it, so a test's time grows about with tp."""
  return pytest.mark.parametrize("tp", [pytest.param(t, id=f"tp{t}") for t in quick] + [
      pytest.param(t, id=f"tp{t}", marks=pytest.mark.slow) for t in slow])


def _scaled(seconds_at_tp2: int, tp: int) -> int:
  """A shared-GPU group's time limit: the ranks take turns, so it grows with tp, up to the 9
  minutes a device call leaves a test tier."""
  return min(540, seconds_at_tp2 * tp // 2)


def _all_exited_cleanly(results):
  return [code for code, _ in results] == [0] * len(results)


def test_fused_ops_across_two_processes(launcher, tmp_path):
  results = _run(launcher, tmp_path, "check", timeout=180)
  assert _all_exited_cleanly(results), describe(results)
  for i, (_, out) in enumerate(results):
    assert f"WORKER OK {i}" in out, describe(results)
    for case in ("all_gather_matmul value", "matmul_reduce_scatter value", "gradient x",
                 "gradient w", "all_gather_matmul value, slots gathered in the program"):
      assert f"PASS {case}\n" in out, describe(results)
    assert out.count("PASS back-to-back call") == 12, describe(results)
    assert "RANKS PER GPU 1\n" in out, describe(results)


def _assert_every_wait_timed_out(results, tp=2):
  """Process 1 died; each survivor's cases (the worker's DIE_CASES: each kind of wait, six at
  tp=2, five past it, where GEMM+RS has no epilogue wait) each timed out."""
  cases = 6 if tp == 2 else 5
  for i, (code, out) in enumerate(results):
    if i != 1:
      assert code == 0 and f"WORKER OK {i}" in out, describe(results)
      assert f"DIE CASES {cases}\n" in out, describe(results)
      assert out.count("PASS dead peer, ") == cases, describe(results)


def test_a_dead_peer_fails_the_survivor_within_the_timeout(launcher, tmp_path):
  _assert_every_wait_timed_out(_run(launcher, tmp_path, "die", timeout=120))


def _assert_same_choices_and_shared_gpu(results, tp):
  """Every rank reads the same device tables and makes the same kernel choices, and the runtime
  sees the ranks share the GPU (so its fused GEMMs leave SMs to each other)."""
  tuning_lines = [re.findall(r"^TUNING [0-9a-f]{16} [0-9a-f]{64}$", out, re.M)
                  for _, out in results]
  assert len(tuning_lines[0]) == 1, describe(results)
  assert all(t == tuning_lines[0] for t in tuning_lines), describe(results)
  for _, out in results:
    assert f"RANKS PER GPU {tp}\n" in out, describe(results)


def _assert_same_digests(results, count):
  """Each replicated output (GEMM+AllReduce's) the same bits on every rank."""
  digests = [re.findall(r"^DIGEST (.+) ([0-9a-f]{64})$", out, re.M) for _, out in results]
  assert len(digests[0]) == count and all(d == digests[0] for d in digests), describe(results)


# The quick tier's shared-GPU test: one launch per group size runs every fused op (the worker's
# processes start and compile once for all of them).
@ranks(quick=(2, 4), slow=())
def test_each_fused_op_once_sharing_one_gpu(one_gpu_launcher, tmp_path, tp):
  """AG+GEMM and GEMM+RS (values, gradients, back-to-back calls), GEMM+AllReduce, the three FP8
  forms and the MoE ops' expert MLP forward and backward, once each, against float32 or
  float64 references (the worker's MODE=quick)."""
  results = _run(one_gpu_launcher, tmp_path, "quick", timeout=_scaled(240, tp),
                 shared=True, tp=tp)
  assert _all_exited_cleanly(results), describe(results)
  _assert_same_choices_and_shared_gpu(results, tp)
  for i, (_, out) in enumerate(results):
    assert f"WORKER OK {i}" in out and "FAIL" not in out, describe(results)
    for case in ("all_gather_matmul value", "matmul_reduce_scatter value", "gradient x",
                 "gradient w", "ar decode M=16", "ar prefill M=2048"):
      assert f"PASS {case}\n" in out, describe(results)
    assert out.count("PASS back-to-back call") == 3, describe(results)
    # ag: value, x_full, HLO; rs and ar: value, HLO; moe: HLO and 6 outputs
    counts = {"PASS fp8 ag ": 3, "PASS fp8 rs ": 2, "PASS fp8 ar ": 2, "PASS moe ": 7}
    assert {c: out.count(c) for c in counts} == counts, describe(results)
  _assert_same_digests(results, 3)


@pytest.mark.slow
def test_a_fused_program_loads_from_the_compilation_cache_in_new_processes(one_gpu_launcher,
                                                                          tmp_path):
  """A second group of processes, which traced another fused program first, loads the first
  group's compiled AG+GEMM program from JAX's persistent cache and computes the same bits: the
  traced program holds no process history (tests/test_program_identity.py)."""
  cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
  runs = []
  for detour in ("0", "1"):
    (tmp_path / detour).mkdir()
    results = _run(one_gpu_launcher, tmp_path / detour, "cache", timeout=180, shared=True,
                   CACHE_DETOUR=detour, **cache)
    assert _all_exited_cleanly(results), describe(results)
    assert all("FAIL" not in out for _, out in results), describe(results)
    runs.append(results)
  first, second = ([re.findall(r"^(CACHE HITS \d+|DIGEST .+)$", out, re.M) for _, out in run]
                   for run in runs)
  for rank, (a, b) in enumerate(zip(first, second)):
    # (A first-group rank that compiles after its peer wrote the entry may hit it already.)
    assert b[0] == "CACHE HITS 1", (rank, a, b)
    assert len(a) == 2 and a[1] == b[1], (rank, a, b)  # the same bits from the loaded program


@ranks(quick=(), slow=(2, 4, 8))
def test_fused_ops_sharing_one_gpu(one_gpu_launcher, tmp_path, tp):
  results = _run(one_gpu_launcher, tmp_path, "check", timeout=_scaled(180, tp),
                 shared=True, tp=tp)
  assert _all_exited_cleanly(results), describe(results)
  _assert_same_choices_and_shared_gpu(results, tp)
  for i, (_, out) in enumerate(results):
    assert f"WORKER OK {i}" in out, describe(results)
    for case in ("all_gather_matmul value", "matmul_reduce_scatter value", "gradient x",
                 "gradient w"):
      assert f"PASS {case}\n" in out, describe(results)
    assert out.count("PASS back-to-back call") == 12, describe(results)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["matrix", "matrix_pingpong"])
@ranks(slow=())
def test_fused_op_matrix_sharing_one_gpu(one_gpu_launcher, tmp_path, mode, tp):
  """Every benchmark shape at M=1024, odd shapes, batch dims, fp16 and both ops' gradients;
  GEMM+RS's own rows under its own choice of schedule (cooperative), then forced ping-pong."""
  results = _run(one_gpu_launcher, tmp_path, mode, timeout=_scaled(300, tp),
                 shared=True, tp=tp)
  assert _all_exited_cleanly(results), describe(results)
  for i, (_, out) in enumerate(results):
    assert f"WORKER OK {i}" in out and "FAIL" not in out, describe(results)
    assert out.count("PASS ag ") == 18 and out.count("PASS rs ") == 19, describe(results)


@ranks(quick=(), slow=(2, 4, 8))
def test_matmul_all_reduce_sharing_one_gpu(one_gpu_launcher, tmp_path, tp):
  """GEMM+AllReduce against float32 NumPy in both processes, and both processes' copies of each
  output the same bits (the worker prints a digest of its copy per case)."""
  results = _run(one_gpu_launcher, tmp_path, "all_reduce", timeout=_scaled(300, tp),
                 shared=True, tp=tp)
  assert _all_exited_cleanly(results), describe(results)
  for i, (_, out) in enumerate(results):
    assert f"WORKER OK {i}" in out and "FAIL" not in out, describe(results)
    # 5 row cases, 8 odd/batched/fp16 ones, the gradient case's 3 checks, 8 back-to-back calls
    assert out.count("PASS ar ") == 24, describe(results)
  _assert_same_digests(results, 14)


@ranks(quick=(), slow=(2, 4, 8))
def test_fp8_fused_ops_sharing_one_gpu(one_gpu_launcher, tmp_path, tp):
  """FP8 all_gather_matmul, matmul_reduce_scatter and matmul_all_reduce, impl="fused": x e4m3 or
  e5m2 with an e4m3 weight given [n, K] (transpose_w=True), per-tensor scales that differ
  between the ranks and row-wise ones, odd shapes (matmul_all_reduce: M of 1, 3, 17, 100) and
  batch dims, against float32 NumPy on the dequantized values; all_gather_matmul's x_full the
  FP8 values bit for bit; every compiled program the fused custom call and no XLA all-gather /
  reduce-scatter (nor all-reduce for matmul_all_reduce); both processes' copies of each
  matmul_all_reduce output the same bits."""
  results = _run(one_gpu_launcher, tmp_path, "fp8", timeout=_scaled(420, tp),
                 shared=True, tp=tp)
  assert _all_exited_cleanly(results), describe(results)
  for i, (_, out) in enumerate(results):
    assert f"WORKER OK {i}" in out and "FAIL" not in out, describe(results)
    # 2 formats x 2 scale kinds x 3 shapes: ag value, x_full, HLO; rs value, HLO
    assert out.count("PASS fp8 ag ") == 36 and out.count("PASS fp8 rs ") == 24, describe(results)
    # 2 formats x 2 scale kinds x 5 shapes: ar value, HLO
    assert out.count("PASS fp8 ar ") == 40, describe(results)
  _assert_same_digests(results, 20)


@pytest.mark.parametrize("tp, dtypes", [
    pytest.param(2, 1, id="tp2-bfloat16", marks=pytest.mark.slow),
    pytest.param(2, 2, id="tp2-bfloat16-float16", marks=pytest.mark.slow),
    pytest.param(4, 1, id="tp4-bfloat16", marks=pytest.mark.slow),
    pytest.param(8, 1, id="tp8-bfloat16", marks=pytest.mark.slow)])
def test_moe_ops_sharing_one_gpu(one_gpu_launcher, tmp_path, tp, dtypes):
  """The fused MoE ops as one expert MLP, forward and backward, against a dense float32
  reference of the global data (the worker's MODE=moe, or moe_bfloat16)."""
  mode = "moe" if dtypes == 2 else "moe_bfloat16"
  results = _run(one_gpu_launcher, tmp_path, mode, timeout=_scaled(300, tp),
                 shared=True, tp=tp)
  assert _all_exited_cleanly(results), describe(results)
  for i, (_, out) in enumerate(results):
    assert f"WORKER OK {i}" in out and "FAIL" not in out, describe(results)
    # dtypes x 4 cases x (hlo + 6 outputs), and 4 back-to-back checks per dtype
    assert out.count("PASS moe ") == dtypes * 4 * 7 + dtypes * 4, describe(results)


@ranks(quick=(), slow=(2, 4, 8))
def test_moe_layer_on_the_fused_ops_sharing_one_gpu(one_gpu_launcher, tmp_path, tp):
  """jaxflux.MoE with the experts' intermediate dimension and the tokens over 'tp' runs the fused
  MoE ops with no XLA collective, forward and backward (every param's gradient, the router's
  included, and the load-balancing loss's), against a dense float32 reference (the worker's
  MODE=moe_layer: top-1, 2 and 8, swiglu and gelu, empty experts)."""
  results = _run(one_gpu_launcher, tmp_path, "moe_layer", timeout=_scaled(300, tp),
                 shared=True, tp=tp)
  assert _all_exited_cleanly(results), describe(results)
  for i, (_, out) in enumerate(results):
    assert f"WORKER OK {i}" in out and "FAIL" not in out, describe(results)
    # per case: the HLO, y, the loss, dx, the router's and each expert kernel's gradient
    # (swiglu 3, gelu 2)
    assert out.count("PASS moe layer ") == 8 + 7 + 8, describe(results)


@pytest.mark.slow  # the full tier's ops chunk: 33 s on one H100
@ranks()
def test_a_dead_peer_sharing_one_gpu_fails_the_survivors(one_gpu_launcher, tmp_path, tp):
  _assert_every_wait_timed_out(
      _run(one_gpu_launcher, tmp_path, "die", timeout=_scaled(120, tp), shared=True,
           tp=tp), tp)


@pytest.mark.slow
@ranks(slow=(4,))
def test_fuzz_sharing_one_gpu(one_gpu_launcher, tmp_path, tp):
  """tests/fuzz_cases.py's random cases of all three fused ops (150 per op at tp=2, 100 at tp=4,
  each a fresh compile; JAXFLUX_FUZZ_SEED and JAXFLUX_FUZZ_CASES pass through to the workers), every
  element of each rank's output against the float64 reference. A failure lists every failed
  case with the environment that replays it."""
  seed, cases = fuzz_cases.from_env(tp=tp)
  results = _run(one_gpu_launcher, tmp_path, "fuzz", timeout=540, shared=True, tp=tp)
  where = f"fuzz seed {seed}\n{describe(results)}"
  fails = "\n".join(line for _, out in results for line in out.splitlines()
                    if line.startswith("FAIL "))
  assert not fails, f"fuzz seed {seed}, failed cases:\n{fails}\n{where}"
  assert _all_exited_cleanly(results), where
  for i, (_, out) in enumerate(results):
    assert f"FUZZ SEED {seed} CASES {len(cases)}\n" in out, where
    assert f"WORKER OK {i}" in out, where
    assert out.count("PASS fuzz ") == len(cases), where


@pytest.mark.slow  # the full tier's ops chunk
@ranks()
def test_fused_mlp_sharing_one_gpu(one_gpu_launcher, tmp_path, tp):
  """Column-parallel all_gather_matmul, GELU, row-parallel matmul_reduce_scatter with
  impl="fused", forward and backward (jax.vjp) in one program, bf16 and fp16 at five shapes
  (odd rows, one row, batch dims), against float64 NumPy: z, dx, dw1, dw2 on each rank."""
  results = _run(one_gpu_launcher, tmp_path, "mlp", timeout=_scaled(150, tp),
                 shared=True, tp=tp)
  assert _all_exited_cleanly(results), describe(results)
  for i, (_, out) in enumerate(results):
    assert f"WORKER OK {i}" in out and "FAIL" not in out, describe(results)
    assert out.count("PASS mlp ") == 2 * len(fuzz_cases.MLP_SHAPES) * 4, describe(results)
