"""The generation example, examples/generate.py: greedy decoding with a KV cache from the
training example's model, its tensor-parallel layers jaxflux.Dense without sequence parallelism.
Checked: it generates the same tokens as the same model on flax.linen.Dense (exactly, on CPU in
float32); its cached decode gives the logits of the training example's model run on the whole
sequence without a cache (an independent check of the cache); the timings and the JSON record;
that it runs as a script and uses jaxflux's public API only. The GPU test runs it on the GPUs.
"""
import argparse
import ast
import json
import math
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

import jaxflux

from conftest import load_script
from test_example import check_help, expect_usage_error, flag_cases

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "generate.py"

# Small enough for a 2-core CPU; heads and ffn divide by tp=8, and prompt + new tokens - 1 (the
# no-cache reference's sequence, sharded over tokens) by tp too.
TINY = ["--batch", "4", "--prompt-len", "12", "--new-tokens", "5", "--hidden", "64",
        "--heads", "8", "--layers", "1", "--ffn", "128", "--vocab", "64", "--quiet"]


@pytest.fixture(scope="module")
def gen():
  # Run as a script, its folder is on sys.path: it imports the training example from there.
  sys.path.insert(0, str(EXAMPLE.parent))
  try:
    yield load_script(EXAMPLE, "generate")
  finally:
    sys.path.remove(str(EXAMPLE.parent))


def _require_devices(n):
  if len(jax.devices()) < n:
    pytest.skip(f"needs {n} devices, found {len(jax.devices())}")


def no_cache_logits(gen, argv, result) -> np.ndarray:
  """The training example's model (flax.linen.Dense, no cache) on prompt + generated tokens:
  its logits at the positions that produced each new token, [B, new_tokens, V]."""
  train = gen.train
  args = gen.parse_args(argv)
  mesh = train.make_mesh(args.tp)
  sequences = np.concatenate([result["prompts"], np.asarray(result["tokens"])], axis=1)
  with jax.set_mesh(mesh):
    model = train.build_model(args, train.flax_dense)
    inputs, _ = train.device_batch(sequences, mesh)  # all but the last token
    logits = jax.jit(model.apply)({"params": result["params"]}, inputs)
  return np.asarray(logits, np.float32)[:, args.prompt_len - 1:]


@pytest.mark.parametrize("extra, dp, tp", [
    (["--tp", "8"], 1, 8),
    (["--tp", "4", "--activation", "swiglu"], 2, 4),
], ids=["tp8", "dp2-tp4-swiglu"])
def test_generates_as_flax_and_as_without_cache(gen, tmp_path, extra, dp, tp):
  _require_devices(8)
  argv = TINY + extra + ["--out", str(tmp_path / "run.json")]
  result = gen.main(argv)
  assert (result["dp"], result["tp"]) == (dp, tp)

  # (a) jaxflux.Dense and (b) flax.linen.Dense, same params: the same tokens, on CPU exactly.
  tokens = np.asarray(result["tokens"])
  assert tokens.shape == (4, 5) and tokens.min() >= 0 and tokens.max() < 64
  assert len(np.unique(tokens)) > 1, tokens  # not a degenerate run
  assert result["match"] == {"tokens_match": True, "first_diff_step": None,
                             "max_logit_diff": result["match"]["max_logit_diff"]}
  assert result["flax_tokens"] == result["tokens"]
  assert result["match"]["max_logit_diff"] <= 1e-5
  assert result["exact_match_required"] and result["ok"]

  # The cache: every step's logits are those of the whole sequence run without one.
  want = no_cache_logits(gen, argv, result)
  np.testing.assert_allclose(result["logits"], want, rtol=1e-5,
                             atol=1e-5 * np.abs(want).max())
  np.testing.assert_array_equal(tokens, want.argmax(-1))

  # Timings: new_tokens - 1 decode steps after the prefill; nothing compiles in them.
  for run in (result["jaxflux"], result["flax"]):
    assert len(run["step_ms"]) == 4 and min(run["step_ms"]) > 0
    assert run["tokens_per_s"] == pytest.approx(4 / run["step_ms_median"] * 1e3)
    assert run["prefill_ms"] > 0 and run["prefill_tokens_per_s"] > 0
    assert set(run["compile_s"]) == {"prefill", "decode_step"}
    assert all(s > 0 for s in run["compile_s"].values())

  record = json.loads((tmp_path / "run.json").read_text())
  assert record["command"].startswith("python examples/generate.py --batch 4")
  assert record["date"] and record["machine"]["device_count"] == 8
  assert {"jax", "jaxlib", "flax", "python"} <= set(record["versions"])
  assert record["config"]["prompt_len"] == 12 and record["config"]["new_tokens"] == 5
  assert (record["dp"], record["tp"]) == (dp, tp)
  assert record["match"] == result["match"] and record["ok"] is True
  assert record["tokens"] == result["tokens"]
  assert record["jaxflux"]["step_ms_median"] == result["jaxflux"]["step_ms_median"]


def test_decoder_has_the_training_models_params(gen):
  """Same param tree, shapes and partitioning as the training example's model, so its params
  (and a checkpoint of them) load as they are."""
  import flax.linen as nn
  import jax.numpy as jnp

  _require_devices(8)
  train = gen.train
  args = gen.parse_args(TINY + ["--tp", "8", "--activation", "swiglu"])
  mesh = train.make_mesh(8)
  with jax.set_mesh(mesh):
    cache = gen.empty_cache(args, mesh, 4)
    prompts = jax.device_put(np.zeros((args.batch, 1), np.int32),
                             jax.sharding.NamedSharding(mesh, jax.P("dp", None)))
    ours = jax.eval_shape(gen.build_decoder(args, gen.jaxflux_dense("xla")).init,
                          jax.random.key(0), prompts, cache, 0)["params"]
    theirs = jax.eval_shape(train.build_model(
        argparse.Namespace(**{**vars(args), "seq": 8}), train.jaxflux_dense("xla")).init,
        jax.random.key(0), jnp.zeros((args.batch, 8), jnp.int32))["params"]
  shapes = lambda tree: jax.tree.map(lambda x: x.shape, nn.unbox(tree))
  assert shapes(ours) == shapes(theirs)
  assert nn.get_partition_spec(ours) == nn.get_partition_spec(theirs)


def decode_hlo(gen, argv) -> str:
  """The optimized HLO of the example's compiled decode step (jaxflux.Dense) for these flags."""
  args = gen.parse_args(argv)
  mesh = gen.train.make_mesh(args.tp)
  with jax.set_mesh(mesh):
    params = gen.init_params(args, mesh)
    cache = gen.empty_cache(args, mesh, args.prompt_len + args.new_tokens)
    prompts = jax.device_put(np.zeros((args.batch, args.prompt_len), np.int32),
                             jax.sharding.NamedSharding(mesh, jax.P("dp", None)))
    model = gen.build_decoder(args, gen.jaxflux_dense(args.impl))
    _, _, decode, _ = gen.compiled_steps(model, params, prompts, cache)
  return decode.as_text()


def test_decode_step_collectives(gen):
  """Tensor parallelism without sequence parallelism: a decode step's only collectives are the
  row layers' all-reduces, two per layer (attention-out, MLP-fc2); the column layers multiply
  locally and the KV cache, sharded over heads, is never gathered. On CPU impl='auto' is the
  XLA path: no custom calls."""
  from hlo_util import count_collectives, custom_call_targets

  _require_devices(8)
  layers = 2
  hlo = decode_hlo(gen, TINY + ["--tp", "4", "--layers", str(layers)])  # dp=2: batch split
  assert count_collectives(hlo) == {"all-reduce": 2 * layers}, count_collectives(hlo)
  assert custom_call_targets(hlo) == {}, custom_call_targets(hlo)


@pytest.mark.parametrize("preset", [None, "llama70b-8l"])
def test_help(gen, capsys, preset):
  """--help names every flag with its help and its default once: the preset's values (the
  small one's without --preset), not None."""
  argv = (["--preset", preset] if preset else []) + ["--help"]
  with pytest.raises(SystemExit) as exit_:
    gen.parse_args(argv)
  assert exit_.value.code == 0
  entries = check_help(capsys.readouterr().out)
  assert entries["--hidden HIDDEN"].endswith(f"(default: {8192 if preset else 128})"), entries
  assert entries["--new-tokens NEW_TOKENS"].endswith(f"(default: {64 if preset else 32})")
  assert entries["--tp TP"].endswith("(default: all devices)"), entries


@pytest.mark.parametrize("extra, message", flag_cases(
    (["--batch", "0"], "--batch 0 must be at least 1"),
    (["--prompt-len", "0"], "--prompt-len 0 must be at least 1"),
    (["--new-tokens", "1"], "--new-tokens 1 must be at least 2: the first new token comes from "
     "the prefill"),
    (["--hidden", "0"], "--hidden 0 must be at least 1"),
    (["--heads", "0"], "--heads 0 must be at least 1"),
    (["--layers", "0"], "--layers 0 must be at least 1"),
    (["--ffn", "0"], "--ffn 0 must be at least 1"),
    (["--vocab", "0"], "--vocab 0 must be at least 1"),
    (["--tp", "0"], "--tp 0 must be at least 1"),
    (["--seed", "-1"], "--seed -1 must be at least 0"),
    (["--heads", "6"], "--hidden 64 must be divisible by --heads 6: use a --heads that divides 64"),
    (["--impl", "fused"], "--impl fused needs --dtype bfloat16"),
    (["--preset", "big"], "argument --preset: invalid choice: 'big'"),
))
def test_rejects_bad_flags(gen, capsys, extra, message):
  expect_usage_error(capsys, lambda: gen.main(TINY + extra), message)


@pytest.mark.parametrize("extra, message", flag_cases(
    (["--tp", "3"], "--tp 3 must divide the number of devices (8): use one of 1, 2, 4, 8"),
    (["--heads", "6", "--hidden", "48", "--tp", "8"],
     "--heads 6 must be divisible by tp=8: use a multiple of 8, or a --tp that divides both 6 "
     "and 8"),
    (["--heads", "4"], "--heads 4 must be divisible by tp=8 (all devices, the default --tp)"),
    (["--ffn", "100", "--tp", "8"], "--ffn 100 must be divisible by tp=8"),
    (["--batch", "3", "--tp", "4"],
     "--batch 3 must be divisible by dp=2 (devices / tp = 8 / 4): use a multiple of 2, or a "
     "larger --tp"),
))
def test_rejects_layouts_the_devices_cannot_run(gen, capsys, extra, message):
  if len(jax.devices()) != 8:
    pytest.skip(f"the messages name 8 devices, found {len(jax.devices())}")
  expect_usage_error(capsys, lambda: gen.main(TINY + extra), message)


def test_rejects_impl_fused_where_no_fused_kernel_runs(gen, capsys):
  if jaxflux.has_cuda():
    pytest.skip("the fused kernels run here")
  _require_devices(8)
  expect_usage_error(capsys, lambda: gen.main(TINY + ["--tp", "8", "--impl", "fused",
                                                      "--dtype", "bfloat16"]),
                     "--impl fused: ")


def test_presets(gen):
  args = gen.parse_args(["--preset", "llama70b-8l", "--layers", "2"])
  assert (args.hidden, args.heads, args.ffn, args.vocab) == (8192, 64, 28672, 32768)
  assert args.activation == "swiglu" and args.dtype == "bfloat16" and args.layers == 2
  default = gen.parse_args([])
  assert default.preset == "small" and default.hidden == 128 and default.dtype == "float32"


def test_runs_as_a_script():
  """From the repository root, as the README says: the script finds the training example."""
  proc = subprocess.run([sys.executable, "examples/generate.py", "--help"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert "--new-tokens" in proc.stdout and "--preset" in proc.stdout


def test_uses_the_public_api_only():
  tree = ast.parse(EXAMPLE.read_text())
  names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
  names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
  assert {n for n in names if n.split(".")[0] == "jaxflux"} == {"jaxflux"}
  used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
          and isinstance(n.value, ast.Name) and n.value.id == "jaxflux"}
  assert "Dense" in used and not any(a.startswith("_") for a in used), used


@pytest.mark.gpu
def test_generates_on_gpus(gen):
  """On the GPUs: float32 on the XLA path generates the same tokens as flax.linen.Dense; in
  bfloat16 with impl='fused' every row layer of a decode step is the fused GEMM+AllReduce (no
  XLA all-reduce left), and the first new token's logits (same inputs for both) stay close."""
  from hlo_util import count_collectives, custom_call_targets

  n = len(jax.devices("gpu")) if jaxflux.has_cuda() else 0
  if n < 2:
    pytest.skip("needs at least 2 GPUs and a CUDA build of jaxflux")
  layers = 2
  base = ["--tp", str(n), "--batch", "8", "--prompt-len", "128", "--new-tokens", "16",
          "--hidden", "512", "--heads", str(4 * n), "--ffn", str(512 * n), "--layers",
          str(layers), "--vocab", "1024", "--activation", "swiglu", "--quiet"]
  exact = gen.main(base + ["--dtype", "float32", "--impl", "xla"])
  assert exact["match"]["tokens_match"], exact["match"]

  fused = base + ["--dtype", "bfloat16", "--impl", "fused"]
  hlo = decode_hlo(gen, fused)
  targets = custom_call_targets(hlo)
  assert sum(v for k, v in targets.items() if k.startswith("jaxflux_matmul_all_reduce")) \
      == 2 * layers, targets
  assert count_collectives(hlo).get("all-reduce", 0) == 0, count_collectives(hlo)
  result = gen.main(fused)
  assert result["ok"] and math.isfinite(result["match"]["max_logit_diff"])
  first = np.abs(result["logits"][:, 0] - result["flax_logits"][:, 0]).max()
  assert first <= 5e-2 * np.abs(result["flax_logits"][:, 0]).max(), first
  assert result["jaxflux"]["tokens_per_s"] > 0
