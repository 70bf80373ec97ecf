"""Greedy generation with a KV cache from the training example's model, on tensor-parallel
jaxflux.Dense layers, checked against the same model built from flax.linen.Dense.

    python examples/generate.py                        # tp = all local devices
    python examples/generate.py --tp 4 --batch 16      # 2-way dp x 4-way tp on 8 devices
    python examples/generate.py --preset llama70b-8l   # Llama-70B layers, 8 of them (GPUs)
    python examples/generate.py --dtype bfloat16 --fp8 # Flax's FP8 recipe in both models
    python examples/generate.py --moe 8,2              # routed expert MLPs (top-2 of 8)
    python examples/generate.py --preset mixtral-2l    # Mixtral-8x7B layers, 2 of them (GPUs)

The model is train_tp_transformer.py's: the same layers and parameter tree, and its params come
from that example's init (so a trained checkpoint of it loads as is). Here it runs with a KV
cache: one prefill of a batch of prompts, then one decode step per new token, greedy. It runs
twice from the same params, (a) on jaxflux.Dense layers and (b) on flax.linen.Dense under XLA's
partitioner, and compares the generated tokens (exit status 1 if they differ on CPU in float32,
where they must be identical).

--moe EXPERTS,TOP_K routes every MLP to experts (jaxflux.MoE, as in the training example): the
jaxflux model runs them on the grouped GEMM, the flax.linen.Dense model on lax.ragged_dot.

In bfloat16 both models serve the params cast to bfloat16 once, as a server holds its weights
(the training example keeps float32 params: cast at every step, a decode step reads twice the
weight bytes, and the cast's output is one more pass for a custom call to wait on).

Each run is also measured against a float32 reference, the flax.linen.Dense model in float32 on
the same params (in a float32 run, the flax.linen.Dense run itself): the prefill's logits (the
one step where every run sees the same inputs) and the leading new tokens that agree. In
bfloat16 two correct models part after a few greedy steps, as their roundings differ; how far
each stays from float32 tells whether jaxflux's is as accurate as Flax's.

--fp8 puts Flax's FP8 training recipe (nn.Fp8DirectDotGeneralOp) on the tensor-parallel
projections of both models: weights and activations quantized to e4m3 per tensor with delayed
scaling (not a weight-only quantization), the scales from one calibration pass over the prompts.

Sharding (mesh ('dp', 'tp'), dp Explicit, tp Auto): tensor parallelism without sequence
parallelism. A decode step has one token per sequence, too few to shard, so the residual stream
[B, T, C] stays replicated over tp. QKV and MLP-fc1 are column-parallel with
sequence_parallel=False (replicated tokens in, features sharded out: no communication);
attention-out and MLP-fc2 are row-parallel with sequence_parallel=False (sharded features in,
the output all-reduced: jaxflux.matmul_all_reduce). The KV cache [B, S, heads, head_dim] is
sharded over heads like the QKV features that fill it, so attention is local to each device.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import shlex
import sys
import time
from typing import Any, Callable, Sequence

import jax

if __name__ == "__main__" and os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
  # Before any JAX backend starts: 8 virtual CPU devices (no effect on the GPU client).
  jax.config.update("jax_num_cpu_devices", 8)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxflux  # noqa: E402
# The training example's model code and the profile's reader (the script's folder is on
# sys.path when run as a script).
import kernel_profile  # noqa: E402
import train_tp_transformer as train  # noqa: E402

Cache = list  # per layer, (keys, values), each [batch, max_len, heads, head_dim]


def jaxflux_dense(impl: str) -> Callable[..., nn.Module]:
  """jaxflux.Dense for inference: tensor-parallel layers with sequence_parallel=False."""
  def dense(features: int, *, tensor_parallel: str | None = None, **kwargs) -> nn.Module:
    # Only the tensor-parallel layers take sequence_parallel; the LM head is a plain Dense.
    if tensor_parallel is not None:
      kwargs.update(tensor_parallel=tensor_parallel, sequence_parallel=False)
    return jaxflux.Dense(features, impl=impl, **kwargs)
  return dense


def replicated(x):
  """The residual stream: batch over dp (in its Explicit type), the rest replicated over tp."""
  return train.shard_tp(x, *(None,) * (x.ndim - 1))


class CachedAttention(nn.Module):
  """The training example's attention (same params and math), reading and writing a KV cache."""
  heads: int
  dense: Callable[..., nn.Module]
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, cache, pos):  # x [B, T, C] at positions pos .. pos + T - 1
    b, t, c = x.shape
    d = c // self.heads
    qkv = self.dense(3 * c, tensor_parallel="column", dtype=self.dtype, name="qkv")(x)
    qkv = train.shard_tp(qkv.reshape(b, t, self.heads, 3, d), None, "tp", None, None)
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    keys = lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache[0].dtype), pos, axis=1)
    values = lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache[1].dtype), pos, axis=1)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, keys,
                        preferred_element_type=jnp.float32) / math.sqrt(d)
    # Causal over absolute positions; this also hides the cache slots not yet written.
    visible = jnp.arange(keys.shape[1])[None, :] <= pos + jnp.arange(t)[:, None]
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, values).reshape(b, t, c)
    out = train.shard_tp(out, None, "tp")
    return self.dense(c, tensor_parallel="row", dtype=self.dtype, name="out")(out), (keys, values)


class CachedBlock(nn.Module):
  heads: int
  ffn: int
  activation: str
  dense: Callable[..., nn.Module]
  dtype: Any = jnp.float32
  moe: tuple[int, int] | None = None  # (experts, experts per token): a routed expert MLP
  moe_impl: str = "xla"

  @nn.compact
  def __call__(self, x, cache, pos):
    h = nn.RMSNorm(dtype=self.dtype, name="norm1")(x)
    a, cache = CachedAttention(self.heads, self.dense, self.dtype, name="attn")(h, cache, pos)
    x = replicated(x + a)
    h = nn.RMSNorm(dtype=self.dtype, name="norm2")(x)
    mlp = train.MLP(self.ffn, self.activation, self.dense, self.dtype, self.moe, self.moe_impl,
                    name="mlp")
    return replicated(x + mlp(h)), cache


class Decoder(nn.Module):
  """train.Transformer with a KV cache: tokens [B, T] at positions pos .. pos + T - 1 ->
  the logits of the last position [B, V] (all that greedy decoding needs) and the new cache."""
  vocab: int
  hidden: int
  heads: int
  layers: int
  ffn: int
  activation: str
  dense: Callable[..., nn.Module]
  dtype: Any = jnp.float32
  moe: tuple[int, int] | None = None
  moe_impl: str = "xla"

  @nn.compact
  def __call__(self, tokens, cache: Cache, pos):
    table = nn.Embed(self.vocab, self.hidden, dtype=self.dtype, name="embed").embedding
    # A plain lookup is ambiguous on an Explicit dp axis: name the output layout.
    spec = jax.typeof(tokens).sharding.spec
    x = replicated(jnp.asarray(table, self.dtype).at[tokens].get(out_sharding=P(*spec, None)))
    new_cache = []
    for i in range(self.layers):
      block = CachedBlock(self.heads, self.ffn, self.activation, self.dense, self.dtype,
                          self.moe, self.moe_impl, name=f"block{i}")
      x, layer_cache = block(x, cache[i], pos)
      new_cache.append(layer_cache)
    x = nn.RMSNorm(dtype=self.dtype, name="norm_f")(x[:, -1])
    return self.dense(self.vocab, dtype=self.dtype, name="lm_head")(x), new_cache


MODEL_FIELDS = ("vocab", "hidden", "heads", "layers", "ffn", "activation")


def build_decoder(args, dense, dtype: str | None = None, moe_impl: str = "xla") -> Decoder:
  """The decoder on `dense` layers; with --moe its expert MLPs run grouped_matmul with
  `moe_impl` (jaxflux's model: its --impl; the reference: lax.ragged_dot)."""
  return Decoder(*(getattr(args, f) for f in MODEL_FIELDS), dense, jnp.dtype(dtype or args.dtype),
                 args.moe, moe_impl)


def init_params(args, mesh):
  """The training example's params, from its init with --seed, laid out as it lays them out."""
  dp, tp = mesh.shape["dp"], mesh.shape["tp"]
  # Its init traces the sequence-parallel model: any input of dp sequences of tp tokens will do.
  targs = argparse.Namespace(**{**vars(args), "batch": dp, "seq": tp})
  specs = train.param_specs(targs)
  return train.prepare(targs, mesh, train.flax_dense, specs)[1]


def serving_params(params, dtype: str):
  """The params in the compute dtype, cast once, as a server loads its weights. The training
  example's params are float32: served as they are, every decode step would read 4 bytes per
  weight and cast them again (the step is a weight read: twice the bytes), and a custom call
  such as jaxflux's kernels would also pay for the cast's output. The float32 reference keeps
  the float32 params."""
  return jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dtype), p))(params)


def calibrated_fp8(args, mesh, params, prompts) -> dict:
  """The FP8 recipe's variables (Flax's collection "_overwrite_with_gradient") as the model
  initializes them, then updated by one calibration pass over the prompts.

  As initialized, every scale is 1 and every amax history empty: tensors would quantize
  unscaled, and weights of std 1/sqrt(hidden) (0.011 at hidden 8192) fall below e4m3's normal
  range (2^-6), keeping few bits. The recipe's delayed scaling takes each tensor's scale from
  the amaxes of earlier passes, and a pass returns the updated variables as their gradients (as
  in training, where they overwrite the old ones). So one gradient pass records every tensor's
  amax, and the generation's passes quantize with scale = amax / 448 from it; they keep these
  variables fixed (inference has no update step). The jaxflux model calibrates, on its XLA path:
  Flax's FP8 backward refuses the Explicit dp axis. Both take the whole tensor's amax, so the
  variables are those Flax's recipe would record.
  """
  model = build_decoder(args, train.with_fp8(jaxflux_dense("xla")))

  # Params, prompts and cache are arguments: a closure over them would lower them into the
  # program as constants (gigabytes at the llama70b-8l preset).
  def calibrate(params, prompts, cache):
    def logit_sum(fp8):
      logits, _ = model.apply({"params": params, **fp8}, prompts, cache, 0)
      return logits.astype(jnp.float32).sum()
    variables = model.init(jax.random.key(0), prompts, cache, 0)  # jit drops the unused params
    return jax.grad(logit_sum)({k: v for k, v in variables.items() if k != "params"})

  cache = empty_cache(args, mesh, args.prompt_len)
  # Only the amaxes of this one pass are kept, so XLA's GEMM autotuning (on GPUs up to ~35 s
  # per FP8 shape, forward and backward at batch x prompt rows) would cost more than the pass.
  compiled = jax.jit(calibrate).lower(params, prompts, cache).compile(
      {"xla_gpu_autotune_level": 0})
  return compiled(params, prompts, cache)


def empty_cache(args, mesh, length: int, dtype: str | None = None) -> Cache:
  shape = (args.batch, length, args.heads, args.hidden // args.heads)
  sharding = NamedSharding(mesh, P("dp", None, "tp", None))
  make = lambda: [(jnp.zeros(shape, dtype or args.dtype),) * 2 for _ in range(args.layers)]
  return jax.jit(make, out_shardings=sharding)()


def compiled_steps(model, variables, prompts, cache):
  """(prefill, decode step, seconds each took to compile), compiled ahead of time so that no
  timed call compiles. They take the model's variables (params, and with --fp8 the FP8
  recipe's), tokens [B, T] (prefill) or [B] (the last generated ones) and return (greedy next
  token [B], float32 logits [B, V], cache); the cache is donated, so each step updates it in
  place."""
  def step(variables, tokens, cache, pos):
    # [B] -> [B, 1] in the program (no extra dispatch per step), by indexing: a reshape drops
    # the dp sharding of a size-1 dim, and a batch of 1 would then not match the cache's type.
    tokens = tokens if tokens.ndim == 2 else tokens[:, None]
    logits, cache = model.apply(variables, tokens, cache, pos)
    logits = logits.astype(jnp.float32)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits, cache

  jitted = jax.jit(step, donate_argnums=2)
  # The decode step takes the prefill's tokens [B], sharded over dp like the prompts. Lowered
  # from that type, not from a slice of the prompts: slicing drops a size-1 batch's dp sharding
  # (jax >= 0.11), and the step's cache update then sees two layouts.
  spec = P(*prompts.sharding.spec[:1])
  last = jax.ShapeDtypeStruct(prompts.shape[:1], jnp.int32,
                              sharding=NamedSharding(prompts.sharding.mesh, spec))
  out = []
  for tokens in (prompts, last):
    start = time.perf_counter()
    out.append(jitted.lower(variables, tokens, cache, jnp.int32(0)).compile())
    out.append(time.perf_counter() - start)
  return out


# Timed prefills per model (the median is reported): one prefill is a single call, so a stray
# stall would otherwise be the whole figure.
PREFILL_ROUNDS = 3


class Generation:
  """One model's generation: its compiled prefill and decode step, the state a decode step
  carries (last token, cache) and what each timed call took. Every call is waited for until
  its token is ready, so each time is that call's alone. `label` names it in the log."""

  def __init__(self, label: str, model, variables, prompts, cache, new_tokens: int):
    self.label = label
    self.prefill_fn, prefill_s, self.decode_fn, decode_s = compiled_steps(model, variables,
                                                                          prompts, cache)
    self.compile_s = dict(prefill=prefill_s, decode_step=decode_s)
    self.variables, self.prompts, self.cache = variables, prompts, cache
    self.positions = [jnp.int32(prompts.shape[1] + i) for i in range(new_tokens - 1)]
    self.prefill_s, self.step_s = [], []
    self.tokens, self.logits = [], []

  def prefill(self) -> float:
    """Runs the prefill (every run writes the same cache slots); the decode steps start from
    the last one's token. Returns its seconds."""
    start = time.perf_counter()
    token, logits, self.cache = self.prefill_fn(self.variables, self.prompts, self.cache,
                                                jnp.int32(0))
    token.block_until_ready()
    self.tokens, self.logits = [token], [logits]
    return time.perf_counter() - start

  def step(self, i: int) -> float:
    """Decode step i (the token at position prompt_len + i). Returns its seconds."""
    start = time.perf_counter()
    token, logits, self.cache = self.decode_fn(self.variables, self.tokens[-1], self.cache,
                                               self.positions[i])
    token.block_until_ready()
    self.tokens.append(token)
    self.logits.append(logits)
    return time.perf_counter() - start

  def profile(self, steps: int) -> dict | None:
    """That many more decode steps (on the timed steps' positions again: the same work) under
    JAX's profiler: where their GPU time went (kernel_profile.breakdown). The generated tokens
    and logits stay those of the timed steps."""
    state = dict(token=self.tokens[-1], i=0)

    def step():  # the cache is donated: each step takes the last one's
      pos = self.positions[state["i"] % len(self.positions)]
      state["token"], _, self.cache = self.decode_fn(self.variables, state["token"], self.cache,
                                                     pos)
      state["i"] += 1
      return state["token"]
    return kernel_profile.profile(step, steps)

  def result(self, profile: dict | None = None) -> dict:
    batch, length = self.prompts.shape
    prefill, median = float(np.median(self.prefill_s)), float(np.median(self.step_s))
    return dict(tokens=np.stack(jax.device_get(self.tokens), 1),
                logits=np.stack(jax.device_get(self.logits), 1), compile_s=self.compile_s,
                prefill_ms=1e3 * prefill, prefill_ms_rounds=[1e3 * s for s in self.prefill_s],
                prefill_tokens_per_s=batch * length / prefill,
                step_ms=[1e3 * s for s in self.step_s], step_ms_median=1e3 * median,
                tokens_per_s=batch / median, profile=profile)


def in_turns(items: list, turn: int) -> list:
  """items in the order of turn `turn`: each turn starts one further along, and every len(items)
  turns the order reverses, so over 2 * len(items) turns each item runs first and right after
  each of the others equally often."""
  n = len(items)
  order = items if (turn // n) % 2 == 0 else items[::-1]
  k = turn % n
  return order[k:] + order[:k]


def generate(generations: dict[str, Generation], profile_steps: int = 0) -> dict[str, dict]:
  """Times the models against each other: a prefill of each (untimed: a program's first run
  pays one-time costs, allocations and thread start-up), then PREFILL_ROUNDS timed prefills and
  the new_tokens - 1 decode steps, the models taking turns in every round, so whatever drifts
  during a run (clocks, the host's caches, other work on the machine) falls on all of them
  alike. The median decode step is the per-token latency (the first step's one-time costs fall
  outside it). Then, with profile_steps, each model's profile (Generation.profile)."""
  gens = list(generations.values())
  for g in gens:
    g.prefill()
  for r in range(PREFILL_ROUNDS):
    for g in in_turns(gens, r):
      g.prefill_s.append(g.prefill())
  for i in range(len(gens[0].positions)):
    for g in in_turns(gens, i):
      g.step_s.append(g.step(i))
  return {name: g.result(g.profile(profile_steps) if profile_steps else None)
          for name, g in generations.items()}


def compare(ours: dict, ref: dict) -> dict:
  """Whether the generated tokens agree; else the first step (new-token index) where any
  sequence differs. The logit difference is taken where both runs saw the same inputs: at that
  first step, or over all steps when the tokens agree."""
  differ = np.flatnonzero((ours["tokens"] != ref["tokens"]).any(axis=0))
  first = int(differ[0]) if differ.size else None
  steps = slice(first, first + 1) if differ.size else slice(None)
  diff = np.abs(ours["logits"][:, steps] - ref["logits"][:, steps])
  return dict(tokens_match=first is None, first_diff_step=first,
              max_logit_diff=float(diff.max()))


def distance(run_: dict, ref: dict) -> dict:
  """How far a run is from the float32 reference: the largest difference of the prefill's
  logits (where both saw the same inputs), absolute and relative to the reference's largest
  logit, and the leading new tokens that agree in every sequence (and on average)."""
  diff = float(np.abs(run_["logits"][:, 0] - ref["logits"][:, 0]).max())
  agree = np.cumprod(run_["tokens"] == ref["tokens"], axis=1).sum(axis=1)  # per sequence
  return dict(max_abs_logit_diff=diff,
              rel_logit_diff=diff / float(np.abs(ref["logits"][:, 0]).max()),
              leading_tokens_agree=int(agree.min()), mean_leading_tokens_agree=float(agree.mean()))


def prepare(label: str, args, mesh, dense, variables, prompts, log, dtype: str | None = None,
            moe_impl: str = "xla") -> Generation:
  """A model on `dense` layers with its own cache, compiled (and the compile logged)."""
  model = build_decoder(args, dense, dtype, moe_impl)
  cache = empty_cache(args, mesh, args.prompt_len + args.new_tokens, dtype)
  g = Generation(label, model, variables, prompts, cache, args.new_tokens)
  log(f"[{label}] compile: prefill {g.compile_s['prefill']:.2f} s, decode step "
      f"{g.compile_s['decode_step']:.2f} s")
  return g


def run(generations: dict[str, Generation], args, log) -> dict[str, dict]:
  """generate() over the models, each one's timings logged."""
  results = generate(generations, args.profile)
  for name, g in generations.items():
    report(g.label, results[name], args, log)
  return results


def report(label: str, r: dict, args, log) -> None:
  log(f"[{label}] prefill {r['prefill_ms']:.2f} ms (median of {len(r['prefill_ms_rounds'])}, "
      f"{r['prefill_tokens_per_s']:,.0f} tokens/s); decode {r['step_ms_median']:.3f} ms/token "
      f"(median of {len(r['step_ms'])}), {r['tokens_per_s']:,.0f} tokens/s")
  if args.profile:
    p = r["profile"]
    if p is None:
      log(f"[{label}] profile: no GPU kernels in it (the profile splits GPU time only)")
    else:
      # Outside the GEMMs: the decode step's time less its GEMM kernels' (the step's median,
      # not the profiled steps' time, which the profiler's own work lengthens).
      p["outside_gemm_ms"] = r["step_ms_median"] - p["gemm_ms"]
      p["idle_ms"] = r["step_ms_median"] - p["busy_ms"]
      log(f"[{label}] profile of {p['steps']} decode steps, per step: GEMM kernels "
          f"{p['gemm_ms']:.3f} ms ({p['gemm_calls']:.0f} calls), other kernels and copies "
          f"{p['other_ms']:.3f} ms ({p['other_calls']:.0f}), GPU idle {p['idle_ms']:.3f} ms; "
          f"outside the GEMMs {p['outside_gemm_ms']:.3f} of {r['step_ms_median']:.3f} ms")


PRESETS = {
    "small": dict(vocab=256, hidden=128, heads=8, layers=2, ffn=512, activation="gelu",
                  batch=8, prompt_len=32, new_tokens=32, dtype="float32"),
    # The training example's Llama-70B-sized layers (8 of them), decoding a batch of 16.
    "llama70b-8l": {**{k: train.PRESETS["llama70b-8l"][k] for k in MODEL_FIELDS},
                    "batch": 16, "prompt_len": 1024, "new_tokens": 64, "dtype": "bfloat16"},
    # The training example's Mixtral-8x7B-sized layers (8 experts, top-2; 2 of them).
    "mixtral-2l": {**{k: train.PRESETS["mixtral-2l"][k] for k in MODEL_FIELDS + ("moe",)},
                   "batch": 16, "prompt_len": 1024, "new_tokens": 64, "dtype": "bfloat16"},
}


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=train.HelpFormatter)
  p.add_argument("--preset", choices=tuple(PRESETS), default="small",
                 help="model and run settings to start from; explicit flags override them")
  p.add_argument("--impl", choices=("auto", "fused", "xla"), default="auto",
                 help="impl of the jaxflux.Dense run: fused (the fused kernels or an error), "
                      "xla, or auto (fused where the tuning table measured it faster)")
  p.add_argument("--batch", type=int, help="prompts (divisible by dp = devices / tp)")
  p.add_argument("--prompt-len", type=int, help="tokens per prompt (>= 1)")
  p.add_argument("--new-tokens", type=int, help="tokens generated per prompt (>= 2)")
  p.add_argument("--tp", type=int, default=None,
                 help="tensor-parallel size, dividing the device count; dp = devices / tp "
                      "(default: all devices)")
  p.add_argument("--dtype", choices=("float32", "bfloat16"),
                 help="compute and KV cache dtype; the fused kernels and --fp8 need bfloat16")
  p.add_argument("--fp8", action="store_true",
                 help="Flax's FP8 training recipe (nn.Fp8DirectDotGeneralOp) on both models' "
                      "tensor-parallel projections: weights and activations in e4m3, each "
                      "tensor scaled by delayed scaling. Not a weight-only quantization: this "
                      "recipe is the FP8 that jaxflux.Dense and its fused FP8 matmuls take. The "
                      "scales come from one calibration pass over the prompts (the initial "
                      "scales, 1, would leave small weights with few bits); jaxflux also runs "
                      "without FP8 for the decode speed. Needs --dtype bfloat16")
  p.add_argument("--seed", type=int, default=0,
                 help="seed of the params (the training example's init) and the prompts (>= 0)")
  p.add_argument("--hidden", type=int, help="model width (divisible by --heads)")
  p.add_argument("--heads", type=int, help="attention heads (divisible by tp)")
  p.add_argument("--layers", type=int, help="transformer blocks (>= 1)")
  p.add_argument("--ffn", type=int, help="MLP width (divisible by tp)")
  p.add_argument("--vocab", type=int, help="vocabulary size (>= 1)")
  p.add_argument("--activation", choices=("gelu", "swiglu"),
                 help="MLP activation (swiglu: gated, fc1 twice as wide)")
  p.add_argument("--moe", type=train.parse_moe, metavar="EXPERTS,TOP_K", default=None,
                 help="routed mixture-of-experts MLPs (jaxflux.MoE: EXPERTS experts of width "
                      "--ffn, TOP_K per token; each expert's width split over tp), as the "
                      "training example's --moe. jaxflux's model runs them on the grouped GEMM "
                      "(--impl), the reference on lax.ragged_dot. Dense MLPs without it")
  p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                 help="after the timed steps, run STEPS more decode steps of each model under "
                      "JAX's profiler and report, per step, the GPU's time in GEMM kernels, in "
                      "other kernels and copies, and idle: the time outside the GEMMs is what "
                      "per-call costs add to (GPUs only; 0: no profile)")
  p.add_argument("--quiet", action="store_true", help="print the comparisons only")
  p.add_argument("--out", metavar="FILE.json", help="write config, timings, the comparisons, "
                 "machine and versions")
  return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  """The flags, with the preset's values as defaults, checked as far as they can be without
  the devices (main checks the rest with train.check_layout)."""
  p = build_parser()
  p.set_defaults(**PRESETS.get(train.preset_arg(argv, "small"), {}))
  args = p.parse_args(argv)
  train.check_at_least(p, args, dict(batch=1, prompt_len=1, hidden=1, heads=1, layers=1, ffn=1,
                                     vocab=1, tp=1, seed=0, profile=0))
  if args.new_tokens < 2:
    p.error(f"--new-tokens {args.new_tokens} must be at least 2: the first new token comes from "
            "the prefill, the others from the timed decode steps")
  if args.hidden % args.heads:
    p.error(f"--hidden {args.hidden} must be divisible by --heads {args.heads}: use a --heads "
            f"that divides {args.hidden}")
  if args.impl == "fused" and args.dtype != "bfloat16":
    p.error(f"--impl fused needs --dtype bfloat16 (the fused kernels' dtype), not {args.dtype}: "
            "add --dtype bfloat16, or use --impl auto")
  if args.moe and args.fp8:
    p.error("--moe and --fp8 together are not supported: the experts' grouped GEMMs take no FP8 "
            "recipe; drop one of them")
  if args.fp8 and args.dtype != "bfloat16":
    p.error(f"--fp8 needs --dtype bfloat16, not {args.dtype}: FP8 stands in for 16-bit matmuls "
            "(the recipe computes in the compute dtype, jaxflux's fused FP8 matmuls give "
            "bfloat16) and float32 is the reference it is measured against: add --dtype bfloat16")
  return args


def main(argv: Sequence[str] | None = None) -> dict:
  """Runs the models. Returns the config, every run's timings and tokens, the comparison and
  the distances to float32 (as in the JSON record), and for further checks the params, the FP8
  variables ({} without --fp8), the prompts and the runs' logits."""
  args = parse_args(argv)
  train.check_layout(build_parser(), args, jax.device_count(), ("heads", "ffn"))
  try:
    return run_example(args, argv)
  except jaxflux.FusedKernelUnavailableError as e:
    # --impl fused where the fused kernels cannot run (platform, dtype, sizes): a bad flag.
    build_parser().error(f"--impl fused: {e}")


def run_example(args, argv: Sequence[str] | None) -> dict:
  """main's run, from checked flags (argv for the JSON record's command)."""
  log = (lambda s: None) if args.quiet else print
  mesh = train.make_mesh(args.tp)
  dp, tp = mesh.shape["dp"], mesh.shape["tp"]
  platform_ = mesh.devices.flat[0].platform
  kind = args.dtype + (" + FP8" if args.fp8 else "")
  fp8_note = ", FP8 recipe on the tensor-parallel projections" if args.fp8 else ""
  log(f"mesh: dp={dp} x tp={tp} on {platform_} ({mesh.devices.size} devices), dtype="
      f"{args.dtype}, impl={args.impl}{fp8_note}; fused kernels "
      f"{'available' if jaxflux.has_cuda() else 'unavailable'} here")
  # Prompts as the training data looks (a per-row arithmetic sequence with noise).
  prompts_host = train.synthetic_batch(args.seed, 0, args.batch, args.prompt_len - 1, args.vocab)
  # The rules place the MoE layers' params (the training example's; no effect without --moe).
  with jax.set_mesh(mesh), nn.logical_axis_rules(train.MOE_RULES):
    params = init_params(args, mesh)
    prompts = jax.device_put(prompts_host, NamedSharding(mesh, P("dp", None)))
    log(f"params: {sum(x.size for x in jax.tree.leaves(params)):,}; batch {args.batch}, "
        f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens")
    reference = None
    if args.dtype != "float32":
      # First, while the float32 params are the only weights on the devices. On GPUs float32
      # matmuls default to TF32: the reference asks for full float32.
      with jax.default_matmul_precision("float32"):
        reference = prepare("flax, float32 reference", args, mesh, train.flax_dense,
                            {"params": params}, prompts, log, dtype="float32")
        reference = run({"reference": reference}, args, log)["reference"]
      served = serving_params(params, args.dtype)
      params = jax.device_get(params)  # the devices keep only the served copy
    else:
      served = params
    fp8 = {}
    if args.fp8:
      start = time.perf_counter()
      fp8 = calibrated_fp8(args, mesh, served, prompts)
      log(f"FP8 calibration pass: {time.perf_counter() - start:.2f} s, compile included")
    recipe = train.with_fp8 if args.fp8 else (lambda dense: dense)
    variables = {"params": served, **fp8}
    # Every model is compiled first, then timed with the others in turns (generate()).
    models = {"jaxflux": ("jaxflux", recipe(jaxflux_dense(args.impl)), variables, args.impl),
              "flax": ("flax", recipe(train.flax_dense), variables, "xla")}
    if args.fp8:  # what FP8 is for: the decode speed against the same layers without it
      models["jaxflux_no_fp8"] = (f"jaxflux, {args.dtype} without FP8", jaxflux_dense(args.impl),
                                  {"params": served}, args.impl)
    runs = run({name: prepare(label, args, mesh, dense, v, prompts, log, moe_impl=moe_impl)
                for name, (label, dense, v, moe_impl) in models.items()}, args, log)
    reference = reference or runs["flax"]
  ours, ref = runs["jaxflux"], runs["flax"]
  match = compare(ours, ref)
  # Identical on the XLA path in float32 on CPU; elsewhere (TF32 or bfloat16 matmuls, fused
  # kernels summing in another order) a near-tie can flip a token: reported, not failed.
  exact = platform_ == "cpu" and args.dtype == "float32"
  where = ("all steps" if match["tokens_match"]
           else f"step {match['first_diff_step']}, the first that differs")
  if match["tokens_match"] or exact:
    print(f"generated tokens {'MATCH' if match['tokens_match'] else 'DIFFER'} between "
          f"jaxflux.Dense and flax.linen.Dense; max logit difference "
          f"{match['max_logit_diff']:.3e} ({where})")
  else:
    print(f"generated tokens of jaxflux.Dense and flax.linen.Dense ({kind}) part at step "
          f"{match['first_diff_step']}, where the max logit difference is "
          f"{match['max_logit_diff']:.3e}: their roundings differ, so a near-tie can go either "
          "way; the distances to float32 below tell which stays closer")

  vs_float32 = {name: distance(r, reference) for name, r in runs.items()}
  scale = float(np.abs(reference["logits"][:, 0]).max())
  print(f"distance to float32 (flax.linen.Dense in float32, same params; prefill logits up to "
        f"{scale:.3g} in magnitude):")
  labels = {"jaxflux": f"jaxflux.Dense, {kind}", "flax": f"flax.linen.Dense, {kind}",
            "jaxflux_no_fp8": f"jaxflux.Dense, {args.dtype}"}
  width = max(len(labels[name]) for name in runs)
  for name, d in vs_float32.items():
    print(f"  {labels[name]:<{width}}  prefill logits max |diff| {d['max_abs_logit_diff']:.3e} "
          f"({d['rel_logit_diff']:.2e} of the largest); first {d['leading_tokens_agree']} of "
          f"{args.new_tokens} new tokens agree in every sequence (mean "
          f"{d['mean_leading_tokens_agree']:.1f})")
  if args.fp8:
    base = runs["jaxflux_no_fp8"]
    print(f"decode, jaxflux.Dense: FP8 {ours['step_ms_median']:.3f} ms/token "
          f"({ours['tokens_per_s']:,.0f} tokens/s), {args.dtype} without FP8 "
          f"{base['step_ms_median']:.3f} ms/token ({base['tokens_per_s']:,.0f} tokens/s): "
          f"{base['step_ms_median'] / ours['step_ms_median']:.2f}x")
  if all(r["profile"] for r in (ours, ref)):
    a, b = ours["profile"]["outside_gemm_ms"], ref["profile"]["outside_gemm_ms"]
    print(f"decode time outside the GEMM kernels: jaxflux.Dense {a:.3f} ms/token, "
          f"flax.linen.Dense {b:.3f} ({a / b:.2f}x)")
  # A non-finite logit is wrong in any dtype.
  nonfinite = [name for name, r in {**runs, "float32 reference": reference}.items()
               if not np.isfinite(r["logits"]).all()]
  if nonfinite:
    print(f"non-finite logits in: {', '.join(nonfinite)}")
  ok = (match["tokens_match"] or not exact) and not nonfinite

  timings = lambda r: {k: v for k, v in r.items() if k not in ("tokens", "logits")}
  result = dict(config=vars(args), dp=dp, tp=tp, **{name: timings(r) for name, r in runs.items()},
                match=match, exact_match_required=exact, ok=ok,
                vs_float32=dict(reference="flax.linen.Dense, float32", logit_scale=scale,
                                **vs_float32),
                tokens=ours["tokens"].tolist(), flax_tokens=ref["tokens"].tolist(),
                float32_tokens=reference["tokens"].tolist())
  if reference is not ref:
    result["float32_reference"] = timings(reference)
  if args.out:
    write_record(args.out, sys.argv[1:] if argv is None else list(argv), result)
    log(f"wrote {args.out}")
  return dict(result, params=params, fp8_variables=fp8, prompts=prompts_host,
              logits=ours["logits"], flax_logits=ref["logits"],
              float32_logits=reference["logits"])


def write_record(path: str, argv: Sequence[str], result: dict) -> None:
  """The run as JSON: the command, UTC date, machine and versions, then the result."""
  versions = {"python": platform.python_version()}
  for name in ("jax", "jaxlib", "flax", "numpy", "jaxflux"):
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  devices = jax.devices()
  record = {
      "command": f"python examples/generate.py {shlex.join(argv)}",
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "machine": {"platform": devices[0].platform, "device_count": len(devices),
                  "device_kinds": sorted({d.device_kind for d in devices}),
                  "fused_kernels": jaxflux.has_cuda()},
      "versions": versions, **result}
  out = pathlib.Path(path)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
  sys.exit(0 if main()["ok"] else 1)
