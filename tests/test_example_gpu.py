"""The training example on GPUs with the fused kernels (issue 7): every tensor-parallel matmul of
the train step, forward and backward, is a jaxflux custom call, and the loss curve matches the
same model built from flax.linen.Dense. Skipped unless jaxflux.has_cuda() and at least 2 GPUs."""
import pathlib

import jax
import pytest

import jaxflux

from conftest import load_script

pytestmark = pytest.mark.gpu

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_tp_transformer.py"


@pytest.fixture(scope="module")
def example():
  return load_script(EXAMPLE, "train_tp_transformer_gpu")


def _gpus() -> int:
  n = len(jax.devices("gpu")) if jaxflux.has_cuda() else 0
  if n < 2:
    pytest.skip("needs at least 2 GPUs and a CUDA build of jaxflux")
  return n


def _targets(counts: dict, prefix: str) -> int:
  return sum(v for k, v in counts["custom_call_targets"].items() if k.startswith(prefix))


def test_fused_train_step_has_no_xla_tp_collectives_and_matches_flax(example):
  """Per layer: forward 2 AllGather+GEMM (qkv, fc1) and 2 GEMM+ReduceScatter (out, fc2); the
  backward mirrors them (a column layer's dX is a GEMM+ReduceScatter, a row layer's an
  AllGather+GEMM). XLA keeps only the all-reduces (loss, replicated params' gradients)."""
  tp = _gpus()
  layers = 2
  result = example.main([
      "--tp", str(tp), "--impl", "fused", "--dtype", "bfloat16", "--steps", "8",
      "--batch", "2", "--seq", str(256 * tp), "--hidden", "256", "--heads", str(4 * tp),
      "--layers", str(layers), "--ffn", str(512 * tp), "--vocab", "256", "--lr", "3e-3",
      "--activation", "swiglu", "--print-hlo-collectives", "--quiet"])
  counts = result["hlo_collectives"]
  assert _targets(counts, "jaxflux_all_gather_matmul") == 4 * layers, counts
  assert _targets(counts, "jaxflux_matmul_reduce_scatter") == 4 * layers, counts
  assert counts["all-gather"] == 0 and counts["reduce-scatter"] == 0, counts
  assert result["ok"], (result["losses"], result["flax"])
  assert result["losses"][-1] < result["losses"][0]
