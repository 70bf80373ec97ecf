"""The fused ops at tp=1 on one GPU (a 1-device ('tp',) mesh, where each op runs its fused GEMM
with nothing to communicate) on tests/fuzz_cases.py's random cases drawn at tp=1, impl="fused":
every element of the output against the float64 reference, and, for the bf16 and fp16 cases
(FP8 calls are forward-only), jax.grad of sum(y * ct) (and of x_full's share with
return_gathered) against float64 gradients. The first cases of each op (one of each dtype)
run in the quick tier, the rest are slow. JAXFLUX_FUZZ_SEED and JAXFLUX_FUZZ_CASES select
cases as in tests/multiprocess_gpu_worker.py's fuzz. Skipped unless jaxflux.has_cuda().
"""
import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import fuzz_cases

pytestmark = pytest.mark.gpu

CASES_PER_OP = 40
QUICK = 3  # the first cases of each op: bf16, fp16 and FP8


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.asarray(jax.devices("gpu")[:1]), ("tp",))


def _cases(op):
  seed, cases = fuzz_cases.from_env(tp=1, per_op=CASES_PER_OP)
  return seed, [c for c in cases if c.op == op]


def _run(cases, seed, mesh):
  """Every case, each failure listed (an exception fails its case, not the run)."""
  failures = []
  for case in cases:
    shards = fuzz_cases.make_shards(case)
    try:
      (got,) = fuzz_cases.run_case(case, shards, mesh, impl="fused").values()
      checks = [("value", fuzz_cases.check(fuzz_cases.reference(case, shards, 0), got))]
      if not case.fp8:
        checks += fuzz_cases.run_grads(case, shards, mesh, impl="fused")
    except Exception as e:  # noqa: BLE001 - reported with the case that raised it
      text = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
      checks = [("run", fuzz_cases.Verdict(False, float("nan"), float("nan"), text))]
    for what, verdict in checks:
      line = f"{case.op} {case.index} {case.describe()} {what}: {verdict}"
      print(("PASS " if verdict.ok else "FAIL ") + line, flush=True)
      if not verdict.ok:
        failures.append(f"{line} (replay: {case.replay()})")
  assert not failures, f"fuzz seed {seed} at tp=1, failed:\n" + "\n".join(failures)


@pytest.mark.parametrize("op", fuzz_cases.OPS)
def test_fused_tp1_quick_cases(op, mesh):
  seed, cases = _cases(op)
  _run([c for c in cases if c.index < QUICK], seed, mesh)


@pytest.mark.slow
@pytest.mark.parametrize("op", fuzz_cases.OPS)
def test_fused_tp1_fuzz(op, mesh):
  seed, cases = _cases(op)
  _run([c for c in cases if c.index >= QUICK], seed, mesh)
