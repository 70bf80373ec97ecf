"""The main job, examples/train_tp_transformer.py, run in-process on 8 virtual CPU devices.

Each case trains the small transformer built from jaxflux.Dense (or, with --mode, the
impl="xla" or windowed-einsum variant) for a few steps and then the same model built from
flax.linen.Dense; both must learn and their loss curves must match. Also checked: the step
times, the JSON record, the presets, the collectives of the compiled train step, and that the
example uses jaxflux's public API only.
"""

import ast
import math
import os
import pathlib
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


def train_step_hlo(example, argv) -> str:
  """The optimized HLO of the example's compiled train step for these flags (--mode jaxflux,
  with or without --fp8)."""
  import jax

  args = example.parse_args(argv)
  mesh = example.make_mesh(args.tp)
  dense = example.jaxflux_dense(args.impl)
  with jax.set_mesh(mesh):
    model, params, shardings = example.prepare(
        args, mesh, example.with_fp8(dense) if args.fp8 else dense, example.param_specs(args))
    fp8 = example.fp8_variables(args, model) if args.fp8 else {}
    tx = example.optimizer(args)
    step, opt_state = example.train_state(model, tx, params, shardings, mesh)
    batch = example.synthetic_batch(args.seed, 0, args.batch, args.seq, args.vocab)
    return step.lower(params, opt_state, fp8,
                      *example.device_batch(batch, mesh)).compile().as_text()


@pytest.mark.parametrize(
    "extra, dp, tp",
    [
        # 9 s each on 2 cores: the README's test command keeps the dp x tp one
        pytest.param(["--tp", "8"], 1, 8, marks=pytest.mark.slow),
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
  # Timing: compiled before step 0, then the steps after the first run.
  assert result["timed_steps"] == 9 and len(result["step_ms"]) == 10
  assert result["step_ms_median"] > 0 and result["tokens_per_s"] > 0
  assert result["compile_s"] > 0 and result["flax_compile_s"] > 0
  # On CPU the compiled step has no fused-kernel custom calls: the XLA path.
  assert result["fused_calls"] == {}


@pytest.mark.slow
def test_fp8_matches_flax_fp8_and_tracks_the_run_without(example, capsys):
  """--fp8: Flax's FP8 recipe through jaxflux.Dense on the four tensor-parallel projections,
  on dp x tp with an Explicit dp axis. flax.linen.Dense with the same recipe follows the same
  curve (the same FP8 variable updates; params that part by rounding may flip an FP8 rounding,
  which AdamW turns into lr-sized updates, hence 2e-2); the run without FP8 differs by the
  quantization (so FP8 really ran) yet stays within 10%."""
  _require_devices(8)
  result = example.main(SMALL + ["--tp", "4", "--fp8", "--steps", "6"])
  out = capsys.readouterr().out
  ours, ref, base = result["jaxflux"], result["flax"], result["base"]
  assert len(ours) == len(ref) == len(base) == 6 and (result["dp"], result["tp"]) == (2, 4)
  assert result["rtol"] == 2e-2 and result["max_rel_diff"] <= 2e-2, (ours, ref)
  assert 0 < result["fp8_rel_diff"] <= 0.1, (ours, base)
  assert ours[-1] < ours[0] - 0.3 and result["ok"], ours
  assert "FP8 recipe on the tensor-parallel projections" in out, out
  assert "final losses: jaxflux+fp8 " in out and "[float32] compiled in" in out, out


def help_entries(text: str) -> dict:
  """--help output -> {option invocation: its help text, whitespace collapsed}. An entry starts
  at a line indented by two spaces and a dash; its help follows the invocation after two or
  more spaces or on the next lines."""
  import re

  options = text.split("\noptions:\n", 1)[1]
  entries = {}
  for entry in re.split(r"\n(?=  -)", options):
    invocation, *rest = re.split(r"\s{2,}", entry.strip(), maxsplit=1)
    entries[invocation] = " ".join(" ".join(rest).split())
  return entries


def check_help(text: str) -> dict:
  """Every option has help, names its default at most once and never as None."""
  entries = help_entries(text)
  assert len(entries) > 10, text
  for invocation, help_ in entries.items():
    assert help_, f"{invocation} has no help text"
    assert help_.count("(default") <= 1, (invocation, help_)
    assert "(default: None)" not in help_, (invocation, help_)
  return entries


@pytest.mark.parametrize("preset", [None, "llama70b-8l"])
def test_help(example, capsys, preset):
  """--help names every flag with its help and, where it has one, its default once; with a
  preset the defaults shown are the preset's."""
  argv = (["--preset", preset] if preset else []) + ["--help"]
  with pytest.raises(SystemExit) as exit_:
    example.parse_args(argv)
  assert exit_.value.code == 0
  entries = check_help(capsys.readouterr().out)
  assert entries["--hidden HIDDEN"].endswith(f"(default: {8192 if preset else 128})"), entries
  assert entries["--tp TP"].endswith("(default: all devices)"), entries
  assert entries["--seed SEED"].endswith("(default: 0)"), entries
  assert "(default" not in entries["--fp8"], entries  # a switch: off unless given


def flag_cases(*cases) -> list:
  """(extra flags, expected message) pairs as parameters named by the flags."""
  return [pytest.param(extra, message, id=" ".join(extra)) for extra, message in cases]


def expect_usage_error(capsys, run, message: str) -> None:
  """run() exits as argparse does for a bad flag: status 2, and the last line of stderr is
  "<prog>: error: <message>" (after the usage), with no traceback."""
  with pytest.raises(SystemExit) as exit_:
    run()
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err, err
  assert err.startswith("usage: "), err
  last = err.strip().splitlines()[-1]
  assert ": error: " in last and last.split(": error: ", 1)[1].startswith(message), err


@pytest.mark.parametrize("extra, message", flag_cases(
    (["--steps", "0"], "--steps 0 must be at least 1"),
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    (["--batch", "0"], "--batch 0 must be at least 1"),
    (["--hidden", "0"], "--hidden 0 must be at least 1"),
    (["--heads", "0"], "--heads 0 must be at least 1"),
    (["--vocab", "0"], "--vocab 0 must be at least 1"),
    (["--tp", "0"], "--tp 0 must be at least 1"),
    (["--lr", "-1"], "--lr -1.0 must be at least 0"),
    (["--seed", "-1"], "--seed -1 must be at least 0"),
    (["--log-every", "-1"], "--log-every -1 must be at least 0"),
    (["--heads", "6"], "--hidden 64 must be divisible by --heads 6: use a --heads that divides 64"),
    (["--mode", "xla", "--impl", "fused"], "--impl fused applies to --mode jaxflux only"),
    (["--impl", "fused"], "--impl fused needs --dtype bfloat16"),
    (["--distributed", "1,2"], "--distributed '1,2': expected COORD,NUM,ID"),
    (["--distributed", "h:1,2,2"], "--distributed 'h:1,2,2': needs a coordinator host:port"),
    (["--local-device-ids", "0"], "--local-device-ids applies with --distributed only"),
    (["--preset", "big"], "argument --preset: invalid choice: 'big'"),
    (["--moe", "8"], "argument --moe: expected EXPERTS,TOP_K, e.g. 8,2; got '8'"),
    (["--moe", "4,5"], "argument --moe: TOP_K=5 must be from 1 to EXPERTS=4"),
    (["--moe", "4,2", "--fp8"], "--moe and --fp8 together are not supported"),
))
def test_rejects_bad_flags(example, capsys, extra, message):
  expect_usage_error(capsys, lambda: example.main(SMALL + extra), message)


@pytest.mark.parametrize("extra, message", flag_cases(
    (["--tp", "3"], "--tp 3 must divide the number of devices (8): use one of 1, 2, 4, 8"),
    (["--tp", "16"], "--tp 16 must divide the number of devices (8)"),
    (["--heads", "6", "--hidden", "48", "--tp", "8"],
     "--heads 6 must be divisible by tp=8: use a multiple of 8, or a --tp that divides both 6 "
     "and 8"),
    (["--heads", "4"], "--heads 4 must be divisible by tp=8 (all devices, the default --tp)"),
    (["--ffn", "100", "--tp", "8"], "--ffn 100 must be divisible by tp=8"),
    (["--seq", "12", "--tp", "8"], "--seq 12 must be divisible by tp=8"),
    (["--batch", "3", "--tp", "4"],
     "--batch 3 must be divisible by dp=2 (devices / tp = 8 / 4): use a multiple of 2, or a "
     "larger --tp"),
))
def test_rejects_layouts_the_devices_cannot_run(example, capsys, extra, message):
  """Checked against the device count (after jax.distributed would have started), before any
  compilation."""
  import jax

  if len(jax.devices()) != 8:
    pytest.skip(f"the messages name 8 devices, found {len(jax.devices())}")
  expect_usage_error(capsys, lambda: example.main(SMALL + extra), message)


def test_rejects_impl_fused_where_no_fused_kernel_runs(example, capsys):
  """--impl fused without the fused kernels (no CUDA build or GPU) is a bad flag here: a usage
  error with jaxflux's reason, not a traceback."""
  import jaxflux

  if jaxflux.has_cuda():
    pytest.skip("the fused kernels run here")
  _require_devices(8)
  expect_usage_error(capsys, lambda: example.main(SMALL + ["--tp", "8", "--impl", "fused",
                                                           "--dtype", "bfloat16"]),
                     "--impl fused: ")


@pytest.mark.parametrize("mode", ["xla", "windowed"])
@pytest.mark.slow
def test_modes_match_flax(example, mode):
  _require_devices(8)
  result = example.main(SMALL + ["--tp", "8", "--mode", mode, "--steps", "4"])

  assert result["mode"] == mode and result["ok"]
  ours, ref = result[mode], result["flax"]
  assert result["losses"] is ours and len(ours) == len(ref) == 4
  assert result["max_rel_diff"] <= 1e-4, (ours, ref)
  # Timing over steps 1 to 3; tokens/s from the median.
  assert len(result["step_ms"]) == 4 and result["timed_steps"] == 3
  assert 0 < min(result["step_ms"][1:]) <= result["step_ms_median"]
  tokens_per_step = 8 * 32
  assert result["tokens_per_s"] == pytest.approx(tokens_per_step / result["step_ms_median"] * 1e3)
  assert result["flax_step_ms_median"] > 0


@pytest.mark.slow
def test_output_names_the_path_and_keeps_compile_apart(example, capsys):
  """What a user reads: which path the matmuls took and why, the compile time on its own
  line, about ten progress lines per run instead of one per step, and the comparison."""
  _require_devices(8)
  argv = [a for a in SMALL if a != "--quiet"] + ["--tp", "8", "--steps", "20"]
  result = example.main(argv)
  out = capsys.readouterr().out
  assert "mode=jaxflux (impl=auto)" in out, out
  assert ("[jaxflux] compiled in " in out and "matmuls: XLA path (impl=auto: fused kernels "
          "need Hopper GPUs; this is cpu)" in out), out
  assert "[flax] compiled in " in out, out
  for label in ("jaxflux", "flax"):
    steps = [line for line in out.splitlines() if line.startswith(f"[{label}] step ")]
    # Every 2nd step (20 // 10) and the last: 0, 2, ..., 18, 19.
    assert [int(line.split()[2]) for line in steps] == [*range(0, 20, 2), 19], steps
  assert "median of 19 after the first" in out and f"compile {result['compile_s']:.2f} s" in out
  assert "MATCH" in out and "--out FILE.json writes the full loss curves" in out
  # Compilation is not in any step time: step 0 is a run like the others, not seconds longer.
  assert result["step_ms"][0] < 1e3 * result["compile_s"], (result["step_ms"], result["compile_s"])


@pytest.mark.slow
def test_log_every(example, capsys):
  _require_devices(8)
  argv = [a for a in SMALL if a != "--quiet"] + ["--tp", "8", "--steps", "5", "--no-compare",
                                                  "--log-every", "3"]
  example.main(argv)
  steps = [line.split()[2] for line in capsys.readouterr().out.splitlines()
           if line.startswith("[jaxflux] step ")]
  assert steps == ["0", "3", "4"], steps


@pytest.mark.slow
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


@pytest.mark.slow
def test_train_step_collectives(example):
  """Per layer, two column (qkv, fc1) and two row (out, fc2) layers: forward one all-gather
  per column and one reduce-scatter per row layer, backward the mirrored pair (the column
  layer's dX is a reduce-scatter, its dW reuses the forward's gathered input; the row layer's
  dX all-gathers the cotangent, reused for dW). Nothing else gathers or scatters: the
  optimizer state is sharded like the params, and the rest is token-local or an all-reduce
  (gradients of replicated params, the loss, the global gradient norm). On CPU impl="auto" is
  the XLA path, so no custom calls."""
  from hlo_util import count_collectives, custom_call_targets

  _require_devices(8)
  layers = 2
  hlo = train_step_hlo(example, SMALL + ["--tp", "8", "--layers", str(layers)])
  counts = count_collectives(hlo)
  assert counts.get("all-gather", 0) == 4 * layers, counts
  assert counts.get("reduce-scatter", 0) == 4 * layers, counts
  assert counts.get("all-reduce", 0) >= 1, counts
  assert custom_call_targets(hlo) == {}, custom_call_targets(hlo)


def test_preset_sets_defaults_and_flags_override(example):
  args = example.parse_args(["--preset", "llama70b-8l", "--layers", "2"])
  assert (args.hidden, args.ffn, args.seq, args.heads) == (8192, 28672, 4096, 64)
  assert args.activation == "swiglu" and args.dtype == "bfloat16" and args.lr_warmup == 50
  assert args.layers == 2  # the explicit flag wins over the preset
  default = example.parse_args([])
  assert default.hidden == 128 and default.lr_warmup == 0  # no preset: the small model


def test_moe_preset(example):
  args = example.parse_args(["--preset", "mixtral-2l"])
  assert args.moe == (8, 2) and (args.hidden, args.ffn, args.layers) == (4096, 14336, 2)
  assert example.parse_args(["--moe", "16,4"]).moe == (16, 4)


@pytest.mark.parametrize("tp, moe", [(1, "4,2"), (4, "4,2"), (2, "4,1")])
@pytest.mark.slow
def test_moe_trains_and_matches_the_ragged_dot_model(example, tp, moe):
  """--moe: routed expert MLPs (jaxflux.MoE, experts split over tp inside each expert) in
  both models; the reference runs them on lax.ragged_dot, and the curves agree. Top-1 too:
  its routing weight is the router probability, so the router learns from the task (weights of
  1 gave it only rounding noise, which the optimizer scaled into diverging steps)."""
  _require_devices(8)
  result = example.main(SMALL + ["--tp", str(tp), "--moe", moe, "--activation", "swiglu"])
  ours, ref = result["jaxflux"], result["flax"]
  assert sum(ours[-3:]) / 3 < sum(ours[:3]) / 3 - 0.3, ours
  assert result["max_rel_diff"] <= 1e-4 and result["ok"], (ours, ref)


@pytest.mark.slow
def test_preset_lr_warmup_starts_from_zero(example):
  """The preset ramps the learning rate up from 0, so the first update changes nothing: step
  1's loss is that of the initial parameters (a run with --lr 0), unlike a run without warm-up
  (the same model without the preset)."""
  _require_devices(8)
  base = SMALL + ["--tp", "8", "--steps", "2", "--no-compare", "--dtype", "float32",
                  "--activation", "swiglu", "--batch", "8", "--lr", "1e-2"]
  warm = example.main(["--preset", "llama70b-8l"] + base)["losses"]
  frozen = example.main(base + ["--lr", "0"])["losses"]
  moved = example.main(base)["losses"]
  assert warm[0] == pytest.approx(frozen[0], rel=1e-6)
  assert warm[1] == pytest.approx(frozen[1], rel=1e-6)
  assert abs(moved[1] - frozen[1]) > 1e-3 * abs(frozen[1])


@pytest.mark.slow
def test_out_writes_a_json_record(example, tmp_path, capsys):
  import json

  _require_devices(8)
  path = tmp_path / "run.json"
  result = example.main(SMALL + ["--tp", "8", "--steps", "3", "--no-compare", "--out", str(path)])
  out = capsys.readouterr().out  # --quiet: no step lines, the rest as usual
  assert "[jaxflux] step" not in out and "[jaxflux] compiled in" in out, out
  assert f"wrote {path}" in out, out
  record = json.loads(path.read_text())
  assert record["command"].startswith("python examples/train_tp_transformer.py --steps 10")
  assert record["command"].endswith(f"--out {path}")
  assert record["machine"]["device_count"] == 8 and "jax" in record["versions"]
  assert record["date"] and record["mode"] == "jaxflux"
  assert record["losses"] == pytest.approx(result["losses"], rel=1e-6)
  assert len(record["step_ms"]) == 3
  assert record["compile_s"] > 0 and record["fused_calls"] == {}


def test_uses_the_public_api_only():
  """The example imports jaxflux and nothing below it but the public jaxflux.nnx."""
  tree = ast.parse(EXAMPLE.read_text())
  names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
  names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
  ours = {n for n in names if n.split(".")[0] == "jaxflux"}
  assert ours <= {"jaxflux", "jaxflux.nnx"}, ours
  used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
          and isinstance(n.value, ast.Name) and n.value.id == "jaxflux"}
  assert used and not any(a.startswith("_") for a in used), used


LAUNCHER = EXAMPLE.parent / "launch_multiprocess.py"


def test_launcher_refuses_an_interpreter_without_jaxflux(monkeypatch, capsys):
  """Every process runs with the launcher's interpreter: one that can't import jax or jaxflux
  is refused up front, saying which Python to use, instead of N failing processes."""
  import importlib.util

  launcher = load_script(LAUNCHER, "launch_multiprocess")
  assert launcher.missing_modules() == []  # the test's interpreter has both
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "jax" else real(name, *a))
  monkeypatch.setattr(launcher, "launch", lambda *a, **k: pytest.fail("launched anyway"))
  with pytest.raises(SystemExit) as exit_:
    launcher.main(["-n", "2", "--platform", "cpu"])
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert f"{sys.executable} cannot import jax" in err and ".venv/bin/python examples/" in err


def test_readme_commands_use_the_venv_python():
  """The README's setup makes .venv without activating it: the example commands there and in
  examples/README.md name its interpreter, so they run as written from a fresh clone."""
  import re

  root = EXAMPLE.parents[1]
  for doc in (root / "README.md", root / "examples" / "README.md"):
    for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), flags=re.S):
      for line in block.splitlines():
        for script in ("train_tp_transformer.py", "launch_multiprocess.py"):
          if f"examples/{script}" in line:
            assert f".venv/bin/python examples/{script}" in line, (doc.name, line)
