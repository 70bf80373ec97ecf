"""The training example on GPUs with the fused kernels: every tensor-parallel matmul of the
train step, forward and backward, is a jaxflux custom call, and the loss curve matches the same
model built from flax.linen.Dense. Skipped unless jaxflux.has_cuda() and the GPUs each test
needs: one for tp=1 (the fused ops' GEMM alone, bfloat16 and FP8), two for tp >= 2."""
import math
import pathlib

import jax
import pytest

import jaxflux

from conftest import load_script
from test_example import train_step_hlo

pytestmark = pytest.mark.gpu

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_tp_transformer.py"


@pytest.fixture(scope="module")
def example():
  return load_script(EXAMPLE, "train_tp_transformer_gpu")


def _gpus(least: int = 2) -> int:
  n = len(jax.devices("gpu")) if jaxflux.has_cuda() else 0
  if n < least:
    pytest.skip(f"needs at least {least} GPU(s) and a CUDA build of jaxflux")
  return n


def _targets(targets: dict, prefix: str) -> int:
  return sum(v for k, v in targets.items() if k.startswith(prefix))


def test_fused_train_step_has_no_xla_tp_collectives_and_matches_flax(example):
  """Per layer: forward 2 AllGather+GEMM (qkv, fc1) and 2 GEMM+ReduceScatter (out, fc2); the
  backward mirrors them (a column layer's dX is a GEMM+ReduceScatter, a row layer's an
  AllGather+GEMM). XLA keeps only the all-reduces (loss, replicated params' gradients)."""
  from hlo_util import count_collectives, custom_call_targets

  tp = _gpus()
  layers = 2
  argv = ["--tp", str(tp), "--impl", "fused", "--dtype", "bfloat16", "--steps", "8",
          "--batch", "2", "--seq", str(256 * tp), "--hidden", "256", "--heads", str(4 * tp),
          "--layers", str(layers), "--ffn", str(512 * tp), "--vocab", "256", "--lr", "3e-3",
          "--activation", "swiglu", "--quiet"]
  hlo = train_step_hlo(example, argv)
  targets, counts = custom_call_targets(hlo), count_collectives(hlo)
  assert _targets(targets, "jaxflux_all_gather_matmul") == 4 * layers, targets
  assert _targets(targets, "jaxflux_matmul_reduce_scatter") == 4 * layers, targets
  assert counts.get("all-gather", 0) == 0 and counts.get("reduce-scatter", 0) == 0, counts

  result = example.main(argv)
  assert result["ok"], (result["losses"], result["flax"])
  assert result["losses"][-1] < result["losses"][0]


@pytest.mark.parametrize("fp8", [pytest.param(False, id="bf16"),
                                 pytest.param(True, id="fp8", marks=pytest.mark.slow)])
def test_tp1_fused_gemm_trains_like_flax(example, capsys, fp8):
  """At tp=1 the fused ops communicate nothing and run jaxflux's GEMM kernel alone (target
  jaxflux_gemm): per layer the four projections' forward and their dX in the backward (dW may
  stay XLA's dot), with --fp8 its FP8 build, as the example counts them in the step it compiled
  and trained. Trained a few steps, the model matches the same one
  built from flax.linen.Dense (with --fp8, Flax's FP8 recipe on XLA's dot) from the same
  params: the first loss (same params, forward only) closely, the curve within the example's
  bfloat16 rtol; both learn. With --fp8 the run also differs from the one without FP8 (the
  quantization really ran) by less than the example's 10%. Every GPU trains its own batch
  rows (dp = GPUs): one GPU is enough."""
  n = _gpus(least=1)
  layers = 2
  argv = ["--tp", "1", "--impl", "fused", "--dtype", "bfloat16", "--steps", "6",
          "--batch", str(2 * n), "--seq", "256", "--hidden", "256", "--heads", "4",
          "--layers", str(layers), "--ffn", "512", "--vocab", "256", "--quiet"]
  argv += ["--fp8"] if fp8 else []  # K and N of every projection are multiples of 16
  result = example.main(argv)
  out = capsys.readouterr().out
  calls = result["fused_calls"]
  assert calls and all(k.startswith("jaxflux_gemm") for k in calls), calls
  assert sum(calls.values()) >= 8 * layers, calls
  assert "[jaxflux] compiled in" in out and "matmuls: fused kernels: jaxflux_gemm" in out, out
  ours, ref = result["losses"], result["flax"]
  assert len(ours) == len(ref) == 6 and all(map(math.isfinite, ours + ref)), (ours, ref)
  assert abs(ours[0] - ref[0]) <= 1e-2 * ref[0], (ours, ref)
  assert result["rtol"] == 5e-2 and result["max_rel_diff"] <= result["rtol"], (ours, ref)
  for curve in (ours, ref):  # learning: about 6.1 -> 5.4 at these sizes
    assert curve[-1] < curve[0] - 0.3, (ours, ref)
  if fp8:
    assert 0 < result["fp8_rel_diff"] <= 0.1, (ours, result["base"])
  assert result["ok"], (ours, ref)
