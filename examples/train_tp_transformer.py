"""Train a small tensor-parallel transformer with jaxflux.Dense, checked against flax.linen.Dense.

    python examples/train_tp_transformer.py              # tp = all local devices
    python examples/train_tp_transformer.py --tp 4       # 2-way dp x 4-way tp on 8 devices

Without a GPU it runs on 8 virtual CPU devices (the XLA path); on Hopper GPUs with a CUDA build
the tensor-parallel layers run the fused kernels where `impl` allows. It trains a GPT-style
decoder on synthetic data, then trains the same model built from flax.linen.Dense from the same
parameters on the same batches and compares the loss curves (exit status 1 if they differ).

Sharding (Megatron-style sequence parallelism; mesh ('dp', 'tp'), dp Explicit, tp Auto):
the residual stream [B, T, C] is sharded over tokens on tp; QKV and MLP-fc1 are column-parallel
jaxflux.Dense (all-gather of tokens fused with the GEMM), attention-out and MLP-fc2 row-parallel
(GEMM fused with the reduce-scatter back to token shards); heads and MLP units are sharded
between them. QKV features are laid out [heads, 3, head_dim] (swiglu's fc1 [ffn, 2]) so a column
shard holds whole heads and the reshape needs no communication. Embedding, norms and the LM head
are replicated; the AdamW state is sharded like the params.

--mode xla trains the same model with impl="xla"; --mode windowed trains plain flax.linen.Dense
under GSPMD with XLA's windowed-einsum flags (its own collective matmul) added to XLA_FLAGS.
--fp8 runs Flax's FP8 recipe (nn.Fp8DirectDotGeneralOp) on every tensor-parallel projection, and
compares with flax.linen.Dense running the same recipe and with the same run without FP8.
--moe EXPERTS,TOP_K makes every MLP a routed mixture of experts (jaxflux.MoE, each expert's
intermediate dimension split over tp by MOE_RULES); the reference model runs it on
lax.ragged_dot, the jaxflux model on the grouped GEMM kernel where it runs.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import functools
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import re
import shlex
import sys
import time
from typing import Any, Callable, Sequence

import jax

WINDOWED_EINSUM_FLAGS = ("--xla_gpu_threshold_for_windowed_einsum_mib=0",
                         "--xla_gpu_multi_streamed_windowed_einsum=true")


def windowed_flags_set() -> bool:
  return all(f in os.environ.get("XLA_FLAGS", "").split() for f in WINDOWED_EINSUM_FLAGS)


if __name__ == "__main__":
  # Before any JAX backend starts: 8 virtual CPU devices (no effect on the GPU client), and for
  # --mode windowed the XLA flags, which XLA reads once (the CPU build accepts and ignores them).
  if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
    jax.config.update("jax_num_cpu_devices", 8)
  _early = argparse.ArgumentParser(add_help=False)
  _early.add_argument("--mode")
  if _early.parse_known_args()[0].mode == "windowed" and not windowed_flags_set():
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *WINDOWED_EINSUM_FLAGS])

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxflux  # noqa: E402


def jaxflux_dense(impl: str) -> Callable[..., nn.Module]:
  return functools.partial(jaxflux.Dense, impl=impl)


def flax_dense(features: int, *, tensor_parallel: str | None = None, **kwargs) -> nn.Module:
  del tensor_parallel  # XLA derives the collectives from the sharding constraints around it
  return nn.Dense(features, **kwargs)


def with_fp8(dense: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
  """`dense` with Flax's FP8 recipe on the tensor-parallel projections (not the LM head)."""
  return lambda features, tensor_parallel=None, **kwargs: dense(
      features, tensor_parallel=tensor_parallel, **kwargs,
      **({"dot_general_cls": nn.Fp8DirectDotGeneralOp} if tensor_parallel else {}))


def shard_tp(x, *dims):
  """Constrains the dims after the batch over tp (dp is Explicit: it lives in the type)."""
  return jax.lax.with_sharding_constraint(x, P(None, *dims))


def shard_tokens(x):
  return shard_tp(x, "tp", None)


class Attention(nn.Module):
  heads: int
  dense: Callable[..., nn.Module]
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):  # [B, T, C], token-sharded
    b, t, c = x.shape
    d = c // self.heads
    qkv = self.dense(3 * c, tensor_parallel="column", dtype=self.dtype, name="qkv")(x)
    qkv = shard_tp(qkv.reshape(b, t, self.heads, 3, d), None, "tp", None, None)
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    # Softmax in float32 even in bfloat16 runs.
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = shard_tp(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, c), None, "tp")
    return self.dense(c, tensor_parallel="row", dtype=self.dtype, name="out")(out)


class MLP(nn.Module):
  ffn: int
  activation: str
  dense: Callable[..., nn.Module]
  dtype: Any = jnp.float32
  moe: tuple[int, int] | None = None  # (experts, experts per token): a routed expert MLP
  moe_impl: str = "xla"

  @nn.compact
  def __call__(self, x):
    b, t, c = x.shape
    if self.moe:  # each expert an MLP of width ffn; MOE_RULES place its params
      experts, top_k = self.moe
      return jaxflux.MoE(experts, top_k, self.ffn, activation=self.activation, dtype=self.dtype,
                         impl=self.moe_impl, name="moe")(x)
    if self.activation == "swiglu":
      h = self.dense(2 * self.ffn, tensor_parallel="column", dtype=self.dtype, name="fc1")(x)
      h = shard_tp(h.reshape(b, t, self.ffn, 2), None, "tp", None)
      h = nn.silu(h[..., 0]) * h[..., 1]
    else:
      h = self.dense(self.ffn, tensor_parallel="column", dtype=self.dtype, name="fc1")(x)
      h = nn.gelu(shard_tp(h, None, "tp"))
    return self.dense(c, tensor_parallel="row", dtype=self.dtype, name="fc2")(h)


class Block(nn.Module):
  heads: int
  ffn: int
  activation: str
  dense: Callable[..., nn.Module]
  dtype: Any = jnp.float32
  moe: tuple[int, int] | None = None
  moe_impl: str = "xla"

  @nn.compact
  def __call__(self, x):  # pre-norm residual block, token-sharded in and out
    h = nn.RMSNorm(dtype=self.dtype, name="norm1")(x)
    x = shard_tokens(x + Attention(self.heads, self.dense, self.dtype, name="attn")(h))
    h = nn.RMSNorm(dtype=self.dtype, name="norm2")(x)
    return shard_tokens(x + MLP(self.ffn, self.activation, self.dense, self.dtype, self.moe,
                                self.moe_impl, name="mlp")(h))


class Transformer(nn.Module):
  """Decoder-only LM: token ids [B, T] sharded P('dp', 'tp') -> logits [B, T, V]."""
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
  def __call__(self, tokens):
    table = nn.Embed(self.vocab, self.hidden, dtype=self.dtype, name="embed").embedding
    # A plain lookup is ambiguous on an Explicit dp axis: name the output layout.
    spec = jax.typeof(tokens).sharding.spec
    x = shard_tokens(jnp.asarray(table, self.dtype).at[tokens].get(out_sharding=P(*spec, None)))
    for i in range(self.layers):
      x = Block(self.heads, self.ffn, self.activation, self.dense, self.dtype, self.moe,
                self.moe_impl, name=f"block{i}")(x)
    x = nn.RMSNorm(dtype=self.dtype, name="norm_f")(x)
    return shard_tokens(self.dense(self.vocab, dtype=self.dtype, name="lm_head")(x))


def synthetic_batch(seed: int, step: int, batch: int, seq: int, vocab: int) -> np.ndarray:
  """int32 [batch, seq + 1]: x[t] = start + stride * t (mod vocab) with a per-row stride and 5%
  noise, so the next token needs context (attention) and the loss stays above zero."""
  rng = np.random.default_rng((seed, step))
  start, stride = rng.integers(0, vocab, size=(batch, 1)), rng.integers(1, 5, size=(batch, 1))
  seqs = (start + stride * np.arange(seq + 1)) % vocab
  seqs = np.where(rng.random(seqs.shape) < 0.05, rng.integers(0, vocab, seqs.shape), seqs)
  return seqs.astype(np.int32)


def make_mesh(tp: int | None, dp_type: AxisType = AxisType.Explicit) -> jax.sharding.Mesh:
  n = len(jax.devices())
  tp = tp or n
  if tp < 1 or n % tp:
    raise ValueError(f"--tp {tp} must divide the number of devices ({n})")
  # dp Explicit keeps the batch split through the layers' shard_map; tp Auto is placed by the
  # layers and the sharding constraints (and drives XLA's partitioner for the reference).
  return jax.make_mesh((n // tp, tp), ("dp", "tp"), axis_types=(dp_type, AxisType.Auto))


# --moe: the MoE layers' logical axes on this mesh. Each expert's intermediate dimension is
# split over tp (expert tensor parallelism, like the dense MLP's); every device holds every expert.
MOE_RULES = (("exp", None), ("embed", None), ("mlp", "tp"))


def build_model(args, dense) -> Transformer:
  # The MoE layers run the model's own impl: jaxflux's models the grouped GEMM where it runs
  # (impl="auto"/"fused"), the reference (flax.linen.Dense, or --mode xla) lax.ragged_dot.
  moe_impl = dense.keywords["impl"] if isinstance(dense, functools.partial) else "xla"
  return Transformer(args.vocab, args.hidden, args.heads, args.layers, args.ffn,
                     args.activation, dense, jnp.dtype(args.dtype), args.moe, moe_impl)


def param_specs(args):
  """The jaxflux model's param layout (flax.linen.Dense models carry none: they take this)."""
  model = build_model(args, jaxflux_dense("xla"))
  example = jnp.zeros((args.batch, args.seq), jnp.int32)
  specs = nn.get_partition_spec(jax.eval_shape(model.init, jax.random.key(0), example)["params"])
  return nn.logical_to_mesh(specs, MOE_RULES) if args.moe else specs


def prepare(args, mesh, dense, specs):
  """(model built from `dense`, its params initialized from --seed on the mesh, shardings)."""
  model = build_model(args, dense)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                           is_leaf=lambda s: isinstance(s, P))
  init = jax.jit(lambda key, x: nn.unbox(model.init(key, x)["params"]), out_shardings=shardings)
  return model, init(jax.random.key(args.seed), jnp.zeros((args.batch, args.seq), jnp.int32)), \
      shardings


def fp8_variables(args, model) -> dict:
  """The FP8 recipe's variables (Flax's collection "_overwrite_with_gradient"), replicated."""
  return jax.jit(lambda *a: {k: v for k, v in model.init(*a).items() if k != "params"})(
      jax.random.key(args.seed), jnp.zeros((args.batch, args.seq), jnp.int32))


def optimizer(args) -> optax.GradientTransformation:
  lr = optax.linear_schedule(0.0, args.lr, args.lr_warmup) if args.lr_warmup else args.lr
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(lr, b1=0.9, b2=0.98, weight_decay=0.01))


def train_state(model, tx, params, shardings, mesh):
  """(jitted step, initial optimizer state). The AdamW moments are sharded like the params;
  left to jit(tx.init) they come out replicated and every step all-gathers them. The FP8
  variables ({} without --fp8) are overwritten with their gradients, Flax's recipe."""
  opt_shardings = optax.tree_utils.tree_map_params(
      tx, lambda _, s: s, jax.eval_shape(tx.init, params), shardings,
      transform_non_params=lambda _: NamedSharding(mesh, P()))

  def loss_fn(params, fp8, inputs, targets):
    logits = model.apply({"params": params, **fp8}, inputs).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2),
                     out_shardings=(shardings, opt_shardings, None, None))
  def step(params, opt_state, fp8, inputs, targets):
    loss, (grads, fp8) = jax.value_and_grad(loss_fn, (0, 1))(params, fp8, inputs, targets)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, fp8, loss

  return step, jax.jit(tx.init, out_shardings=opt_shardings)(params)


def device_batch(batch: np.ndarray, mesh):
  # Every process passes the same host batch and keeps its own devices' shards.
  return jax.device_put((batch[:, :-1], batch[:, 1:]), NamedSharding(mesh, P("dp", "tp")))


def host_copy(tree, mesh):
  """NumPy copies in every process (device_get refuses arrays with shards in other processes)."""
  if jax.process_count() > 1:
    tree = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))(tree)
  return jax.device_get(tree)


def fused_calls(hlo: str) -> dict[str, int]:
  """jaxflux's fused-kernel custom calls in compiled HLO, by target (none: the XLA path)."""
  return dict(sorted(collections.Counter(
      re.findall(r'custom_call_target="(jaxflux_\w+)"', hlo)).items()))


def xla_reason(args, mesh) -> str:
  """Why a jaxflux run's matmuls took the XLA path, from public facts: the impl, the platform,
  jaxflux.has_cuda(), the GPUs' compute capability, the dtype, then the tuning table's rules."""
  impl = "xla" if args.mode == "xla" else args.impl
  if impl == "xla":
    return "impl=xla"
  device = mesh.devices.flat[0]
  if device.platform != "gpu":
    return f"impl={impl}: fused kernels need Hopper GPUs; this is {device.platform}"
  if not jaxflux.has_cuda():
    return f"impl={impl}: this jaxflux build has no CUDA kernels (jaxflux.has_cuda() is False)"
  if (capability := str(getattr(device, "compute_capability", "9.0"))) != "9.0":
    return f"impl={impl}: fused kernels need Hopper GPUs (compute capability 9.0), not {capability}"
  if args.dtype not in ("bfloat16", "float16"):
    return f"impl={impl}: fused kernels take bfloat16/float16, this run is {args.dtype}"
  if args.fp8 and impl == "auto":
    return "impl=auto: FP8 runs the fused kernels with --impl fused only (no measured rule)"
  if jax.process_count() > 1 and len(jax.local_devices()) > 1:
    return f"impl={impl}: under jax.distributed the fused kernels need one GPU per process"
  rules = sorted({(r.tp, r.min_rows) for r in jaxflux.tuning.AUTO_RULES})
  return (f"impl={impl}: no jaxflux.tuning.AUTO_RULES rule for tp={mesh.shape['tp']} at these "
          "sizes (" + "; ".join(f"tp={t} from {n} rows" for t, n in rules) + ")")


SKIP_STEPS = 1  # left out of the step-time median: the first run (allocations, warm-up)


def timing(times, tokens_per_step, compile_s) -> dict:
  timed = times[SKIP_STEPS:]
  median = float(np.median(timed)) if timed else float("nan")
  return dict(step_ms=[1e3 * t for t in times], step_ms_median=1e3 * median,
              tokens_per_s=tokens_per_step / median, timed_steps=len(timed),
              compile_s=compile_s)


PRESETS = {
    # Llama-70B layer sizes (full multi-head attention), 8 layers, 4096 tokens: trains at tp=2
    # on two H200s. Large models diverge without the learning-rate warm-up.
    "llama70b-8l": dict(hidden=8192, heads=64, ffn=28672, layers=8, seq=4096, batch=1,
                        activation="swiglu", vocab=32768, dtype="bfloat16", lr=1.5e-4,
                        lr_warmup=50),
    # Mixtral 8x7B's layer sizes (8 experts of width 14336, top-2; full multi-head attention),
    # 2 layers, 4096 tokens: fits one H200.
    "mixtral-2l": dict(hidden=4096, heads=32, ffn=14336, layers=2, seq=4096, batch=1,
                       activation="swiglu", vocab=32000, dtype="bfloat16", lr=1.5e-4,
                       lr_warmup=50, moe=(8, 2)),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Appends "(default: X)" to a flag's help unless the help already names its default or it has
  none to show (None: unset; False: a switch)."""

  def _get_help_string(self, action):
    if "(default" in (action.help or "") or action.default is None or action.default is False:
      return action.help
    return super()._get_help_string(action)


def preset_arg(argv: Sequence[str] | None, default: str | None = None) -> str | None:
  """--preset's value, read before the full parse so that the preset's values are the defaults
  that --help shows and that explicit flags override. A bad value is left to the full parse."""
  early = argparse.ArgumentParser(add_help=False)
  early.add_argument("--preset", nargs="?", default=default)
  return early.parse_known_args(argv)[0].preset


def check_at_least(p: argparse.ArgumentParser, args, minimums: dict) -> None:
  """parser.error for the first flag (by dest) below its minimum; None values are unset."""
  for dest, low in minimums.items():
    value = getattr(args, dest)
    if value is not None and value < low:
      p.error(f"--{dest.replace('_', '-')} {value} must be at least {low}")


def check_layout(p: argparse.ArgumentParser, args, devices: int, tp_dims: Sequence[str]) -> None:
  """parser.error unless --tp divides the device count, the `tp_dims` flags divide by tp and
  --batch by dp: the mesh is (devices / tp) x tp over all devices."""
  tp = args.tp or devices
  if devices % tp:
    sizes = ", ".join(str(d) for d in range(1, devices + 1) if devices % d == 0)
    p.error(f"--tp {tp} must divide the number of devices ({devices}): use one of {sizes}")
  for name in tp_dims:
    value = getattr(args, name)
    if value % tp:
      p.error(f"--{name} {value} must be divisible by tp={tp}"
              + ("" if args.tp else " (all devices, the default --tp)")
              + f": use a multiple of {tp}, or a --tp that divides both {value} and {devices}")
  dp = devices // tp
  if args.batch % dp:
    p.error(f"--batch {args.batch} must be divisible by dp={dp} (devices / tp = {devices} / "
            f"{tp}): use a multiple of {dp}, or a larger --tp")


def parse_distributed(value: str) -> tuple[str, int, int]:
  """--distributed COORD,NUM,ID -> (coordinator, process count, process id); ValueError naming
  the flag and the expected form otherwise."""
  try:
    coordinator, num, pid = value.split(",")
    num, pid = int(num), int(pid)
  except ValueError:
    raise ValueError(f"--distributed {value!r}: expected COORD,NUM,ID, e.g. "
                     "127.0.0.1:1234,2,0") from None
  if not coordinator or num < 1 or not 0 <= pid < num:
    raise ValueError(f"--distributed {value!r}: needs a coordinator host:port, NUM >= 1 "
                     "processes and an ID from 0 to NUM - 1, e.g. 127.0.0.1:1234,2,0")
  return coordinator, num, pid


def parse_moe(value: str) -> tuple[int, int]:
  """--moe EXPERTS,TOP_K: two positive ints, TOP_K <= EXPERTS."""
  parts = value.split(",")
  if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
    raise argparse.ArgumentTypeError(f"expected EXPERTS,TOP_K, e.g. 8,2; got {value!r}")
  experts, top_k = (int(p) for p in parts)
  if not 1 <= top_k <= experts:
    raise argparse.ArgumentTypeError(f"TOP_K={top_k} must be from 1 to EXPERTS={experts}")
  return experts, top_k


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=HelpFormatter)
  p.add_argument("--preset", choices=tuple(PRESETS), default=None,
                 help="model and run settings to start from; explicit flags override them "
                      "(default: the small model below)")
  p.add_argument("--mode", choices=("jaxflux", "xla", "windowed"), default="jaxflux",
                 help="jaxflux.Dense with --impl; the same with impl='xla'; or flax.linen.Dense "
                      "under GSPMD with XLA's windowed-einsum flags")
  p.add_argument("--impl", choices=("auto", "fused", "xla"), default="auto",
                 help="jaxflux.Dense impl, --mode jaxflux only: fused (the fused kernels or an "
                      "error), xla, or auto (fused where the tuning table measured it faster)")
  p.add_argument("--steps", type=int, default=40, help="training steps (>= 1)")
  p.add_argument("--batch", type=int, default=8,
                 help="global batch in sequences (divisible by dp = devices / tp)")
  p.add_argument("--seq", type=int, default=64, help="tokens per sequence (divisible by tp)")
  p.add_argument("--hidden", type=int, default=128, help="model width (divisible by --heads)")
  p.add_argument("--heads", type=int, default=8, help="attention heads (divisible by tp)")
  p.add_argument("--layers", type=int, default=2, help="transformer blocks (>= 1)")
  p.add_argument("--ffn", type=int, default=512, help="MLP width (divisible by tp)")
  p.add_argument("--vocab", type=int, default=256, help="vocabulary size (>= 1)")
  p.add_argument("--activation", choices=("gelu", "swiglu"), default="gelu",
                 help="MLP activation (swiglu: gated, fc1 twice as wide)")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                 help="compute dtype (params stay float32); the fused kernels need bfloat16")
  p.add_argument("--tp", type=int, default=None,
                 help="tensor-parallel size, dividing the device count; dp = devices / tp "
                      "(default: all devices)")
  p.add_argument("--seed", type=int, default=0, help="seed of the params and the synthetic "
                 "batches (>= 0)")
  p.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate (>= 0)")
  p.add_argument("--moe", type=parse_moe, metavar="EXPERTS,TOP_K", default=None,
                 help="mixture-of-experts MLPs (jaxflux.MoE): EXPERTS experts of width --ffn, "
                      "TOP_K per token, e.g. 8,2; the reference model runs them on "
                      "lax.ragged_dot")
  p.add_argument("--fp8", action="store_true",
                 help="Flax's FP8 recipe on the tensor-parallel projections")
  p.add_argument("--no-compare", action="store_true",
                 help="skip the flax.linen.Dense comparison runs")
  p.add_argument("--quiet", action="store_true", help="no per-step lines")
  p.add_argument("--log-every", type=int, default=0, metavar="N",
                 help="a progress line every N steps (default: about 10 lines per run)")
  p.add_argument("--out", metavar="FILE.json", help="write losses, step times, machine, versions")
  p.add_argument("--distributed", metavar="COORD,NUM,ID", nargs="?", const="auto",
                 help="join jax.distributed as process ID of NUM (coordinator host:port); bare: "
                      "JAX's cluster detection (SLURM, Open MPI)")
  p.add_argument("--local-device-ids", metavar="IDS",
                 help="with --distributed: the comma-separated CUDA ordinals this process "
                      "drives, e.g. 0")
  p.add_argument("--cpu-devices", type=int, metavar="N",
                 help="CPU devices of this process; no effect on GPUs (default: 8 when run as "
                      "a script)")
  p.set_defaults(lr_warmup=0)
  return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  """The flags, with the preset's values as defaults, checked as far as they can be without
  the devices (main checks the rest with check_layout)."""
  p = build_parser()
  p.set_defaults(**PRESETS.get(preset_arg(argv), {}))
  args = p.parse_args(argv)
  check_at_least(p, args, dict(steps=1, batch=1, seq=1, hidden=1, heads=1, layers=1, ffn=1,
                               vocab=1, tp=1, seed=0, lr=0, log_every=0, cpu_devices=1))
  if args.hidden % args.heads:
    p.error(f"--hidden {args.hidden} must be divisible by --heads {args.heads}: use a --heads "
            f"that divides {args.hidden}")
  if args.impl != "auto" and args.mode != "jaxflux":
    p.error(f"--impl {args.impl} applies to --mode jaxflux only: drop --impl or use --mode "
            "jaxflux")
  if args.moe and args.fp8:
    p.error("--moe and --fp8 together are not supported: the experts' grouped GEMMs take no FP8 "
            "recipe; drop one of them")
  if args.impl == "fused" and args.dtype != "bfloat16":
    p.error(f"--impl fused needs --dtype bfloat16 (the fused kernels' dtype), not {args.dtype}: "
            "add --dtype bfloat16, or use --impl auto")
  if args.distributed not in (None, "auto"):
    try:
      parse_distributed(args.distributed)
    except ValueError as e:
      p.error(str(e))
  if args.local_device_ids is not None:
    if not args.distributed:
      p.error("--local-device-ids applies with --distributed only: add --distributed or drop it")
    if not re.fullmatch(r"\d+(,\d+)*", args.local_device_ids):
      p.error(f"--local-device-ids {args.local_device_ids!r}: expected comma-separated CUDA "
              "ordinals, e.g. 0 or 0,1")
  return args


def init_process(args) -> None:
  """Per-process JAX setup; must run before the first JAX computation."""
  if args.cpu_devices:
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  if args.distributed == "auto":
    jax.distributed.initialize()
  elif args.distributed:
    coordinator, num, pid = parse_distributed(args.distributed)
    ids = [int(i) for i in args.local_device_ids.split(",")] if args.local_device_ids else None
    jax.distributed.initialize(coordinator, num, pid, local_device_ids=ids,
                               cluster_detection_method="deactivate")


def run_model(label, args, mesh, dense, use_fp8, specs, batches, out):
  """Builds the model from `dense` (`with_fp8` if `use_fp8`), initializes it from --seed on `mesh`,
  compiles its step (before the first: no step time includes it) and trains it: (losses, timing,
  initial variables on the host, the fused-kernel calls)."""
  print_, log, log_every = out
  model, params, shardings = prepare(args, mesh, with_fp8(dense) if use_fp8 else dense, specs)
  fp8 = fp8_variables(args, model) if use_fp8 else {}
  initial = None if args.no_compare else host_copy((params, fp8), mesh)  # training donates them
  if use_fp8 and dense is flax_dense:  # Flax's FP8 backward gives its dW dot no out_sharding,
    # which JAX refuses on an Explicit axis: it trains with dp Auto instead (the same numbers).
    mesh = view = make_mesh(args.tp, AxisType.Auto)
    shardings = jax.tree.map(lambda s: NamedSharding(view, s.spec), shardings)
    params, fp8 = jax.device_put((params, fp8), (shardings, NamedSharding(view, P())))
  with jax.set_mesh(mesh):
    step, opt_state = train_state(model, optimizer(args), params, shardings, mesh)
    start = time.perf_counter()
    step = step.lower(params, opt_state, fp8, *device_batch(batches[0], mesh)).compile()
    compile_s, calls = time.perf_counter() - start, fused_calls(step.as_text())
    print_(f"[{label}] compiled in {compile_s:.2f} s; params: "
           f"{sum(x.size for x in jax.tree.leaves(params)):,}; matmuls: " + (
               "flax.linen.Dense under GSPMD" if dense is flax_dense else "fused kernels: "
               + ", ".join(f"{n} x{c}" for n, c in calls.items()) if calls
               else f"XLA path ({xla_reason(args, mesh)})"))
    losses, times = [], []
    for i, batch in enumerate(batches):  # a step's time: from the batch transfer to the loss
      start = time.perf_counter()
      params, opt_state, fp8, loss = step(params, opt_state, fp8, *device_batch(batch, mesh))
      losses.append(float(loss))
      times.append(time.perf_counter() - start)
      if i % log_every == 0 or i == len(batches) - 1:
        log(f"[{label}] step {i:4d}  loss {losses[-1]:.5f}  {1e3 * times[-1]:9.2f} ms")
  t = timing(times, args.batch * args.seq, compile_s)
  print_(f"{label}: loss {losses[0]:.4f} -> {losses[-1]:.4f}; step {t['step_ms_median']:.2f} ms "
         f"median of {t['timed_steps']} after the first, {t['tokens_per_s']:,.0f} tokens/s; "
         f"compile {compile_s:.2f} s")
  return losses, t, initial, calls


def compare(label, losses, ref_label, ref_losses, rtol, print_) -> float:
  """Prints the final losses and the curves' largest relative difference against `rtol`."""
  rel = float(np.max(np.abs(np.subtract(losses, ref_losses)) / np.abs(ref_losses)))
  print_(f"final losses: {label} {losses[-1]:.6f}  {ref_label} {ref_losses[-1]:.6f}; max "
         f"relative difference {rel:.3e} (rtol {rtol:g}): {'MATCH' if rel <= rtol else 'MISMATCH'}")
  return rel


def main(argv: Sequence[str] | None = None) -> dict:
  """Runs the example; returns both loss curves, step and compile times, the fused kernels'
  custom calls in the compiled step, and the verdict ("ok")."""
  args = parse_args(argv)
  init_process(args)
  check_layout(build_parser(), args, jax.device_count(), ("seq", "heads", "ffn"))
  try:
    return run_example(args, argv)
  except jaxflux.FusedKernelUnavailableError as e:
    # --impl fused where the fused kernels cannot run (platform, dtype, sizes): a bad flag.
    build_parser().error(f"--impl fused: {e}")


def run_example(args, argv: Sequence[str] | None) -> dict:
  """main's run, from checked flags (argv for the JSON record's command)."""
  print_ = print if jax.process_index() == 0 else (lambda *a, **k: None)
  log = (lambda s: None) if args.quiet else print_
  out = (print_, log, args.log_every if args.log_every > 0 else max(1, args.steps // 10))
  mesh = make_mesh(args.tp)
  dp, tp = mesh.shape["dp"], mesh.shape["tp"]
  mode, platform_ = args.mode, mesh.devices.flat[0].platform
  how = (f"flax.linen.Dense under GSPMD, windowed-einsum XLA_FLAGS "
         f"{'set' if windowed_flags_set() else 'NOT set (run as a script)'}"
         if mode == "windowed" else f"impl={'xla' if mode == 'xla' else args.impl}")
  print_(f"mesh: dp={dp} x tp={tp} on {platform_} ({mesh.devices.size} devices, "
         f"{jax.process_count()} process(es)), dtype={args.dtype}, mode={mode} ({how})"
         + (", FP8 recipe on the tensor-parallel projections" if args.fp8 else ""))
  batches = [synthetic_batch(args.seed, i, args.batch, args.seq, args.vocab)
             for i in range(args.steps)]
  result: dict[str, Any] = {"args": vars(args), "dp": dp, "tp": tp, "mode": mode}
  with jax.set_mesh(mesh), nn.logical_axis_rules(MOE_RULES):
    specs = param_specs(args)
    dense = flax_dense if mode == "windowed" else jaxflux_dense(
        "xla" if mode == "xla" else args.impl)
    losses, t, initial, calls = run_model(mode, args, mesh, dense, args.fp8, specs, batches, out)
    result.update({mode: losses, "losses": losses, **t, "fused_calls": calls})
    ok = all(map(math.isfinite, losses))

    if not args.no_compare:
      ref_losses, ref_t, ref_initial, _ = run_model("flax", args, mesh, flax_dense, args.fp8,
                                                    specs, batches, out)
      # The drop-in promise: same variable tree, shapes and values from the same seed.
      if jax.tree.structure(ref_initial) != jax.tree.structure(initial) or not all(
          jax.tree.leaves(jax.tree.map(np.array_equal, initial, ref_initial))):
        raise RuntimeError("the jaxflux.Dense and flax.linen.Dense models' variables differ")
      # float32 matmuls are TF32 on GPU; bfloat16 rounds differently in the row layers; FP8:
      # params that part by rounding flip FP8 roundings, and AdamW makes any change lr-sized.
      rtol = 5e-2 if args.dtype == "bfloat16" else 2e-2 if args.fp8 or platform_ != "cpu" else 1e-4
      rel = compare(mode, losses, "flax", ref_losses, rtol, print_)
      result.update(flax=ref_losses, max_rel_diff=rel, rtol=rtol,
                    flax_step_ms_median=ref_t["step_ms_median"], flax_compile_s=ref_t["compile_s"])
      if args.fp8:  # without FP8: e4m3 keeps 3 mantissa bits, the curves part by a few percent
        base, *_ = run_model(args.dtype, args, mesh, dense, False, specs, batches,
                             (print_, lambda s: None, 1))  # no step lines: keeps it short
        result.update(base=base, fp8_rel_diff=compare(f"{mode}+fp8", losses, args.dtype, base,
                                                      0.1, print_))
      ok = ok and rel <= rtol and result.get("fp8_rel_diff", 0) <= 0.1
  result["ok"] = ok
  if args.out and jax.process_index() == 0:
    write_record(args.out, sys.argv[1:] if argv is None else list(argv), result)
    print_(f"wrote {args.out} (loss curves, step times, machine, versions)")
  elif not args.out:
    print_("--out FILE.json writes the full loss curves, step times, machine and versions")
  return result


def write_record(path: str, argv: Sequence[str], result: dict) -> None:
  """The run as JSON: the command, UTC date, machine and versions, then the result."""
  versions = {"python": platform.python_version()}
  for name in ("jax", "jaxlib", "flax", "optax", "numpy", "jaxflux"):
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
      versions[name] = importlib.metadata.version(name)
  devices = jax.devices()
  record = {
      "command": f"python examples/train_tp_transformer.py {shlex.join(argv)}",
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "machine": {"platform": devices[0].platform, "device_count": len(devices),
                  "device_kinds": sorted({d.device_kind for d in devices}),
                  "process_count": jax.process_count(), "fused_kernels": jaxflux.has_cuda()},
      "versions": versions, **result}
  out = pathlib.Path(path)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
  sys.exit(0 if main()["ok"] else 1)
