"""The main job, examples/train_tp_transformer.py, run in-process on 8 virtual CPU devices.

Each case trains the small transformer built from jaxflux.Dense for a few steps and then the
same model built from flax.linen.Dense; both must learn and their loss curves must match.
"""

import importlib.util
import math
import pathlib
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_tp_transformer.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_tp_transformer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    # Registered first: dataclasses (flax modules) resolve string annotations through it.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _require_devices(n):
    import jax

    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices, found {len(jax.devices())}")


# Small enough for a 2-core CPU; heads and ffn divide by tp=8, seq by tp.
SMALL = ["--steps", "10", "--batch", "8", "--seq", "32", "--hidden", "64", "--heads", "8",
         "--layers", "1", "--ffn", "128", "--vocab", "64", "--lr", "1e-2", "--quiet"]


@pytest.mark.parametrize(
    "extra, dp, tp",
    [
        (["--tp", "8"], 1, 8),
        (["--tp", "4", "--activation", "swiglu"], 2, 4),
    ],
    ids=["tp8", "dp2-tp4-swiglu"],
)
def test_trains_and_matches_flax(example, extra, dp, tp):
    _require_devices(8)
    result = example.main(SMALL + extra)

    assert (result["dp"], result["tp"]) == (dp, tp)
    ours, ref = result["jaxflux"], result["flax"]
    assert len(ours) == len(ref) == 10
    assert all(math.isfinite(x) for x in ours + ref), (ours, ref)
    # Learns: noisy per-batch losses, so compare the ends of the curve, with a margin.
    assert sum(ours[-3:]) / 3 < sum(ours[:3]) / 3 - 0.3, ours
    # Same params, same batches: the curves agree to float32 rounding.
    assert result["max_rel_diff"] <= 1e-4, (ours, ref)
    assert result["ok"]


def test_rejects_indivisible_heads(example):
    _require_devices(8)
    with pytest.raises(ValueError, match="--heads 6 must be divisible by tp=8"):
        example.main(SMALL + ["--heads", "6", "--hidden", "48", "--tp", "8"])
