"""examples/generate.py on one GPU at tp=1 with impl="fused" (the fused kernels run or the example
raises): the dense model decodes through jaxflux's GEMM kernel and the MoE model through the
grouped GEMM, each as close to the float32 reference as the same model built from
flax.linen.Dense; a batch of one runs on the one-device mesh. Skipped unless jaxflux.has_cuda()."""
import jax
import numpy as np
import pytest

import jaxflux

from test_generate import gen  # noqa: F401 (the example, loaded once as a fixture)

pytestmark = pytest.mark.gpu

SMALL = ["--tp", "1", "--impl", "fused", "--dtype", "bfloat16", "--prompt-len", "64",
         "--new-tokens", "8", "--hidden", "256", "--heads", "4", "--layers", "2", "--ffn", "512",
         "--vocab", "256", "--quiet"]


# 19 to 25 s each on one H100: the full tier's.
@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    pytest.param(["--profile", "2"], id="dense"),
    pytest.param(["--moe", "4,2"], id="moe-top2"),
    pytest.param(["--moe", "4,1"], id="moe-top1"),
    pytest.param(["--batch", "1"], id="batch1"),
])
def test_decodes_with_the_fused_kernels_as_close_to_float32_as_flax(gen, extra):
  gpus = len(jax.devices("gpu")) if jaxflux.has_cuda() else 0
  if gpus < 1 or ("--batch" in extra and gpus != 1):
    pytest.skip("needs one GPU (a batch of one: exactly one) and a CUDA build of jaxflux")
  batch = [] if "--batch" in extra else ["--batch", str(4 * gpus)]
  result = gen.main(SMALL + batch + extra)
  assert result["ok"] and (result["dp"], result["tp"]) == (gpus, 1)
  tokens = np.asarray(result["tokens"])
  assert tokens.shape[1] == 8 and tokens.min() >= 0 and tokens.max() < 256
  vs = result["vs_float32"]
  # bfloat16 roundings in other orders: as far from float32 as Flax is, within a factor 2.
  assert vs["jaxflux"]["rel_logit_diff"] <= 2 * vs["flax"]["rel_logit_diff"] + 1e-3, vs
  assert vs["jaxflux"]["rel_logit_diff"] < 5e-2, vs
  for run in (result["jaxflux"], result["flax"]):
    assert run["step_ms_median"] > 0 and len(run["step_ms"]) == 7
  if "--profile" in extra:  # the profile's reader finds the GPU's kernels, GEMMs among them
    for name, run in (("jaxflux", result["jaxflux"]), ("flax", result["flax"])):
      p = run["profile"]
      assert p is not None and p["gpus"] == gpus and p["steps"] == 2, (name, p)
      # 2 layers x 4 projections (swiglu: fc1 may be 2) and the LM head, at least
      assert p["gemm_calls"] >= 9 and p["gemm_ms"] > 0 and p["other_calls"] > 0, (name, p)
      assert 0 < p["busy_ms"] < 2 * run["step_ms_median"], (name, p)
      assert p["outside_gemm_ms"] == pytest.approx(run["step_ms_median"] - p["gemm_ms"])
    kernels = [k[0].lower() for k in result["jaxflux"]["profile"]["top_kernels"]]
    assert any("cutlass" in k for k in kernels), kernels  # jaxflux's GEMMs, counted as GEMMs
