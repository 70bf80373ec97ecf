"""The main job, examples/train_tp_transformer.py, run in-process on 8 virtual CPU devices.

Each case trains the small transformer built from jaxflux.Dense (or, with --mode, the
impl="xla" or windowed-einsum variant) for a few steps and then the same model built from
flax.linen.Dense; both must learn and their loss curves must match. Also checked: the timing and
MFU numbers, and the collectives in the compiled train step (--print-hlo-collectives).
"""

import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import load_script

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_tp_transformer.py"


@pytest.fixture(scope="module")
def example():
    return load_script(EXAMPLE, "train_tp_transformer")


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
    # Timing: steps after the first two (--warmup-steps 2); no MFU without a known peak (CPU).
    assert result["timed_steps"] == 8
    assert result["step_ms_median"] > 0 and result["tokens_per_s"] > 0
    assert result["mfu"] is None


def test_rejects_indivisible_heads(example):
    _require_devices(8)
    with pytest.raises(ValueError, match="--heads 6 must be divisible by tp=8"):
        example.main(SMALL + ["--heads", "6", "--hidden", "48", "--tp", "8"])


def _non_embedding_params(vocab, hidden, layers, ffn, activation="gelu"):
    c, f = hidden, (2 * ffn if activation == "swiglu" else ffn)
    per_layer = (2 * c                     # norm1, norm2 scales
                 + c * 3 * c + 3 * c        # qkv
                 + c * c + c                # out
                 + c * f + f                # fc1
                 + ffn * c + c)             # fc2
    return layers * per_layer + c + c * vocab + vocab  # + norm_f, lm_head


@pytest.mark.parametrize("mode", ["xla", "windowed"])
def test_modes_match_flax(example, mode):
    _require_devices(8)
    result = example.main(SMALL + ["--tp", "8", "--mode", mode, "--steps", "4",
                                   "--peak-tflops", "0.5"])

    assert result["mode"] == mode and result["ok"]
    ours, ref = result[mode], result["flax"]
    assert result["losses"] is ours and len(ours) == len(ref) == 4
    assert result["max_rel_diff"] <= 1e-4, (ours, ref)
    # Timing over steps 2 and 3 (--warmup-steps 2); MFU from the stated formula.
    assert len(result["step_ms"]) == 4 and result["timed_steps"] == 2
    assert 0 < result["step_ms_min"] <= result["step_ms_median"]
    tokens_per_step = 8 * 32
    assert result["tokens_per_s"] == pytest.approx(tokens_per_step / result["step_ms_median"] * 1e3)
    flops = 6 * _non_embedding_params(64, 64, 1, 128) + 12 * 1 * 64 * 32
    assert result["flops_per_token"] == flops
    assert result["mfu"] == pytest.approx(flops * result["tokens_per_s"] / (0.5e12 * 8))
    assert result["flax_step_ms_median"] > 0 and result["flax_mfu"] > 0


def test_windowed_flags_as_script():
    """Run as a script, --mode windowed puts XLA's windowed-einsum flags into XLA_FLAGS before
    JAX starts (in-process, as above, it is too late); the CPU build of XLA accepts them."""
    env = {**os.environ, "PYTHONPATH": str(EXAMPLE.parents[1]), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(EXAMPLE), *SMALL, "--mode", "windowed",
                           "--steps", "1", "--no-compare"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mode=windowed (flax.linen.Dense under GSPMD, windowed-einsum XLA_FLAGS set)" \
        in proc.stdout, proc.stdout


def test_print_hlo_collectives(example, capsys):
    """Per layer, two column (qkv, fc1) and two row (out, fc2) layers: forward one all-gather
    per column and one reduce-scatter per row layer, backward the mirrored pair (the column
    layer's dX is a reduce-scatter, its dW reuses the forward's gathered input; the row layer's
    dX all-gathers the cotangent, reused for dW). Nothing else gathers or scatters: the
    optimizer state is sharded like the params, and the rest is token-local or an all-reduce
    (gradients of replicated params, the loss, the global gradient norm). On CPU impl="auto" is
    the XLA path, so no custom calls."""
    _require_devices(8)
    layers = 2
    result = example.main(SMALL + ["--tp", "8", "--layers", str(layers), "--steps", "2",
                                   "--no-compare", "--print-hlo-collectives"])
    out = capsys.readouterr().out
    m = re.search(r"HLO of the compiled jaxflux train step: all-gather (\d+), "
                  r"reduce-scatter (\d+), all-reduce (\d+), custom-call (\d+)", out)
    assert m, out
    all_gather, reduce_scatter, all_reduce, custom_call = map(int, m.groups())
    assert (all_gather, reduce_scatter, custom_call) == (4 * layers, 4 * layers, 0), out
    assert all_reduce >= 1, out
    assert "custom-call targets: (none)" in out
    counts = result["hlo_collectives"]
    assert counts["all-gather"] == all_gather and counts["reduce-scatter"] == reduce_scatter
    assert result["ok"]


def test_preset_sets_defaults_and_flags_override(example):
  args = example.parse_args(["--preset", "llama70b-8l", "--layers", "2"])
  assert (args.hidden, args.ffn, args.seq, args.heads) == (8192, 28672, 4096, 64)
  assert args.activation == "swiglu" and args.dtype == "bfloat16"
  assert args.layers == 2  # the explicit flag wins over the preset
  assert example.parse_args([]).hidden == 128  # no preset: the small defaults


def test_lr_warmup_starts_from_zero(example):
  """--lr-warmup N ramps the learning rate up from 0, so the first update changes nothing: step
  1's loss is that of the initial parameters (a run with --lr 0), unlike a run without warm-up."""
  _require_devices(8)
  base = SMALL + ["--tp", "8", "--steps", "2", "--no-compare"]
  warm = example.main(base + ["--lr-warmup", "5"])["losses"]
  frozen = example.main(base + ["--lr", "0"])["losses"]
  moved = example.main(base)["losses"]
  assert warm[1] == pytest.approx(frozen[1], rel=1e-6)
  assert abs(moved[1] - frozen[1]) > 1e-3 * abs(frozen[1])
  with pytest.raises(SystemExit):
    example.parse_args(["--lr-warmup", "-1"])


def test_out_writes_a_json_record(example, tmp_path):
  import json

  _require_devices(8)
  path = tmp_path / "run.json"
  result = example.main(SMALL + ["--tp", "8", "--steps", "3", "--no-compare", "--out", str(path)])
  record = json.loads(path.read_text())
  assert record["command"].startswith("python examples/train_tp_transformer.py --steps 10")
  assert record["command"].endswith(f"--out {path}")
  assert record["machine"]["device_count"] == 8 and "jax" in record["versions"]
  assert record["losses"] == pytest.approx(result["losses"], rel=1e-6)
  assert len(record["step_ms"]) == 3


def test_profile_traces_one_step_and_the_summary_reads_it(example, tmp_path):
  """--profile writes a jax.profiler trace of the first step after the warm-up; the summary
  script reads the newest one (on CPU it finds no GPU events and says so)."""
  _require_devices(8)
  example.main(SMALL + ["--tp", "8", "--steps", "3", "--no-compare", "--profile", str(tmp_path)])
  assert list(tmp_path.rglob("*.trace.json.gz")), list(tmp_path.rglob("*"))
  summary = load_script(EXAMPLE.parents[1] / "benchmarks" / "profile_summary.py",
                        "profile_summary")
  assert summary.main([str(tmp_path)]) == {}
