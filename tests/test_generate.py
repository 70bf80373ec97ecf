"""The generation example, examples/generate.py: greedy decoding with a KV cache from the
training example's model, its tensor-parallel layers jaxflux.Dense without sequence parallelism.
Checked: it generates the same tokens as the same model on flax.linen.Dense (exactly, on CPU in
float32), for a batch of one too; its cached decode gives the logits of the training example's
model run on the whole sequence without a cache (an independent check of the cache); its
distances to the float32 reference (in bfloat16 and with --fp8, whose calibrated FP8 variables
are those of Flax's own recipe); the timings and the JSON record; that it runs as a script and
uses jaxflux's public API only. The GPU test runs it on the GPUs.
"""
import argparse
import ast
import collections
import json
import math
import os
import pathlib
import subprocess
import sys

import flax.linen as nn
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


# Every program of the example takes its params, variables and prompts as arguments: a capture
# would lower them into the program as constants (10 GB at the llama70b-8l preset on a GPU).
pytestmark = pytest.mark.filterwarnings("error:A large amount of constants were captured")


@pytest.fixture(autouse=True)
def fail_on_captured_constants():
  before = jax.config.jax_captured_constants_warn_bytes
  jax.config.update("jax_captured_constants_warn_bytes", 1024)
  try:
    yield
  finally:
    jax.config.update("jax_captured_constants_warn_bytes", before)


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
  with jax.set_mesh(mesh), nn.logical_axis_rules(train.MOE_RULES):
    model = train.build_model(args, train.flax_dense)
    inputs, _ = train.device_batch(sequences, mesh)  # all but the last token
    logits = jax.jit(model.apply)({"params": result["params"]}, inputs)
  return np.asarray(logits, np.float32)[:, args.prompt_len - 1:]


@pytest.mark.parametrize("extra, dp, tp", [
    (["--tp", "8"], 1, 8),
    (["--tp", "4", "--activation", "swiglu"], 2, 4),
    (["--tp", "4", "--moe", "4,2"], 2, 4),
], ids=["tp8", "dp2-tp4-swiglu", "dp2-tp4-moe"])
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

  # In float32 the flax.linen.Dense run is the reference: its distance is 0, jaxflux's ~0.
  vs = result["vs_float32"]
  assert set(vs) == {"reference", "logit_scale", "jaxflux", "flax"}, vs
  assert "float32_reference" not in result and result["float32_tokens"] == result["flax_tokens"]
  assert vs["flax"] == {"max_abs_logit_diff": 0.0, "rel_logit_diff": 0.0,
                        "leading_tokens_agree": 5, "mean_leading_tokens_agree": 5.0}
  assert vs["jaxflux"]["rel_logit_diff"] <= 1e-6 and vs["jaxflux"]["leading_tokens_agree"] == 5
  assert vs["logit_scale"] == pytest.approx(np.abs(result["flax_logits"][:, 0]).max())

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
    assert len(run["prefill_ms_rounds"]) == gen.PREFILL_ROUNDS
    assert run["prefill_ms"] == pytest.approx(float(np.median(run["prefill_ms_rounds"])))
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
  assert record["vs_float32"] == vs


class RecordedGeneration:
  """A stand-in for generate.Generation that logs each call and takes the seconds it is told."""

  def __init__(self, name, log, steps, seconds):
    self.name, self.log, self.seconds = name, log, seconds
    self.positions = list(range(steps))
    self.prefill_s, self.step_s = [], []

  def prefill(self):
    self.log.append((self.name, "prefill"))
    return self.seconds

  def step(self, i):
    self.log.append((self.name, i))
    return self.seconds + i

  def profile(self, steps):
    self.log.append((self.name, "profile"))
    return {"steps": steps}

  def result(self, profile=None):
    return dict(prefill_s=self.prefill_s, step_s=self.step_s, profile=profile)


def test_models_take_turns_in_every_timed_round(gen):
  """generate(): one untimed prefill of each model, then every timed round (PREFILL_ROUNDS
  prefills, one per decode step) runs each model once, the first turn moving on each round, so
  none is always timed first or always right after the same other; profiles come last. Each
  model's timings are its own calls' seconds."""
  names, steps, rounds = ("a", "b", "c"), 6, gen.PREFILL_ROUNDS
  log = []
  models = {n: RecordedGeneration(n, log, steps, seconds=10 * k) for k, n in enumerate(names)}
  results = gen.generate(models, profile_steps=2)

  assert log[:3] == [(n, "prefill") for n in names]  # untimed, in any order
  timed = log[3:3 + 3 * (rounds + steps)]
  turns = [timed[3 * r:3 * r + 3] for r in range(rounds + steps)]
  for r, turn in enumerate(turns):
    event = "prefill" if r < rounds else r - rounds
    assert sorted(turn) == [(n, event) for n in names], turn
  orders = [tuple(n for n, _ in turn) for turn in turns]
  assert len({o[0] for o in orders[:rounds]}) == min(rounds, 3), orders  # prefill rounds
  assert {o[0] for o in orders[rounds:]} == set(names), orders  # decode steps
  # Over the decode steps every model runs right after each of the others equally often.
  followers = collections.Counter((o[i], o[i + 1]) for o in orders[rounds:] for i in range(2))
  assert len(followers) == 6 and set(followers.values()) == {2}, orders
  assert sorted(log[3 + 3 * (rounds + steps):]) == [(n, "profile") for n in names]

  for k, n in enumerate(names):
    assert results[n]["prefill_s"] == [10 * k] * rounds
    assert results[n]["step_s"] == [10 * k + i for i in range(steps)]
    assert results[n]["profile"] == {"steps": 2}


@pytest.mark.slow
def test_generates_a_batch_of_one(gen):
  """--batch 1 (dp = 1): the decode step's [1] -> [1, 1] tokens keep the batch's dp sharding,
  so the KV cache update types check; same tokens as flax.linen.Dense and as without a cache."""
  _require_devices(8)
  argv = TINY + ["--batch", "1", "--tp", "8", "--activation", "swiglu"]
  result = gen.main(argv)
  assert (result["dp"], result["tp"]) == (1, 8)
  tokens = np.asarray(result["tokens"])
  assert tokens.shape == (1, 5) and result["ok"] and result["match"]["tokens_match"]
  assert result["vs_float32"]["jaxflux"]["leading_tokens_agree"] == 5
  want = no_cache_logits(gen, argv, result)
  np.testing.assert_allclose(result["logits"], want, rtol=1e-5,
                             atol=1e-5 * np.abs(want).max())
  np.testing.assert_array_equal(tokens, want.argmax(-1))


ONE_DEVICE = """
import sys
import jax
jax.config.update("jax_num_cpu_devices", 1)
sys.path.insert(0, sys.argv[1])
import generate
result = generate.main(sys.argv[2:])
assert (result["dp"], result["tp"]) == (1, 1) and result["ok"], result
print("tokens", result["tokens"])
"""


def test_a_batch_of_one_on_one_device():
  """A one-device mesh (dp = tp = 1), what users of one GPU run: the decode step is lowered
  from the prefill's token type, so a batch of one keeps its dp sharding (slicing the prompts
  drops it in jax >= 0.11, and the cache update then refused two layouts)."""
  argv = TINY + ["--batch", "1", "--dtype", "bfloat16"]
  proc = subprocess.run([sys.executable, "-c", ONE_DEVICE, str(EXAMPLE.parent), *argv],
                        capture_output=True, text=True, timeout=300,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "tokens [[" in proc.stdout, proc.stdout


def leading_agreement(tokens, ref) -> np.ndarray:
  """Per sequence, the number of leading new tokens equal to the reference's."""
  tokens, ref = np.asarray(tokens), np.asarray(ref)
  return np.array([next((i for i in range(len(t)) if t[i] != r[i]), len(t))
                   for t, r in zip(tokens, ref)])


def check_distance(d: dict, logits, tokens, result) -> None:
  """A run's distance to float32, recomputed from the returned logits and tokens."""
  ref = result["float32_logits"]
  diff = np.abs(logits[:, 0] - ref[:, 0]).max()
  assert d["max_abs_logit_diff"] == pytest.approx(diff)
  assert d["rel_logit_diff"] == pytest.approx(diff / np.abs(ref[:, 0]).max())
  agree = leading_agreement(tokens, result["float32_tokens"])
  assert d["leading_tokens_agree"] == agree.min()
  assert d["mean_leading_tokens_agree"] == pytest.approx(agree.mean())
  assert all(math.isfinite(v) for v in d.values()), d


@pytest.mark.slow
def test_reports_the_distance_to_float32_in_bfloat16(gen, capsys, tmp_path):
  """bfloat16: each model's distance to the float32 flax.linen.Dense run on the same params. The
  reference is that run (the example's float32 tokens and logits); both models are near it (a
  bfloat16 rounding, not more) but not on it; jaxflux no further than Flax by much."""
  _require_devices(8)
  argv = TINY + ["--tp", "4"]
  result = gen.main(argv + ["--dtype", "bfloat16", "--out", str(tmp_path / "run.json")])
  out = capsys.readouterr().out
  assert result["ok"] and not result["exact_match_required"]
  vs = result["vs_float32"]
  assert set(vs) == {"reference", "logit_scale", "jaxflux", "flax"}, vs
  assert vs["reference"] == "flax.linen.Dense, float32"
  check_distance(vs["jaxflux"], result["logits"], result["tokens"], result)
  check_distance(vs["flax"], result["flax_logits"], result["flax_tokens"], result)
  for name in ("jaxflux", "flax"):
    assert 1e-4 < vs[name]["rel_logit_diff"] < 3e-2, vs
    assert 0 <= vs[name]["leading_tokens_agree"] <= vs[name]["mean_leading_tokens_agree"] <= 5
  assert vs["jaxflux"]["rel_logit_diff"] <= 2 * vs["flax"]["rel_logit_diff"], vs

  # The reference is the float32 run: the same tokens and logits as the example in float32.
  f32 = gen.main(argv)
  assert result["float32_tokens"] == f32["flax_tokens"]
  np.testing.assert_array_equal(result["float32_logits"], f32["flax_logits"])
  assert result["float32_reference"]["tokens_per_s"] > 0

  assert "distance to float32 (flax.linen.Dense in float32, same params" in out, out
  for label in ("jaxflux.Dense, bfloat16", "flax.linen.Dense, bfloat16"):
    assert f"  {label} " in out, out
  assert "DIFFER" not in out, out
  record = json.loads((tmp_path / "run.json").read_text())
  assert record["vs_float32"] == vs and record["float32_tokens"] == result["float32_tokens"]


def fp8_meta(tree) -> dict:
  """{(layer path): {variable: value}} of the FP8 recipe's variables."""
  flat = jax.tree_util.tree_flatten_with_path(tree["_overwrite_with_gradient"])[0]
  out: dict = {}
  for path, value in flat:
    keys = tuple(k.key for k in path)
    out.setdefault(keys[:-1], {})[keys[-1]] = np.asarray(value)
  return out


@pytest.mark.slow
def test_fp8(gen, capsys):
  """--fp8: both models run Flax's FP8 recipe from calibrated variables (every forward tensor's
  amax recorded, as Flax's own recipe records it); generation works; FP8 moves the logits
  further from float32 than bfloat16 alone does, but not far; the decode speed is reported
  next to bfloat16's."""
  from jax.sharding import AxisType

  _require_devices(8)
  argv = TINY + ["--tp", "4", "--dtype", "bfloat16", "--fp8"]
  result = gen.main(argv)
  out = capsys.readouterr().out
  tokens = np.asarray(result["tokens"])
  assert tokens.shape == (4, 5) and tokens.min() >= 0 and tokens.max() < 64
  assert result["ok"] and not result["exact_match_required"]

  vs = result["vs_float32"]
  assert set(vs) == {"reference", "logit_scale", "jaxflux", "flax", "jaxflux_no_fp8"}, vs
  check_distance(vs["jaxflux"], result["logits"], result["tokens"], result)
  check_distance(vs["flax"], result["flax_logits"], result["flax_tokens"], result)
  bf16 = vs["jaxflux_no_fp8"]["rel_logit_diff"]
  for name in ("jaxflux", "flax"):
    assert 2 * bf16 < vs[name]["rel_logit_diff"] < 0.2, vs  # e4m3: 3 mantissa bits
  # Same recipe, same variables: the two FP8 models' prefill logits stay close.
  first = np.abs(result["logits"][:, 0] - result["flax_logits"][:, 0]).max()
  assert first <= 0.1 * vs["logit_scale"], first
  assert result["jaxflux_no_fp8"]["tokens_per_s"] > 0 and result["jaxflux"]["tokens_per_s"] > 0
  assert "jaxflux.Dense, bfloat16 + FP8 " in out and "flax.linen.Dense, bfloat16 + FP8 " in out
  assert "decode, jaxflux.Dense: FP8 " in out and "bfloat16 without FP8 " in out, out

  # The calibrated variables: one per projection (the LM head has none), each forward tensor's
  # amax in its history's first slot, as Flax's own recipe records it (run on a dp Auto mesh:
  # its FP8 backward refuses the Explicit one).
  ours = fp8_meta(result["fp8_variables"])
  assert {k[:-1] for k in ours} == {("block0", "attn", "qkv"), ("block0", "attn", "out"),
                                    ("block0", "mlp", "fc1"), ("block0", "mlp", "fc2")}, ours
  for meta in ours.values():
    for name in ("input", "kernel"):
      history = meta[f"{name}_amax_history"]
      assert history[0] > 0 and not history[1:].any(), history[:4]
      assert meta[f"{name}_scale"] == 1  # delayed: the next pass scales by the history
  args = gen.parse_args(argv)
  mesh = gen.train.make_mesh(args.tp, AxisType.Auto)
  with jax.set_mesh(mesh):
    model = gen.build_decoder(args, gen.train.with_fp8(gen.train.flax_dense))
    prompts = jax.device_put(result["prompts"], jax.NamedSharding(mesh, jax.P("dp", None)))
    cache = gen.empty_cache(args, mesh, args.prompt_len)
    params = jax.device_put(result["params"], jax.NamedSharding(mesh, jax.P()))

    def logit_sum(fp8, params, prompts, cache):
      logits, _ = model.apply({"params": params, **fp8}, prompts, cache, 0)
      return logits.astype(np.float32).sum()

    init = jax.jit(lambda prompts, cache: {
        k: v for k, v in model.init(jax.random.key(0), prompts, cache, 0).items()
        if k != "params"})(prompts, cache)
    theirs = fp8_meta(jax.jit(jax.grad(logit_sum))(init, params, prompts, cache))
  assert ours.keys() == theirs.keys()
  for key, meta in ours.items():
    for name in ("input_amax_history", "kernel_amax_history", "input_scale", "kernel_scale"):
      np.testing.assert_allclose(meta[name], theirs[key][name], rtol=2e-2, err_msg=str(key))


# Two GPUs' planes as the profiler writes them (times in ps): GEMM kernels (cuBLAS's nvjet,
# a CUTLASS kernel) and others on two streams whose spans overlap, a derived line that repeats
# the streams' time, and the host's plane; every figure below is worked out by hand from them.
_XSPACE = """
planes { id: 1 name: "/device:GPU:0"
  lines { id: 1 name: "Stream #7(Compute)"
    events { metadata_id: 1 offset_ps: 0 duration_ps: 4000000 }
    events { metadata_id: 3 offset_ps: 5000000 duration_ps: 1000000 }
    events { metadata_id: 2 offset_ps: 10000000 duration_ps: 3000000 } }
  lines { id: 2 name: "Stream #9(MemcpyD2D)"
    events { metadata_id: 4 offset_ps: 2000000 duration_ps: 4000000 } }
  lines { id: 3 name: "XLA Ops"
    events { metadata_id: 5 offset_ps: 0 duration_ps: 13000000 } }
  event_metadata { key: 1 value { id: 1 name: "nvjet_tst_64x8_64x16_4x1_v_bz_TNT" } }
  event_metadata { key: 2 value { id: 2 name: "void cutlass::device_kernel<GemmKernel>(Params)" } }
  event_metadata { key: 3 value { id: 3 name: "loop_add_fusion" } }
  event_metadata { key: 4 value { id: 4 name: "MemcpyD2D" } }
  event_metadata { key: 5 value { id: 5 name: "dot.1" } } }
planes { id: 2 name: "/device:GPU:1"
  lines { id: 1 name: "Stream #7(Compute)"
    events { metadata_id: 1 offset_ps: 0 duration_ps: 2000000 } }
  event_metadata { key: 1 value { id: 1 name: "nvjet_tst_64x8_64x16_4x1_v_bz_TNT" } } }
planes { id: 3 name: "/host:CPU"
  lines { id: 1 name: "python"
    events { metadata_id: 1 offset_ps: 0 duration_ps: 90000000 } }
  event_metadata { key: 1 value { id: 1 name: "sgemm_on_the_host_is_not_counted" } } }
"""


def test_kernel_profile_splits_gpu_time_per_step():
  """--profile's reader: per step (2 here) and per GPU (mean of two), the GEMM kernels' time and
  count, the other kernels' and copies', the time any stream was busy (overlaps counted once),
  the longest kernels; derived lines and the host's plane left out."""
  sys.path.insert(0, str(EXAMPLE.parent))
  try:
    kernel_profile = load_script(EXAMPLE.parent / "kernel_profile.py", "kernel_profile")
  finally:
    sys.path.remove(str(EXAMPLE.parent))
  data = jax.profiler.ProfileData.from_text_proto(_XSPACE)
  b = kernel_profile.breakdown(data, steps=2)
  # GPU 0: GEMMs 4 + 3 us in 2 calls, others 1 + 4 us in 2, busy [0, 6) + [10, 13) = 9 us;
  # GPU 1: one 2 us GEMM, busy 2 us. Mean over GPUs, per step (/ 2 / 2).
  assert b["steps"] == 2 and b["gpus"] == 2
  assert b["gemm_ms"] == pytest.approx((7 + 2) / 4 / 1e3)
  assert b["gemm_calls"] == pytest.approx(3 / 4)
  assert b["other_ms"] == pytest.approx(5 / 4 / 1e3)
  assert b["other_calls"] == pytest.approx(2 / 4)
  assert b["busy_ms"] == pytest.approx((9 + 2) / 4 / 1e3)
  assert b["lines"] == ["Stream #7(Compute)", "Stream #9(MemcpyD2D)"]
  names = [k[0] for k in b["top_kernels"]]
  assert names[0].startswith("nvjet") and names[1] == "MemcpyD2D" and len(names) == 4
  assert b["top_kernels"][0][1:] == pytest.approx([6 / 4 / 1e3, 2 / 4])
  assert kernel_profile.breakdown(jax.profiler.ProfileData.from_text_proto(
      'planes { id: 1 name: "/host:CPU" }'), steps=2) is None


@pytest.mark.slow  # two models generate: an example run, like the others of the slow tier
def test_profile_flag_runs_and_says_it_saw_no_gpu_kernels_on_cpu(gen, capsys):
  if jax.devices()[0].platform != "cpu":
    pytest.skip("the GPU test profiles on GPUs")
  argv = [a for a in TINY if a != "--quiet"] + ["--tp", "2", "--profile", "2"]
  result = gen.main(argv)
  out = capsys.readouterr().out
  assert result["ok"] and result["jaxflux"]["profile"] is None
  assert out.count("profile: no GPU kernels in it") == 2, out


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
    _, _, decode, _ = gen.compiled_steps(model, {"params": params}, prompts, cache)
  return decode.as_text()


@pytest.mark.slow
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
  assert "(default" not in entries["--fp8"] and "Not a weight-only" in entries["--fp8"]


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
    (["--profile", "-1"], "--profile -1 must be at least 0"),
    (["--heads", "6"], "--hidden 64 must be divisible by --heads 6: use a --heads that divides 64"),
    (["--impl", "fused"], "--impl fused needs --dtype bfloat16"),
    (["--fp8"], "--fp8 needs --dtype bfloat16, not float32: FP8 stands in for 16-bit matmuls"),
    (["--preset", "big"], "argument --preset: invalid choice: 'big'"),
    (["--moe", "4,5"], "argument --moe: TOP_K=5 must be from 1 to EXPERTS=4"),
    (["--moe", "4,2", "--dtype", "bfloat16", "--fp8"], "--moe and --fp8 together are not "
     "supported"),
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
    (["--batch", "1", "--tp", "4"],
     "--batch 1 must be divisible by dp=2 (devices / tp = 8 / 4): use a multiple of 2, or a "
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
  assert default.moe is None
  mixtral = gen.parse_args(["--preset", "mixtral-2l"])
  assert (mixtral.hidden, mixtral.ffn, mixtral.layers, mixtral.moe) == (4096, 14336, 2, (8, 2))
  assert mixtral.batch == 16 and mixtral.dtype == "bfloat16"


@pytest.mark.slow
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
