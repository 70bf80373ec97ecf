"""The training example on GPUs with the fused kernels: every tensor-parallel matmul of the
train step, forward and backward, is a jaxflux custom call, and the loss curve matches the same
model built from flax.linen.Dense. Skipped unless jaxflux.has_cuda() and at least 2 GPUs."""
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


def _gpus() -> int:
  n = len(jax.devices("gpu")) if jaxflux.has_cuda() else 0
  if n < 2:
    pytest.skip("needs at least 2 GPUs and a CUDA build of jaxflux")
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
