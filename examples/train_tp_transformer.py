"""Train a small tensor-parallel decoder-only transformer with ``jaxflux.Dense``.

Run (CPU with 8 virtual devices, or all local GPUs)::

    PYTHONPATH=. python examples/train_tp_transformer.py            # tp = all devices
    PYTHONPATH=. python examples/train_tp_transformer.py --tp 4     # 2-way dp x 4-way tp

Or as one of several processes joined by ``jax.distributed`` (one process per GPU, or k CPU
devices each), which ``examples/launch_multiprocess.py`` starts for you on one machine::

    python examples/train_tp_transformer.py --distributed 127.0.0.1:1234,2,0 --cpu-devices 4 &
    python examples/train_tp_transformer.py --distributed 127.0.0.1:1234,2,1 --cpu-devices 4

The model is a GPT-style decoder: token embedding, ``--layers`` blocks of
[RMSNorm -> causal multi-head self-attention -> residual, RMSNorm -> MLP -> residual],
a final RMSNorm and an LM head. It trains with optax AdamW on synthetic data whose next
token is predictable from context, so the loss clearly goes down within a few dozen steps.
At the end the same model is rebuilt with ``flax.linen.Dense`` (same seed, hence the same
parameters), trained on the same batches, and the two loss curves are compared: the script
exits non-zero when they differ beyond ``--rtol`` (``--no-compare`` skips that reference run).

Modes (``--mode``), for comparing step times (issue 7)::

    --mode jaxflux    the model from jaxflux.Dense with --impl (default auto)
    --mode xla        the same model with impl="xla" (lax.all_gather / psum_scatter + dot)
    --mode windowed   the model from plain flax.linen.Dense under GSPMD (no shard_map), with
                      --xla_gpu_threshold_for_windowed_einsum_mib=0
                      --xla_gpu_multi_streamed_windowed_einsum=true added to XLA_FLAGS
                      (XLA's own collective matmul; no effect on CPU; in this mode the
                      flax reference runs under the same flags)

Each run reports its step time (median and min over the steps after ``--warmup-steps``,
default 2; a step is timed from its batch's transfer to its loss on the host), tokens/s from
the median and, where the peak is known (``--peak-tflops`` per device, default 989 on H100 /
H200 in bfloat16), MFU with model FLOPs per token = 6 x non-embedding params + 12 x layers x
hidden x seq. ``--print-hlo-collectives`` compiles the train step ahead of time and prints the
all-gather / reduce-scatter / all-reduce / custom-call counts (with custom-call targets) of
its optimized HLO.

``--preset llama70b-8l`` sets issue 7's end-to-end model (Llama-70B layer sizes, 8 layers,
sequence 4096, swiglu, bfloat16; explicit flags override it); ``--out run.json`` writes the loss
curve, step times, MFU and HLO counts with the command, date, machine and versions
(``benchmarks/train_modes.sh`` runs the three modes so, ``benchmarks/plot_losses.py`` plots them);
``--profile DIR`` traces the first step after the warm-up with jax.profiler, and
``benchmarks/profile_summary.py DIR`` says where that step's GPU time went.

Mesh: all devices (of every process) as ``('dp', 'tp')`` with ``tp = --tp`` (default: every
device) and ``dp = devices // tp``. dp is an Explicit mesh axis (the batch sharding is part of the
array types), tp an Auto one (placed by sharding constraints and by jaxflux.Dense). Sharding
layout (Megatron-style sequence parallelism; B = batch, T = sequence, C = hidden, H = heads,
D = head dim, F = MLP width, V = vocab):

=====================================  ==========================  =========================
tensor                                 global shape                partition spec
=====================================  ==========================  =========================
token ids, targets                     [B, T]                      P('dp', 'tp')
residual stream (between blocks,       [B, T, C]                   P('dp', 'tp', None)
  RMSNorm in/out, logits' input)
QKV output (column-parallel)           [B, T, H, 3, D]             P('dp', None, 'tp', ...)
attention output, out-proj input       [B, T, H*D]                 P('dp', None, 'tp')
MLP fc1 output / fc2 input             [B, T, F(, 2 for swiglu)]   P('dp', None, 'tp', ...)
logits                                 [B, T, V]                   P('dp', 'tp', None)
qkv, fc1 kernels (column)              [C, out]                    P(None, 'tp')
out, fc2 kernels (row)                 [in, C]                     P('tp', None)
embedding, norms, LM head              --                          replicated
=====================================  ==========================  =========================

So each block does: column ``jaxflux.Dense`` (all-gather tokens + GEMM, one fused op) ->
local work on whole heads / whole MLP units -> row ``jaxflux.Dense`` (GEMM +
reduce-scatter back to token shards). Everything else (norms, residual adds, embedding
lookup, LM head, loss) is local to a token shard, so those, plus the scalar loss mean, are
the only collectives in the forward pass; the backward pass runs the mirrored ops and
all-reduces the gradients of replicated params. The optimizer state is sharded like the
params, so the update needs no collective: in the jaxflux and xla modes a step compiles to
4 all-gathers and 4 reduce-scatters per layer, plus all-reduces (tests/test_example.py). The
QKV features are laid out [H, 3, D] (and swiglu's fc1 features [F, 2]) so that a contiguous
column shard holds complete heads (complete gate/up pairs): the reshape after the column
matmul needs no communication.
"""

from __future__ import annotations

import argparse
import builtins
import functools
import math
import os
import sys
import time
from typing import Any, Callable, Sequence

import jax

# Must run before any JAX backend is initialised (--cpu-devices overrides it, also before). The
# setting only affects the CPU client: on a GPU machine jax.devices() still returns the GPUs,
# so it is harmless there.
if __name__ == "__main__" and os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
    try:
        jax.config.update("jax_num_cpu_devices", 8)
    except AttributeError:  # a JAX without that option: the older XLA flag does the same
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8")

# --mode windowed: XLA's windowed einsum (its own collective matmul: the all-gather / reduce-scatter
# of a sharded dot split into a loop of collective-permutes overlapped with partial dots). XLA
# reads XLA_FLAGS once, when JAX starts its backends, so the flag is looked at here, before
# anything can start one. They are GPU flags, but the CPU build of jaxlib knows them too (XLA
# aborts on unknown flags; these are accepted and have no effect on CPU), so they are added on
# every platform.
WINDOWED_EINSUM_FLAGS = ("--xla_gpu_threshold_for_windowed_einsum_mib=0",
                         "--xla_gpu_multi_streamed_windowed_einsum=true")


def add_windowed_einsum_flags() -> None:
    """Appends WINDOWED_EINSUM_FLAGS to XLA_FLAGS (only effective before JAX starts a backend)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    os.environ["XLA_FLAGS"] = " ".join(flags + [f for f in WINDOWED_EINSUM_FLAGS
                                                if f not in flags])


def windowed_einsum_flags_set() -> bool:
    flags = os.environ.get("XLA_FLAGS", "").split()
    return all(f in flags for f in WINDOWED_EINSUM_FLAGS)


def backends_started() -> bool:
    try:
        from jax._src import xla_bridge  # private; only used to warn
        return xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):
        return True


if __name__ == "__main__":
    _early = argparse.ArgumentParser(add_help=False)
    _early.add_argument("--mode")
    if _early.parse_known_args()[0].mode == "windowed":
        add_windowed_einsum_flags()

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxflux.bench.processes import join as join_processes

# --------------------------------------------------------------------------------------------
# Dense factories: the model is written against `dense(features, tensor_parallel=..., name=...)`
# so the same code builds the jaxflux model and the flax.linen.Dense reference.
# --------------------------------------------------------------------------------------------


def jaxflux_dense(impl: str = "auto") -> Callable[..., nn.Module]:
    import jaxflux

    return functools.partial(jaxflux.Dense, impl=impl)


def flax_dense(features: int, *, tensor_parallel: str | None = None, **kwargs) -> nn.Module:
    # The reference ignores `tensor_parallel`: XLA's partitioner derives the collectives from
    # the sharding constraints the model places around each layer.
    del tensor_parallel
    return nn.Dense(features, **kwargs)


def shard_tp(x: jax.Array, *dims) -> jax.Array:
    """Constrains how x [B, ...] is sharded over tp; `dims` covers the dims after the batch.

    The batch's dp sharding is not repeated here: dp is an Explicit mesh axis, so it lives in
    the array's type and propagates by itself (with_sharding_constraint may only name Auto
    axes). tp is an Auto axis, placed by these constraints and by jaxflux.Dense.
    """
    return jax.lax.with_sharding_constraint(x, P(None, *dims))


def shard_tokens(x: jax.Array) -> jax.Array:
    """The residual-stream layout: [B, T, C] with tokens sharded over tp."""
    return shard_tp(x, "tp", None)


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Causal self-attention; heads are sharded over tp between the two projections."""

    heads: int
    dense: Callable[..., nn.Module]
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):  # x: [B, T, C], token-sharded
        b, t, c = x.shape
        d = c // self.heads
        # Column-parallel: gathers tokens, each device gets the QKV features of its heads.
        qkv = self.dense(3 * c, tensor_parallel="column", dtype=self.dtype, name="qkv")(x)
        qkv = shard_tp(qkv.reshape(b, t, self.heads, 3, d), None, "tp", None, None)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]  # [B, T, H, D] each
        # Softmax in float32 even for bfloat16 runs: the logits of a long row lose too much.
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        scores = scores / math.sqrt(d)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, c)
        out = shard_tp(out, None, "tp")
        # Row-parallel: reduces the per-head partial sums and scatters tokens back.
        return self.dense(c, tensor_parallel="row", dtype=self.dtype, name="out")(out)


class MLP(nn.Module):
    """fc1 (column) -> gelu or swiglu on local units -> fc2 (row)."""

    ffn: int
    activation: str
    dense: Callable[..., nn.Module]
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):  # x: [B, T, C], token-sharded
        b, t, c = x.shape
        if self.activation == "swiglu":
            # Features laid out [F, 2] so a column shard holds whole (gate, up) pairs.
            h = self.dense(2 * self.ffn, tensor_parallel="column", dtype=self.dtype, name="fc1")(x)
            h = shard_tp(h.reshape(b, t, self.ffn, 2), None, "tp", None)
            h = nn.silu(h[..., 0]) * h[..., 1]
        else:
            h = self.dense(self.ffn, tensor_parallel="column", dtype=self.dtype, name="fc1")(x)
            h = nn.gelu(shard_tp(h, None, "tp"))
        return self.dense(c, tensor_parallel="row", dtype=self.dtype, name="fc2")(h)


class Block(nn.Module):
    """Pre-norm residual block; input and output [B, T, C] token-sharded."""

    heads: int
    ffn: int
    activation: str
    dense: Callable[..., nn.Module]
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        h = nn.RMSNorm(dtype=self.dtype, name="norm1")(x)
        x = shard_tokens(x + Attention(self.heads, self.dense, self.dtype, name="attn")(h))
        h = nn.RMSNorm(dtype=self.dtype, name="norm2")(x)
        mlp = MLP(self.ffn, self.activation, self.dense, self.dtype, name="mlp")
        return shard_tokens(x + mlp(h))


class Transformer(nn.Module):
    """Decoder-only LM. Input token ids [B, T] sharded P('dp', 'tp'); output logits [B, T, V]."""

    vocab: int
    hidden: int
    heads: int
    layers: int
    ffn: int
    activation: str = "gelu"
    dense: Callable[..., nn.Module] = flax_dense
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.hidden, dtype=self.dtype, name="embed")
        # A plain `embed(tokens)` is ambiguous for an Explicit dp axis: name the output layout
        # (that of the tokens, i.e. batch over dp; the table is replicated).
        table = jnp.asarray(embed.embedding, self.dtype)
        batch_spec = jax.typeof(tokens).sharding.spec
        x = shard_tokens(table.at[tokens].get(out_sharding=P(*batch_spec, None)))
        for i in range(self.layers):
            x = Block(self.heads, self.ffn, self.activation, self.dense, self.dtype,
                      name=f"block{i}")(x)
        x = nn.RMSNorm(dtype=self.dtype, name="norm_f")(x)
        # Not tensor-parallel: tokens are already sharded, the (small) head is replicated.
        logits = self.dense(self.vocab, tensor_parallel=None, dtype=self.dtype, name="lm_head")(x)
        return shard_tokens(logits)


# --------------------------------------------------------------------------------------------
# Data: strided sequences x[t] = (start + stride * t) mod V with a per-sequence stride, plus
# noise. The next token depends on the previous two (through the stride), so the model has to
# use attention, and the noise keeps the achievable loss above zero.
# --------------------------------------------------------------------------------------------


def synthetic_batch(seed: int, step: int, batch: int, seq: int, vocab: int,
                    noise: float = 0.05, max_stride: int = 4) -> np.ndarray:
    """Deterministic in (seed, step): int32 [batch, seq + 1] (inputs = [:, :-1], targets = [:, 1:])."""
    rng = np.random.default_rng((seed, step))
    start = rng.integers(0, vocab, size=(batch, 1))
    stride = rng.integers(1, max_stride + 1, size=(batch, 1))
    seqs = (start + stride * np.arange(seq + 1)) % vocab
    flip = rng.random(seqs.shape) < noise
    seqs = np.where(flip, rng.integers(0, vocab, size=seqs.shape), seqs)
    return seqs.astype(np.int32)


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def make_mesh(tp: int | None) -> jax.sharding.Mesh:
    devices = jax.devices()
    tp = tp or len(devices)
    if tp < 1 or len(devices) % tp:
        raise ValueError(f"--tp {tp} must divide the number of devices ({len(devices)})")
    # dp Explicit: the batch sharding travels in the array types, so jaxflux.Dense's shard_map
    # (manual over tp) keeps the batch split; with an Auto dp axis XLA all-gathers the batch
    # over dp around every such shard_map. tp Auto: the layers and the with_sharding_constraint
    # calls place it, and the flax.linen.Dense reference gets its collectives from XLA's
    # sharding propagation.
    return jax.make_mesh((len(devices) // tp, tp), ("dp", "tp"),
                         axis_types=(AxisType.Explicit, AxisType.Auto))


def loss_fn(model: nn.Module, params, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    logits = model.apply({"params": params}, inputs)
    # Cross-entropy in float32 whatever the compute dtype; local to each token shard except
    # for the final mean.
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return losses.mean()


def init_params(model: nn.Module, seed: int, example: jax.Array):
    """Returns (params, specs): the unboxed param arrays and their PartitionSpecs.

    Specs come from the partitioning metadata the layers attach: jaxflux.Dense's give the
    column/row layouts, everything else is replicated. flax.linen.Dense attaches none (its
    params come out replicated): models built from it take the jaxflux model's specs
    (`param_specs`).
    """
    boxed = jax.jit(model.init)(jax.random.key(seed), example)["params"]
    specs = nn.get_partition_spec(boxed)
    return nn.unbox(boxed), specs


def param_specs(model: nn.Module, seed: int, example: jax.Array):
    """The PartitionSpecs `init_params` would return, without computing any params."""
    abstract = jax.eval_shape(model.init, jax.random.key(seed), example)
    return nn.get_partition_spec(abstract["params"])


def place(params, specs, mesh):
    """Puts params on the mesh by `specs`; returns (params, their NamedShardings)."""
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                             is_leaf=lambda s: isinstance(s, P))
    return jax.device_put(params, shardings), shardings


def host_copy(tree, mesh):
    """NumPy copies of a tree of global arrays, in every process.

    Under jax.distributed a process holds only its devices' shards, which jax.device_get
    refuses; one jitted identity to replicated outputs gathers the whole tree at once.
    """
    if jax.process_count() > 1:
        tree = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))(tree)
    return jax.device_get(tree)


def optimizer_shardings(tx, params, shardings, mesh):
    """Shardings of tx's state: the params' for the trees shaped like the params (AdamW's
    moments), replicated for the rest (step counts).

    Left to `jit(tx.init)`, the moments come out replicated (zeros do not inherit the params'
    sharding over an Auto axis): every device would hold whole moments and every step would
    all-gather the updated moments of each tp-sharded param.
    """
    return optax.tree_utils.tree_map_params(
        tx, lambda _, sharding: sharding, jax.eval_shape(tx.init, params), shardings,
        transform_non_params=lambda _: NamedSharding(mesh, P()))


def make_train_step(model: nn.Module, tx, shardings, opt_shardings):
    """The jitted train step (params, opt_state, inputs, targets) -> (params, opt_state, loss)."""

    @functools.partial(jax.jit, donate_argnums=(0, 1),
                       out_shardings=(shardings, opt_shardings, None))
    def step(params, opt_state, inputs, targets):
        loss, grads = jax.value_and_grad(loss_fn, argnums=1)(model, params, inputs, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def hlo_counts(hlo: str) -> dict:
    """Collective and custom-call counts of optimized HLO text (see jaxflux._hlo)."""
    from jaxflux._hlo import COLLECTIVES, count_collectives, custom_call_targets

    counts = dict.fromkeys(("all-gather", "reduce-scatter", "all-reduce"), 0)
    counts.update(count_collectives(hlo, COLLECTIVES))
    targets = custom_call_targets(hlo)
    counts["custom-call"] = sum(targets.values())
    counts["custom_call_targets"] = targets
    return counts


def format_hlo_counts(counts: dict) -> str:
    ops = ", ".join(f"{k} {v}" for k, v in counts.items() if k != "custom_call_targets")
    targets = ", ".join(f"{k} {v}" for k, v in sorted(counts["custom_call_targets"].items()))
    return f"{ops}\n  custom-call targets: {targets or '(none)'}"


def train(model: nn.Module, params, shardings, tx, batches: Sequence[np.ndarray], mesh,
          label: str, log: Callable[[str], None],
          hlo_log: Callable[[str], None] | None = None,
          profile: tuple[str, int] | None = None) -> tuple[list[float], list[float], dict]:
    """Trains for len(batches) steps; returns (losses, per-step wall seconds, HLO counts).

    A step's time runs from putting its batch on the devices to its loss on the host (reading
    the loss waits for the step), so steps do not overlap; step 0 includes compilation unless
    `hlo_log` is given. With `hlo_log`, the step is compiled ahead of time, its optimized HLO's
    collectives and custom calls are counted and passed to `hlo_log` (and returned; else {}),
    and training runs that executable. With `profile` = (directory, step), that step runs under
    jax.profiler (benchmarks/profile_summary.py reads the trace).
    """
    token_sharding = NamedSharding(mesh, P("dp", "tp"))
    opt_shardings = optimizer_shardings(tx, params, shardings, mesh)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    step = make_train_step(model, tx, shardings, opt_shardings)

    def device_batch(host_batch):
        # Split on the host: [B, T+1] would not divide over tp. Under jax.distributed every
        # process passes the same (deterministic) batch and keeps its own devices' shards.
        return jax.device_put((host_batch[:, :-1], host_batch[:, 1:]), token_sharding)

    counts = {}
    if hlo_log is not None:
        step = step.lower(params, opt_state, *device_batch(batches[0])).compile()
        counts = hlo_counts(step.as_text())
        hlo_log(f"HLO of the compiled {label} train step: {format_hlo_counts(counts)}")

    losses, times = [], []
    tokens_per_step = batches[0].shape[0] * (batches[0].shape[1] - 1)
    for i, host_batch in enumerate(batches):
        tracing = profile is not None and i == profile[1]
        if tracing:
            jax.profiler.start_trace(profile[0])
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, *device_batch(host_batch))
        losses.append(float(loss))  # waits for the step
        times.append(time.perf_counter() - start)
        if tracing:
            jax.profiler.stop_trace()
        log(f"[{label}] step {i:4d}  loss {losses[-1]:.5f}  {1e3 * times[-1]:9.2f} ms  "
            f"tokens/s {tokens_per_step / times[-1]:,.0f}")
    return losses, times, counts


# --------------------------------------------------------------------------------------------
# Timing and MFU
# --------------------------------------------------------------------------------------------


def flops_per_token(params, layers: int, hidden: int, seq: int) -> int:
    """Model FLOPs per trained token (forward + backward), as in PaLM's MFU (Chowdhery et al.
    2022, appendix B):

        6 * N + 12 * layers * hidden * seq

    N = parameter count without the embedding table (a lookup, no matmul; the untied LM head
    is a matmul and counts): each weight does a multiply-add (2 FLOPs) per token forward and
    twice that backward. The second term is attention's QK^T and PV matmuls (2 * 2 * seq *
    hidden per token and layer forward, times 3 with the backward), counted over the full
    seq x seq square although the causal mask makes half of it unnecessary (the usual
    convention). Norms, softmax, activations and the optimizer are not counted.
    """
    n = sum(x.size for k, v in params.items() if k != "embed" for x in jax.tree.leaves(v))
    return 6 * n + 12 * layers * hidden * seq


def default_peak_tflops(device_kind: str, dtype: str) -> float | None:
    """Dense bf16 peak per device where known (H100 / H200 SXM: 989 TFLOP/s), else None."""
    if dtype == "bfloat16" and ("H100" in device_kind or "H200" in device_kind):
        return 989.0
    return None


def timing(times: Sequence[float], warmup: int, tokens_per_step: int, flops: int,
           peak_tflops: float | None, devices: int) -> dict:
    """Median / min step time over the steps after the first `warmup`, tokens/s from the
    median, MFU = achieved model FLOP/s / (peak FLOP/s per device * devices) (None without a
    peak). NaNs when no step is left after the warm-up."""
    timed = list(times[warmup:])
    if not timed:
        return dict(step_ms_median=float("nan"), step_ms_min=float("nan"),
                    tokens_per_s=float("nan"), mfu=None, timed_steps=0)
    median = float(np.median(timed))
    tokens_per_s = tokens_per_step / median
    mfu = flops * tokens_per_s / (peak_tflops * 1e12 * devices) if peak_tflops else None
    return dict(step_ms_median=1e3 * median, step_ms_min=1e3 * min(timed),
                tokens_per_s=tokens_per_s, mfu=mfu, timed_steps=len(timed))


def format_timing(t: dict) -> str:
    if not t["timed_steps"]:
        return "no steps after the warm-up to time"
    text = (f"step {t['step_ms_median']:.2f} ms median, {t['step_ms_min']:.2f} ms min "
            f"(of {t['timed_steps']}), {t['tokens_per_s']:,.0f} tokens/s")
    return text + (f", MFU {100 * t['mfu']:.1f}%" if t["mfu"] is not None else "")


# Named sets of flag defaults (explicit flags still win). "llama70b-8l": issue 7's end-to-end
# model, Llama-2/3 70B layer sizes (GQA aside: full multi-head attention) cut to 8 layers and a
# 4096-token sequence so that it trains on 2 GPUs: ~7.8B params, whose float32 values and AdamW
# moments take ~47 GB per device at tp=2.
PRESETS = {
    "llama70b-8l": dict(hidden=8192, heads=64, ffn=28672, layers=8, seq=4096, batch=1,
                        activation="swiglu", vocab=32768, dtype="bfloat16", lr=1.5e-4,
                        lr_warmup=50),
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", choices=tuple(PRESETS), default=None,
                   help="a named set of model/run defaults (explicit flags override them): "
                        + "; ".join(f"{k}: {v}" for k, v in PRESETS.items()))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8, help="global batch (divisible by dp)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (divisible by tp)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=8, help="divisible by tp")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ffn", type=int, default=512, help="MLP width (divisible by tp)")
    p.add_argument("--activation", choices=("gelu", "swiglu"), default="gelu")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--tp", type=int, default=None, help="tp size (default: all devices)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lr-warmup", type=int, default=0,
                   help="steps of linear learning-rate warm-up from 0 to --lr (large models "
                        "diverge without it)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype (params stay float32)")
    p.add_argument("--mode", choices=("jaxflux", "xla", "windowed"), default="jaxflux",
                   help="jaxflux: the model from jaxflux.Dense with --impl; xla: the same with "
                        "impl='xla'; windowed: the model from flax.linen.Dense (GSPMD, no "
                        "shard_map) with XLA's windowed-einsum flags added to XLA_FLAGS")
    p.add_argument("--impl", choices=("auto", "xla", "fused"), default="auto",
                   help="jaxflux.Dense impl (--mode jaxflux)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compare", action="store_true",
                   help="skip the flax.linen.Dense reference run")
    p.add_argument("--rtol", type=float, default=None,
                   help="max |loss difference| / |loss| between the runs (default: 1e-4 for "
                        "float32 on CPU, 2e-2 for float32 on GPU (TF32 matmuls), 5e-2 bfloat16)")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    p.add_argument("--warmup-steps", type=int, default=2,
                   help="steps left out of the step-time median / min, tokens/s and MFU")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per device for MFU (default: 989 on H100 / H200 in "
                        "bfloat16, else none and no MFU)")
    p.add_argument("--print-hlo-collectives", action="store_true",
                   help="compile the train step ahead of time and print the all-gather, "
                        "reduce-scatter, all-reduce and custom-call counts of its optimized HLO")
    p.add_argument("--distributed", metavar="COORD,NUM,ID", nargs="?", const="auto",
                   help="join jax.distributed as process ID of NUM, coordinator at COORD "
                        "(host:port, process 0's); bare --distributed auto-detects them "
                        "(SLURM, Open MPI). examples/launch_multiprocess.py sets this")
    p.add_argument("--local-device-ids", default=None,
                   help="with --distributed: comma-separated CUDA ordinals this process drives "
                        "(default: all visible). examples/launch_multiprocess.py gives each "
                        "process one, keeping every GPU visible for CUDA IPC")
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="CPU devices of this process (default 8; ignored on GPU)")
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="trace the first step after the warm-up with jax.profiler into DIR "
                        "(per process under jax.distributed); summarize it with "
                        "benchmarks/profile_summary.py DIR")
    p.add_argument("--out", default=None,
                   help="write the result (loss curves, step times, HLO counts) with the "
                        "command, date, machine and versions as JSON to this path")
    preset = p.parse_known_args(argv)[0].preset
    if preset is not None:
        p.set_defaults(**PRESETS[preset])
    args = p.parse_args(argv)
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} must be divisible by --heads {args.heads}")
    if args.impl != "auto" and args.mode != "jaxflux":
        p.error(f"--impl {args.impl} applies to --mode jaxflux only (--mode {args.mode})")
    if args.warmup_steps < 0:
        p.error("--warmup-steps must be >= 0")
    if args.lr_warmup < 0:
        p.error("--lr-warmup must be >= 0")
    return args


def default_rtol(dtype: str, platform: str) -> float:
    if dtype == "bfloat16":
        return 5e-2
    return 1e-4 if platform == "cpu" else 2e-2


def init_process(args: argparse.Namespace) -> None:
    """Per-process JAX setup from the flags; must run before the first JAX operation."""
    join_processes(args.distributed, args.local_device_ids, args.cpu_devices)


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the example; returns a dict with both loss curves, timings and the verdict."""
    args = parse_args(argv)
    if args.mode == "windowed" and not windowed_einsum_flags_set():
        # Run as a script, the flags were added at import; here main() was called by other
        # code, which may or may not have started a JAX backend already.
        if backends_started():
            builtins.print("warning: --mode windowed: JAX's backends have already started, "
                           "too late to add the windowed-einsum flags to XLA_FLAGS",
                           file=sys.stderr)
        else:
            add_windowed_einsum_flags()
    init_process(args)
    # Every process runs the same program; only process 0 reports.
    print = builtins.print if jax.process_index() == 0 else (lambda *a, **k: None)
    log = (lambda s: None) if args.quiet else print
    mesh = make_mesh(args.tp)
    dp, tp = mesh.shape["dp"], mesh.shape["tp"]
    device = mesh.devices.flat[0]
    platform = device.platform
    for name, value in (("--seq", args.seq), ("--heads", args.heads), ("--ffn", args.ffn)):
        if value % tp:
            raise ValueError(f"{name} {value} must be divisible by tp={tp}")
    if args.batch % dp:
        raise ValueError(f"--batch {args.batch} must be divisible by dp={dp}")
    mode = args.mode
    if mode == "windowed":
        how = "flax.linen.Dense under GSPMD, windowed-einsum XLA_FLAGS " + (
            "set" if windowed_einsum_flags_set() else "NOT in effect")
    else:
        how = f"impl={'xla' if mode == 'xla' else args.impl}"
    print(f"mesh: dp={dp} x tp={tp} on {platform} ({mesh.devices.size} devices, "
          f"{jax.process_count()} process(es)), dtype={args.dtype}, mode={mode} ({how})")

    def build(dense):
        return Transformer(vocab=args.vocab, hidden=args.hidden, heads=args.heads,
                           layers=args.layers, ffn=args.ffn, activation=args.activation,
                           dense=dense, dtype=jnp.dtype(args.dtype))

    batches = [synthetic_batch(args.seed, i, args.batch, args.seq, args.vocab)
               for i in range(args.steps)]
    example = jnp.asarray(batches[0][:, :-1])
    lr = (optax.linear_schedule(0.0, args.lr, args.lr_warmup) if args.lr_warmup > 0
          else args.lr)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(lr, b1=0.9, b2=0.98, weight_decay=0.01))
    peak = args.peak_tflops or default_peak_tflops(device.device_kind, args.dtype)
    result: dict[str, Any] = {"args": vars(args), "dp": dp, "tp": tp, "mode": mode,
                              "peak_tflops": peak}
    tokens_per_step = args.batch * args.seq

    with jax.set_mesh(mesh):
        if mode == "windowed":
            # Plain flax.linen.Dense under GSPMD: XLA's partitioner derives the collectives
            # (and, with the flags, windows them); the layout is the jaxflux model's.
            model = build(flax_dense)
            specs = param_specs(build(jaxflux_dense("xla")), args.seed, example)
            params, _ = init_params(model, args.seed, example)
        else:
            model = build(jaxflux_dense("xla" if mode == "xla" else args.impl))
            params, specs = init_params(model, args.seed, example)
        host_params = host_copy(params, mesh)  # training donates the device copy
        flops = flops_per_token(host_params, args.layers, args.hidden, args.seq)
        result["flops_per_token"] = flops
        print(f"params: {sum(x.size for x in jax.tree.leaves(host_params)):,}; model FLOPs "
              f"per token {flops:,} (6 x non-embedding params + 12 x layers x hidden x seq)"
              + (f"; peak {peak:g} TFLOP/s per device" if peak else ""))
        params, shardings = place(params, specs, mesh)
        hlo_log = print if args.print_hlo_collectives else None
        profile = None
        if args.profile:
            where = (os.path.join(args.profile, f"process{jax.process_index()}")
                     if jax.process_count() > 1 else args.profile)
            profile = (where, min(args.warmup_steps, args.steps - 1))
        losses, times, counts = train(model, params, shardings, tx, batches, mesh, mode, log,
                                      hlo_log, profile)
        t = timing(times, args.warmup_steps, tokens_per_step, flops, peak, mesh.devices.size)
        result.update({mode: losses, "losses": losses, "step_ms": [1e3 * x for x in times],
                       **t})
        if counts:
            result["hlo_collectives"] = counts
        print(f"{mode}: loss {losses[0]:.4f} -> {losses[-1]:.4f}; {format_timing(t)}")
        ok = all(map(math.isfinite, losses))

        if not args.no_compare:
            ref_model = build(flax_dense)
            ref_params, _ = init_params(ref_model, args.seed, example)
            check_same_params(host_params, host_copy(ref_params, mesh))
            # The reference has no partitioning metadata: give it the jaxflux layout.
            ref_params, _ = place(ref_params, specs, mesh)
            ref_losses, ref_times, _ = train(ref_model, ref_params, shardings, tx, batches,
                                             mesh, "flax", log)
            ref_t = timing(ref_times, args.warmup_steps, tokens_per_step, flops, peak,
                           mesh.devices.size)
            diff = np.abs(np.subtract(losses, ref_losses))
            rel = float(np.max(diff / np.maximum(np.abs(ref_losses), 1e-12)))
            rtol = args.rtol if args.rtol is not None else default_rtol(args.dtype, platform)
            match = rel <= rtol
            ok = ok and match
            result.update(flax=ref_losses, max_abs_diff=float(np.max(diff)), max_rel_diff=rel,
                          rtol=rtol, **{f"flax_{k}": v for k, v in ref_t.items()})
            print(f"flax.linen.Dense: loss {ref_losses[0]:.4f} -> {ref_losses[-1]:.4f}; "
                  f"{format_timing(ref_t)}")
            print(f"final losses: {mode} {losses[-1]:.6f}  flax {ref_losses[-1]:.6f}; "
                  f"max |diff| over the curve {np.max(diff):.3e} (relative {rel:.3e}, "
                  f"rtol {rtol:g}): {'MATCH' if match else 'MISMATCH'}")
    result["ok"] = ok
    if args.out and jax.process_index() == 0:
        write_record(args.out, argv, result)
        print(f"wrote {args.out}")
    return result


def write_record(path: str, argv: Sequence[str] | None, result: dict) -> None:
    """The run as one JSON record in the benchmarks' format: the command that produced it, the
    knobs, date, machine and versions (jaxflux/bench/machine.py), then the result."""
    import pathlib

    from jaxflux.bench.machine import provenance
    from jaxflux.bench.output import write_json

    argv = sys.argv[1:] if argv is None else list(argv)
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {**provenance("python examples/train_tp_transformer.py", argv), **result})


def check_same_params(params, ref_params) -> None:
    """The drop-in promise: same names, shapes and (same seed) values as flax.linen.Dense."""
    if jax.tree.structure(params) != jax.tree.structure(ref_params):
        raise RuntimeError("jaxflux and flax.linen.Dense models have different param trees:\n"
                           f"{jax.tree.structure(params)}\nvs\n{jax.tree.structure(ref_params)}")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params),
                            jax.tree.leaves(ref_params)):
        if a.shape != b.shape or not np.array_equal(a, b):
            raise RuntimeError(f"param {jax.tree_util.keystr(path)} differs between the "
                               f"jaxflux and flax.linen.Dense models ({a.shape} vs {b.shape})")


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
