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
exits non-zero when they differ beyond ``--rtol``.

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
all-reduces the gradients of replicated params. The QKV features are laid out [H, 3, D] (and swiglu's fc1 features [F, 2]) so
that a contiguous column shard holds complete heads (complete gate/up pairs): the reshape
after the column matmul needs no communication.
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

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

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
    column/row layouts, everything else is replicated. flax.linen.Dense attaches none, so
    the reference run reuses the jaxflux model's specs.
    """
    boxed = jax.jit(model.init)(jax.random.key(seed), example)["params"]
    specs = nn.get_partition_spec(boxed)
    return nn.unbox(boxed), specs


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


def train(model: nn.Module, params, shardings, tx, batches: Sequence[np.ndarray], mesh,
          label: str, log: Callable[[str], None]) -> tuple[list[float], float]:
    """Trains for len(batches) steps; returns (losses, tokens/s excluding the first step)."""
    token_sharding = NamedSharding(mesh, P("dp", "tp"))
    opt_state = jax.jit(tx.init)(params)
    opt_shardings = jax.tree.map(lambda a: a.sharding, opt_state)

    @functools.partial(jax.jit, donate_argnums=(0, 1),
                       out_shardings=(shardings, opt_shardings, None))
    def step(params, opt_state, inputs, targets):
        loss, grads = jax.value_and_grad(loss_fn, argnums=1)(model, params, inputs, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses, start = [], None
    tokens_per_step = batches[0].shape[0] * (batches[0].shape[1] - 1)
    for i, host_batch in enumerate(batches):
        # Split on the host: [B, T+1] would not divide over tp. Under jax.distributed every
        # process passes the same (deterministic) batch and keeps its own devices' shards.
        inputs, targets = jax.device_put((host_batch[:, :-1], host_batch[:, 1:]), token_sharding)
        params, opt_state, loss = step(params, opt_state, inputs, targets)
        losses.append(float(loss))  # waits for the step
        if i == 0:
            start = time.perf_counter()  # step 0 includes compilation
        elapsed = time.perf_counter() - start
        rate = tokens_per_step * i / elapsed if i else float("nan")
        log(f"[{label}] step {i:4d}  loss {losses[-1]:.5f}  tokens/s {rate:,.0f}")
    elapsed = time.perf_counter() - start
    rate = tokens_per_step * (len(batches) - 1) / elapsed if len(batches) > 1 else float("nan")
    return losses, rate


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype (params stay float32)")
    p.add_argument("--impl", choices=("auto", "xla", "fused"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compare", action="store_true",
                   help="skip the flax.linen.Dense reference run")
    p.add_argument("--rtol", type=float, default=None,
                   help="max |loss difference| / |loss| between the runs (default: 1e-4 for "
                        "float32 on CPU, 2e-2 for float32 on GPU (TF32 matmuls), 5e-2 bfloat16)")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    p.add_argument("--distributed", metavar="COORD,NUM,ID", nargs="?", const="auto",
                   help="join jax.distributed as process ID of NUM, coordinator at COORD "
                        "(host:port, process 0's); bare --distributed auto-detects them "
                        "(SLURM, Open MPI). examples/launch_multiprocess.py sets this")
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="CPU devices of this process (default 8; ignored on GPU)")
    args = p.parse_args(argv)
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} must be divisible by --heads {args.heads}")
    return args


def default_rtol(dtype: str, platform: str) -> float:
    if dtype == "bfloat16":
        return 5e-2
    return 1e-4 if platform == "cpu" else 2e-2


def init_process(args: argparse.Namespace) -> None:
    """Per-process JAX setup from the flags; must run before the first JAX operation."""
    if args.cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    if args.distributed == "auto":
        jax.distributed.initialize()
    elif args.distributed:
        try:
            coordinator, num, pid = args.distributed.split(",")
            num, pid = int(num), int(pid)
        except ValueError:
            raise ValueError(f"--distributed {args.distributed!r}: expected COORD,NUM,ID, e.g. "
                             "127.0.0.1:1234,2,0") from None
        # Explicit values: no cluster auto-detection (a SLURM allocation around a local
        # launch would otherwise override them).
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num,
                                   process_id=pid, cluster_detection_method="deactivate")


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the example; returns a dict with both loss curves and the comparison verdict."""
    args = parse_args(argv)
    init_process(args)
    # Every process runs the same program; only process 0 reports.
    print = builtins.print if jax.process_index() == 0 else (lambda *a, **k: None)
    log = (lambda s: None) if args.quiet else print
    mesh = make_mesh(args.tp)
    dp, tp = mesh.shape["dp"], mesh.shape["tp"]
    platform = mesh.devices.flat[0].platform
    for name, value in (("--seq", args.seq), ("--heads", args.heads), ("--ffn", args.ffn)):
        if value % tp:
            raise ValueError(f"{name} {value} must be divisible by tp={tp}")
    if args.batch % dp:
        raise ValueError(f"--batch {args.batch} must be divisible by dp={dp}")
    print(f"mesh: dp={dp} x tp={tp} on {platform} ({mesh.devices.size} devices, "
          f"{jax.process_count()} process(es)), dtype={args.dtype}, impl={args.impl}")

    def build(dense):
        return Transformer(vocab=args.vocab, hidden=args.hidden, heads=args.heads,
                           layers=args.layers, ffn=args.ffn, activation=args.activation,
                           dense=dense, dtype=jnp.dtype(args.dtype))

    batches = [synthetic_batch(args.seed, i, args.batch, args.seq, args.vocab)
               for i in range(args.steps)]
    example = jnp.asarray(batches[0][:, :-1])
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(args.lr, b1=0.9, b2=0.98, weight_decay=0.01))
    result: dict[str, Any] = {"args": vars(args), "dp": dp, "tp": tp}

    with jax.set_mesh(mesh):
        model = build(jaxflux_dense(args.impl))
        params, specs = init_params(model, args.seed, example)
        host_params = host_copy(params, mesh)  # training donates the device copy
        print(f"params: {sum(x.size for x in jax.tree.leaves(host_params)):,}")
        params, shardings = place(params, specs, mesh)
        losses, rate = train(model, params, shardings, tx, batches, mesh, "jaxflux", log)
        result.update(jaxflux=losses, tokens_per_s=rate)
        print(f"jaxflux: loss {losses[0]:.4f} -> {losses[-1]:.4f}, {rate:,.0f} tokens/s")
        ok = all(map(math.isfinite, losses))

        if not args.no_compare:
            ref_model = build(flax_dense)
            ref_params, _ = init_params(ref_model, args.seed, example)
            check_same_params(host_params, host_copy(ref_params, mesh))
            # The reference has no partitioning metadata: give it the jaxflux layout.
            ref_params, _ = place(ref_params, specs, mesh)
            ref_losses, ref_rate = train(ref_model, ref_params, shardings, tx, batches, mesh,
                                         "flax", log)
            diff = np.abs(np.subtract(losses, ref_losses))
            rel = float(np.max(diff / np.maximum(np.abs(ref_losses), 1e-12)))
            rtol = args.rtol if args.rtol is not None else default_rtol(args.dtype, platform)
            match = rel <= rtol
            ok = ok and match
            result.update(flax=ref_losses, flax_tokens_per_s=ref_rate,
                          max_abs_diff=float(np.max(diff)), max_rel_diff=rel, rtol=rtol)
            print(f"flax.linen.Dense: loss {ref_losses[0]:.4f} -> {ref_losses[-1]:.4f}, "
                  f"{ref_rate:,.0f} tokens/s")
            print(f"final losses: jaxflux {losses[-1]:.6f}  flax {ref_losses[-1]:.6f}; "
                  f"max |diff| over the curve {np.max(diff):.3e} (relative {rel:.3e}, "
                  f"rtol {rtol:g}): {'MATCH' if match else 'MISMATCH'}")
    result["ok"] = ok
    return result


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
