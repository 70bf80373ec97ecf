"""One process of a one-process-per-GPU jaxflux run (driven by tests/test_multiprocess_gpu.py).

    python tests/multiprocess_gpu_worker.py PORT NUM_PROCESSES PROCESS_ID MODE [shared]

Joins jax.distributed on 127.0.0.1:PORT driving GPU PROCESS_ID, or GPU 0 with `shared` (every GPU
stays visible, so that CUDA IPC can map the peers' memory), then, on a ('tp',) mesh over all
processes' GPUs:
  MODE=check: the fused all_gather_matmul and matmul_reduce_scatter against float32 NumPy,
    200 back-to-back calls with fresh data and no host sync, and gradients;
  MODE=quick: each fused op once, what the quick test tier runs: MODE=check with 40
    back-to-back calls, GEMM+AllReduce at 16 and 2048 rows, one case of each op's FP8 form (as
    MODE=fp8 checks them) and the first MODE=moe case in bf16 without the back-to-back calls;
  MODE=matrix: both fused ops on every shape of shapes.json at M=1024 (and GEMM+RS at one shape
    whose partial is pushed in chunks), odd shapes, batch dims and fp16, and the gradients of
    both (each op's backward runs the other with the weight transposed), against float32 NumPy;
  MODE=matrix_pingpong: MODE=matrix with GEMM+RS's own-rows schedule forced to ping-pong
    (jaxflux.tuning.override);
  MODE=all_reduce: the fused matmul_all_reduce at decode and prefill rows (each tile forced
    once too), batch dims, fp16, gradients and back-to-back calls against float32 NumPy; each
    process prints `DIGEST <case> <sha256>` of its copy of the output, which the test compares
    across processes (every rank must hold the same bits);
  MODE=fp8: the three fused ops on FP8 operands (x e4m3 or e5m2, w e4m3 given as [n, K] with
    transpose_w=True), per-tensor scales that differ between the ranks and row-wise scales, odd
    shapes (matmul_all_reduce: M of 1, 3, 17 and 100) and batch dims, against float32 NumPy on
    the dequantized values; all_gather_matmul also returns x_full (the FP8 values, bit for
    bit), every compiled program holds the fused custom call and no XLA all-gather /
    reduce-scatter (matmul_all_reduce's: no all-reduce either), and matmul_all_reduce prints
    `DIGEST <case> <sha256>` of each process's copy, as MODE=all_reduce does;
  MODE=fuzz: the reliability fuzz of tests/fuzz_cases.py: every process draws the same random
    cases of all three fused ops (per-rank rows tile-aligned, odd or a few, K and N from 8 to
    4096, batch dims, bf16, fp16 and FP8 with per-tensor and row / column scales, transpose_w,
    return_gathered, half of them with forced kernel choices), each a fresh compile run with
    impl="fused", and checks its rank's output (every element) against the float64 reference
    of all ranks' data. The seed is fuzz_cases.DEFAULT_SEED or JAXFLUX_FUZZ_SEED;
    JAXFLUX_FUZZ_CASES narrows the cases (N: the first N of each op; ag:I, rs:I-J, ...);
    JAXFLUX_FUZZ_FORCE_CHOICES=0 keeps the tuning table's kernel choices in every case. Prints
    `FUZZ SEED <seed> CASES <n>` first, then `PASS fuzz <op> <index> <case> err=...` or
    `FAIL fuzz ...` with the environment that replays the case; a failed case does not stop
    the run;
  MODE=mlp: the MLP the layers build at tp (column-parallel all_gather_matmul, GELU,
    row-parallel matmul_reduce_scatter, impl="fused"), forward and backward (jax.vjp with a
    random cotangent) in one program, bf16 and fp16 at fuzz_cases.MLP_SHAPES, against a float64
    forward and backward (z, dx, dw1, dw2) of the global data;
  MODE=moe: the tensor-parallel MoE ops (jaxflux.all_gather_grouped_matmul, GELU,
    jaxflux.grouped_matmul_reduce_scatter, impl="fused") as one expert MLP, forward and backward
    in one program, on random routings with empty experts, odd token counts, top-1 to top-3,
    both weight layouts, bf16 and fp16 (MODE=moe_bfloat16: bf16 alone), against a float32
    dense reference of the global data
    that runs every token through every expert and picks its top-k (z, the first op's rows,
    dx, dw1, dw2, d(weights)); 20 back-to-back calls; every compiled program holds both fused
    custom calls and no XLA all-gather / reduce-scatter;
  MODE=cache: MODE=check's AG+GEMM program compiled under JAX's persistent compilation cache
    (JAX_COMPILATION_CACHE_DIR); with CACHE_DETOUR=1 a GEMM+RS program of other shapes (another
    workspace class and signature) is traced and run first. Prints `CACHE HITS <n>`, the cache
    hits of compiling that one program, and the digest of this rank's shard of its value;
  MODE=die: one call of each fused op (and the all-gather, and GEMM+RS with either reduction:
    every kind of wait in the kernels), then process 1 exits at once and every other process
    calls each again: each must fail with jaxflux's timeout error naming its op and rank,
    instead of hanging.
Prints `PASS <case>` per case and, last, `WORKER OK <process id>`.

With `shared`, every process (2, 4 or 8 of them) drives GPU 0: the ranks then share one GPU, their
kernels time-sliced, and CUDA IPC maps memory of the same device from another process. That runs
the fused ops' cross-rank protocol (pushes, flags, waits) on a one-GPU machine: correctness only
(the ranks' kernels take turns, so times mean nothing), and no XLA collective can run (NCCL
refuses two ranks on one GPU), so MODE=check skips its in-program all-gather case there. A push
between the ranks is then a copy within one device, which runs as a kernel, so the runtime gives
the fused GEMMs fewer SMs than the GPU has when ranks share it (jaxflux/ops/_config.py,
SHARED_GPU_FREE_SMS): one holding every SM while it spins on a peer's push would starve that push
(it did in a matrix run without the cap, on the chunked all-gather of rows/rank=8192). MODE=check
and MODE=quick print `RANKS PER GPU <n>`, what the runtime found.
"""
import contextlib
import hashlib
import json
import os
import pathlib
import sys
import time

import jax

PORT, NUM_PROCESSES, PROCESS_ID = map(int, sys.argv[1:4])
MODE, SCHEDULE = sys.argv[4], ""
if MODE.startswith("matrix_"):  # "matrix_pingpong": a forced schedule
  MODE, _, SCHEDULE = MODE.partition("_")
SHARED_GPU = sys.argv[5:] == ["shared"]  # every process drives GPU 0
GPU = 0 if SHARED_GPU else PROCESS_ID
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{PORT}", num_processes=NUM_PROCESSES,
                           process_id=PROCESS_ID, local_device_ids=[GPU],
                           coordinator_bind_address=f"127.0.0.1:{PORT}",
                           cluster_detection_method="deactivate", initialization_timeout=60)

print(f"joined: process {PROCESS_ID} of {NUM_PROCESSES}, devices {jax.devices()}", flush=True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxflux  # noqa: E402
from jaxflux import _runtime, tuning  # noqa: E402
from jaxflux.ops import all_gather  # noqa: E402

import fused_calls  # noqa: E402

# Every jaxflux call of this process is traced inside these overrides.
_overrides = contextlib.ExitStack()
if SCHEDULE:
  _overrides.enter_context(tuning.override("matmul_reduce_scatter", own_rows_schedule=SCHEDULE))

mesh = Mesh(np.asarray(jax.devices()), ("tp",))
tp = mesh.size
failures = []


def global_array(host, spec):
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def check(name, got, want, tol=1e-2):
  """Compares the shards this process holds with the same slices of the reference (`want`: an
  array, or a function of a shard's index giving that slice)."""
  worst = 0.0
  for shard in got.addressable_shards:
    g = np.asarray(shard.data, np.float64)
    w = np.asarray(want(shard.index) if callable(want) else want[shard.index], np.float64)
    worst = max(worst, float(np.linalg.norm(g - w) / np.linalg.norm(w)))
  if worst <= tol:
    print(f"PASS {name}", flush=True)
  else:
    failures.append(f"{name}: rel err {worst:.3g}")
    print(f"FAIL {name}: rel err {worst:.3g}", flush=True)


def operands(seed, m, k, n):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((m, k), np.float32)
  w = (rng.standard_normal((k, n), np.float32) / np.sqrt(k))
  bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
  return bf(x), bf(w)


def make_ag():
  return jax.jit(jax.shard_map(lambda x, w: jaxflux.all_gather_matmul(x, w, "tp", impl="fused"),
                               mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                               out_specs=P(None, "tp")))


ag = make_ag()
rs = jax.jit(jax.shard_map(lambda x, w: jaxflux.matmul_reduce_scatter(x, w, "tp", impl="fused"),
                           mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
                           out_specs=P("tp", None)))
bf16 = lambda a, spec: global_array(a.astype(jnp.bfloat16), spec)  # noqa: E731


def run_check(calls=200):
  """Traced under jax.set_mesh: the ops take their peers' slots from a constant table."""
  x, w = operands(1, 256 * tp, 512, 384 * tp)
  check("all_gather_matmul value", ag(bf16(x, P("tp", None)), bf16(w, P(None, "tp"))), x @ w)
  x, w = operands(2, 256 * tp, 512 * tp, 384)
  check("matmul_reduce_scatter value", rs(bf16(x, P(None, "tp")), bf16(w, P("tp", None))), x @ w)

  outs, refs = [], []
  for i in range(calls):  # back to back, fresh data, no host sync
    x, w = operands(100 + i, 128 * tp, 256, 128 * tp)
    outs.append(ag(bf16(x, P("tp", None)), bf16(w, P(None, "tp"))))
    refs.append(x @ w)
  for i in range(0, calls, 17):
    check(f"back-to-back call {i}", outs[i], refs[i])

  x, w = operands(3, 128 * tp, 256, 128 * tp)
  ct = np.random.default_rng(4).standard_normal((128 * tp, 128 * tp)).astype(np.float32)
  # The cotangent is an argument: a jitted function may not close over an array that spans
  # other processes' devices.
  loss = lambda x, w, ct: jnp.sum(ag(x, w).astype(jnp.float32) * ct)  # noqa: E731
  dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(bf16(x, P("tp", None)), bf16(w, P(None, "tp")),
                                                   global_array(ct, P(None, "tp")))
  check("gradient x", dx, ct @ w.T)
  check("gradient w", dw, x.T @ ct)


def run_quick():
  """Each fused op once (MODE=quick): MODE=check's values, gradients and 40 back-to-back calls,
  GEMM+AllReduce at decode and prefill rows, each op's FP8 form, and the MoE ops' expert MLP
  forward and backward."""
  run_check(calls=40)
  k = 1024 * tp
  check_op("ar", "decode M=16", (16, k), (k, 2048))
  check_op("ar", "prefill M=2048", (2048, k), (k, 2048))
  check_fp8_ag("e4m3", "tensor", (), 200, 272, 144)
  check_fp8_rs("e5m2", "rowwise", (), 400, 272, 144)
  check_fp8_ar("e4m3", "rowwise", (), 17, 512, 384)
  run_moe((jnp.bfloat16,), cases=MOE_CASES[:1], back_to_back=False)


def run_check_gathered_slots():
  """Traced without jax.set_mesh: the slots come from jaxflux_device_slot + an all-gather."""
  gathered = make_ag()
  x, w = operands(6, 128 * tp, 256, 128 * tp)
  check("all_gather_matmul value, slots gathered in the program",
        gathered(bf16(x, P("tp", None)), bf16(w, P(None, "tp"))), x @ w)


def op_fn(op, batch_ndim):
  """The fused op on a ('tp',) mesh, operands with `batch_ndim` leading batch dims."""
  b = (None,) * batch_ndim
  if op == "ag":
    f = lambda x, w: jaxflux.all_gather_matmul(x, w, "tp", impl="fused")  # noqa: E731
    specs = (P(*b, "tp", None), P(None, "tp")), P(*b, None, "tp")
  elif op == "ar":  # the output is replicated: each process holds its rank's whole copy
    f = lambda x, w: jaxflux.matmul_all_reduce(x, w, "tp", impl="fused")  # noqa: E731
    specs = (P(*b, None, "tp"), P("tp", None)), P()
  else:
    f = lambda x, w: jaxflux.matmul_reduce_scatter(x, w, "tp", impl="fused")  # noqa: E731
    specs = (P(*b, None, "tp"), P("tp", None)), P(*b, "tp", None)
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs[0], out_specs=specs[1])), specs


def check_op(op, name, x_shape, w_shape, dtype=jnp.bfloat16, grads=False):
  """One fused op on fresh random operands against float32 NumPy (and its gradients)."""
  seed = sum(x_shape) * 7 + sum(w_shape)
  rng = np.random.default_rng(seed)
  cast = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))  # noqa: E731
  x = cast(rng.standard_normal(x_shape, np.float32))
  w = cast(rng.standard_normal(w_shape, np.float32) / np.sqrt(w_shape[0]))
  f, ((x_spec, w_spec), out_spec) = op_fn(op, len(x_shape) - 2)
  xs, ws = global_array(x.astype(dtype), x_spec), global_array(w.astype(dtype), w_spec)
  tol = 1e-2 if dtype == jnp.bfloat16 else 5e-3
  # Only this process's output slice: index (*batch, rows, cols) is x[*batch, rows] @ w[:, cols].
  out = f(xs, ws)
  check(f"{op} {name}", out, lambda i: x[i[:-1] + (slice(None),)] @ w[:, i[-1]], tol)
  if op == "ar":
    print_digest(name, out)
  if grads:
    ct = rng.standard_normal(x_shape[:-1] + w_shape[-1:]).astype(np.float32)
    loss = lambda x, w, ct: jnp.sum(f(x, w).astype(jnp.float32) * ct)  # noqa: E731
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(xs, ws, global_array(ct, out_spec))
    check(f"{op} {name} gradient x", dx, ct @ w.T, tol)
    check(f"{op} {name} gradient w", dw, np.einsum("...mk,...mn->kn", x, ct), tol)


def print_digest(name, out):
  """`DIGEST <name> <sha256>` of this process's copy of a replicated output: the test compares
  them across processes (every rank must hold the same bits)."""
  for shard in out.addressable_shards:
    data = np.ascontiguousarray(np.asarray(shard.data))
    print(f"DIGEST {name} {hashlib.sha256(data.tobytes()).hexdigest()}", flush=True)


def run_cache():
  """MODE=cache (see the module's docstring)."""
  hits = []
  jax.monitoring.register_event_listener(
      lambda event, **kwargs: hits.append(event)
      if event == "/jax/compilation_cache/cache_hits" else None)
  if os.environ.get("CACHE_DETOUR") == "1":
    x, w = operands(9, 512 * tp, 256 * tp, 640)
    check("detour matmul_reduce_scatter value",
          rs(bf16(x, P(None, "tp")), bf16(w, P("tp", None))), x @ w)
  x, w = operands(1, 256 * tp, 512, 384 * tp)
  args = bf16(x, P("tp", None)), bf16(w, P(None, "tp"))
  before = len(hits)
  compiled = ag.lower(*args).compile()
  print(f"CACHE HITS {len(hits) - before}", flush=True)
  out = compiled(*args)
  check("cached all_gather_matmul value", out, x @ w)
  print_digest("cache ag", out)  # this rank's shard: the same bits in every run


def run_matrix():
  shapes = json.loads((pathlib.Path(__file__).resolve().parents[1] / "benchmarks" /
                       "shapes.json").read_text())
  m = 1024
  for s in shapes["ag_gemm"]:
    check_op("ag", f"{s['name']} M={m}", (m, s["K"]), (s["K"], s["N"]))
  for s in shapes["gemm_rs"]:
    check_op("rs", f"{s['name']} M={m}", (m, s["K"]), (s["K"], s["N"]))
  # A partial big enough to be pushed in row chunks (the epilogue waits per chunk), where
  # GEMM+RS also chooses ping-pong own rows (K_local 4096).
  check_op("rs", "llama70b-out M=8192", (8192, 8192), (8192, 8192))
  for dtype in (jnp.bfloat16, jnp.float16):
    dt = jnp.dtype(dtype).name
    # rows per rank not a multiple of the tile, one row per rank, batch dims, several chunks
    for rows, k, n, batch in ((200, 256, 512, ()), (1, 64, 64, ()), (7, 96, 40, (2, 3)),
                              (8192, 1024, 512, ())):
      check_op("ag", f"{dt} rows/rank={rows} K={k} N={n} batch={batch}",
               batch + (tp * rows, k), (k, n * tp), dtype)
    for rows, k, n, batch in ((200, 256, 512, ()), (1, 64, 64, ()), (7, 96, 40, (2, 3)),
                              (1024, 256, 2048, (2,))):
      check_op("rs", f"{dt} rows/rank={rows} K={k} N={n} batch={batch}",
               batch + (tp * rows, k * tp), (k * tp, n), dtype)
  # Each op's backward runs the other fused op with the weight read transposed (K-major).
  check_op("ag", "grads", (tp * 384, 1024), (1024, 512 * tp), grads=True)
  check_op("rs", "grads", (tp * 384, 1024 * tp), (1024 * tp, 512), grads=True)
  check_op("ag", "grads M=1024 llama70b-qkv", (1024, 8192), (8192, 10240), grads=True)
  check_op("rs", "grads M=1024 llama70b-out", (1024, 8192), (8192, 8192), grads=True)


def run_all_reduce():
  """GEMM+AllReduce: decode rows (stream-K, pushed whole) and prefill rows (the stock tile,
  pushed in chunks), each with the other tile forced once, odd shapes, batch dims (pushed
  whole), fp16, gradients and back-to-back calls."""
  k = 1024 * tp
  check_op("ar", "decode M=16", (16, k), (k, 2048))
  check_op("ar", "prefill M=2048", (2048, k), (k, 2048))
  check_op("ar", "llama70b-out M=256", (256, 8192), (8192, 8192))
  for tile, m in (("cooperative_128x256_cluster2x1", 16), ("cooperative_128x128_streamk", 2048)):
    with tuning.override("matmul_all_reduce", tile=tile):  # check_op traces inside the block
      check_op("ar", f"{tile} M={m}", (m, k), (k, 2048))
  for dtype in (jnp.bfloat16, jnp.float16):
    dt = jnp.dtype(dtype).name
    for rows, kl, n, batch in ((200, 256, 512, ()), (1, 64, 64, ()), (7, 96, 40, (2, 3)),
                               (512, 128, 256, (4,))):
      check_op("ar", f"{dt} M={rows} K/rank={kl} N={n} batch={batch}",
               batch + (rows, kl * tp), (kl * tp, n), dtype)
  check_op("ar", "grads", (384, k), (k, 512), grads=True)

  f, ((x_spec, w_spec), _) = op_fn("ar", 0)
  outs, refs = [], []
  for i in range(50):  # back to back, fresh data, no host sync
    x, w = operands(300 + i, 128, 256 * tp, 256)
    outs.append(f(bf16(x, x_spec), bf16(w, w_spec)))
    refs.append(x @ w)
  for i in range(0, 50, 7):
    check(f"ar back-to-back call {i}", outs[i], refs[i])


FP8_FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def quantize(a, scale, dtype):
  """a / scale rounded to the FP8 `dtype` (NumPy, ml_dtypes), clipped to its range."""
  fmax = float(jnp.finfo(dtype).max)
  return np.clip(a / scale, -fmax, fmax).astype(dtype)


def amax_scale(a, dtype, axis=None):
  """The scale putting the largest magnitude of `a` (along `axis`) on the format's largest."""
  return (np.abs(a).max(axis=axis, keepdims=axis is not None) / float(jnp.finfo(dtype).max)
          ).astype(np.float32)


def compiled(f, args):
  """f compiled for args: the test reads its HLO and runs it (one compile for both)."""
  return f.lower(*args).compile()


def check_fp8_hlo(name, program, target, forbidden=("all-gather", "reduce-scatter")):
  """The compiled program runs the fused custom call and none of the `forbidden` XLA
  collectives (the scales too travel inside the kernel)."""
  import hlo_util  # tests/ is this script's folder
  text = program.as_text()
  targets, counts = hlo_util.custom_call_targets(text), hlo_util.count_collectives(text)
  if any(t.startswith(target) for t in targets) and not any(counts.get(c) for c in forbidden):
    print(f"PASS {name} hlo", flush=True)
  else:
    failures.append(f"{name} hlo: custom calls {targets}, collectives {counts}")
    print(f"FAIL {name} hlo: custom calls {targets}, collectives {counts}", flush=True)


def check_fp8_ag(fmt, kind, batch, m, k, n):
  """all_gather_matmul: rank r's rows are scaled by 4^r before quantizing, so the per-tensor
  x_scale differs between ranks and each shard must keep its own."""
  name = f"fp8 ag x={fmt} scales={kind} batch={batch} rows/rank={m} K={k} n={n}"
  rng = np.random.default_rng(len(name) + m + k)
  dtype, rows, cols = FP8_FORMATS[fmt], tp * m, tp * n
  x = rng.standard_normal(batch + (rows, k)).astype(np.float32)
  x *= (4.0 ** (np.arange(rows) // m) / 2)[:, None]
  wt = (rng.standard_normal((cols, k)) / np.sqrt(k)).astype(np.float32)
  b = (None,) * len(batch)
  if kind == "rowwise":  # magnitudes spread over 2^±4 per row of x and per output column
    x *= 2.0 ** rng.uniform(-4, 4, batch + (rows, 1))
    wt *= 2.0 ** rng.uniform(-4, 4, (cols, 1))
    x_scale, x_rows, xs_spec = (amax_scale(x, dtype, -1),) * 2 + (P(*b, "tp", None),)
    w_cols = amax_scale(wt, jnp.float8_e4m3fn, 1)[:, 0]
    w_scale, ws_spec = w_cols[None], P(None, "tp")
  else:  # one scale per rank for x (shape (1,) on each), one for w
    x_scale = np.stack([amax_scale(x[..., r * m:(r + 1) * m, :], dtype) for r in range(tp)])
    x_rows, xs_spec = np.repeat(x_scale, m)[:, None], P("tp")
    w_scale, ws_spec = amax_scale(wt, jnp.float8_e4m3fn).reshape(1), P()
    w_cols = np.full((cols,), w_scale[0], np.float32)
  x8, wt8 = quantize(x, x_rows, dtype), quantize(wt, w_cols[:, None], jnp.float8_e4m3fn)
  want = (x8.astype(np.float64) * x_rows) @ (wt8.astype(np.float64) * w_cols[:, None]).T

  def body(x, wt, xs, ws):
    y, x_full = jaxflux.all_gather_matmul(x, wt, "tp", impl="fused", x_scale=xs, w_scale=ws,
                                          transpose_w=True, return_gathered=True)
    return y, x_full[None]

  f = shard_mapped(body, (P(*b, "tp", None), P("tp", None), xs_spec, ws_spec),
                   (P(*b, None, "tp"), P("tp")))
  args = (global_array(x8, P(*b, "tp", None)), global_array(wt8, P("tp", None)),
          global_array(x_scale, xs_spec), global_array(w_scale, ws_spec))
  program = compiled(f, args)
  y, x_full = program(*args)
  check(name, y, want, tol=5e-3)
  same = all(np.array_equal(np.asarray(s.data).astype(np.float32), x8[None].astype(np.float32))
             for s in x_full.addressable_shards)
  if same and x_full.dtype == dtype:
    print(f"PASS {name} x_full", flush=True)
  else:
    failures.append(f"{name} x_full: not x's FP8 values ({x_full.dtype})")
    print(f"FAIL {name} x_full ({x_full.dtype})", flush=True)
  check_fp8_hlo(name, program, "jaxflux_all_gather_matmul")


def fp8_k_split(name, fmt, kind, batch, rows, k, n):
  """Operands of an op with K split over the ranks (matmul_reduce_scatter, matmul_all_reduce):
  every scale differs between the ranks (each quantizes its own slice of K; rank r's slice of x
  is scaled by 4^r first), per tensor or per row / column. Returns the global arguments, their
  in_specs and the float64 sum of the ranks' dequantized products."""
  rng = np.random.default_rng(len(name) + rows + k)
  dtype, kk = FP8_FORMATS[fmt], tp * k
  x = rng.standard_normal(batch + (rows, kk)).astype(np.float32)
  x *= (4.0 ** (np.arange(kk) // k) / 2)[None, :]
  wt = (rng.standard_normal((n, kk)) / np.sqrt(kk)).astype(np.float32)
  b = (None,) * len(batch)
  if kind == "rowwise":
    x *= 2.0 ** rng.uniform(-4, 4, batch + (rows, 1))
    wt *= 2.0 ** rng.uniform(-4, 4, (n, 1))
  want = 0.0
  x8, wt8, x_scale, w_scale = [], [], [], []
  for r in range(tp):  # rank r's slice of K, quantized with its own scales
    xr, wr = x[..., r * k:(r + 1) * k], wt[:, r * k:(r + 1) * k]
    axes = (-1, 1) if kind == "rowwise" else (None, None)
    xs, ws = amax_scale(xr, dtype, axes[0]), amax_scale(wr, jnp.float8_e4m3fn, axes[1])
    x8.append(quantize(xr, xs, dtype))
    wt8.append(quantize(wr, ws, jnp.float8_e4m3fn))
    x_scale.append(xs)
    w_scale.append(ws)
    want = want + (x8[-1].astype(np.float64) * xs) @ (wt8[-1].astype(np.float64) * ws).T
  x8, wt8 = np.concatenate(x8, -1), np.concatenate(wt8, -1)
  if kind == "rowwise":  # [..., M, tp] and [tp, N]: rank r holds [..., M, 1] and [1, N]
    x_scale, xs_spec = np.concatenate(x_scale, -1), P(*b, None, "tp")
    w_scale, ws_spec = np.concatenate([ws.T for ws in w_scale], 0), P("tp", None)
  else:  # (tp,): rank r holds (1,)
    x_scale, w_scale = np.stack(x_scale), np.stack(w_scale)
    xs_spec = ws_spec = P("tp")
  in_specs = (P(*b, None, "tp"), P(None, "tp"), xs_spec, ws_spec)
  args = tuple(global_array(a, spec) for a, spec in zip((x8, wt8, x_scale, w_scale), in_specs))
  return args, in_specs, want


def check_fp8_rs(fmt, kind, batch, rows, k, n):
  """matmul_reduce_scatter on fp8_k_split's operands."""
  name = f"fp8 rs x={fmt} scales={kind} batch={batch} M={rows} k/rank={k} N={n}"
  args, in_specs, want = fp8_k_split(name, fmt, kind, batch, rows, k, n)
  body = lambda x, wt, xs, ws: jaxflux.matmul_reduce_scatter(  # noqa: E731
      x, wt, "tp", impl="fused", x_scale=xs, w_scale=ws, transpose_w=True)
  program = compiled(shard_mapped(body, in_specs, P(*(None,) * len(batch), "tp", None)), args)
  # The kernel sums bfloat16 partials: one more rounding than the output's.
  check(name, program(*args), want, tol=5e-3)
  check_fp8_hlo(name, program, "jaxflux_matmul_reduce_scatter")


def check_fp8_ar(fmt, kind, batch, rows, k, n):
  """matmul_all_reduce on fp8_k_split's operands: every process checks its whole copy of the
  sum and prints its digest; the program holds no XLA all-reduce."""
  name = f"fp8 ar x={fmt} scales={kind} batch={batch} M={rows} k/rank={k} N={n}"
  args, in_specs, want = fp8_k_split(name, fmt, kind, batch, rows, k, n)
  body = lambda x, wt, xs, ws: jaxflux.matmul_all_reduce(  # noqa: E731
      x, wt, "tp", impl="fused", x_scale=xs, w_scale=ws, transpose_w=True)
  program = compiled(shard_mapped(body, in_specs, P()), args)
  out = program(*args)
  # The kernel sums bfloat16 partials, as GEMM+RS's does.
  check(name, out, want, tol=5e-3)
  if out.dtype != jnp.bfloat16 or out.shape != want.shape:
    failures.append(f"{name}: output {out.dtype} {out.shape}, want bfloat16 {want.shape}")
    print(f"FAIL {name} output {out.dtype} {out.shape}", flush=True)
  print_digest(name, out)
  check_fp8_hlo(name, program, "jaxflux_matmul_all_reduce",
                forbidden=("all-gather", "reduce-scatter", "all-reduce"))


# matmul_all_reduce's FP8 cases: (batch, M, k per rank, N); M odd (one row: decode) or batched.
FP8_AR_SHAPES = (((), 1, 256, 384), ((), 3, 272, 144), ((), 17, 512, 384), ((), 100, 256, 128),
                 ((2,), 64, 256, 128))


def run_fp8():
  for fmt in FP8_FORMATS:
    for kind in ("tensor", "rowwise"):
      for batch, m, k, n in (((), 256, 512, 384), ((), 200, 272, 144), ((2,), 128, 256, 128)):
        check_fp8_ag(fmt, kind, batch, m, k, n)
      for batch, rows, k, n in (((), 512, 512, 384), ((), 400, 272, 144), ((2,), 256, 256, 128)):
        check_fp8_rs(fmt, kind, batch, rows, k, n)
      for batch, rows, k, n in FP8_AR_SHAPES:
        check_fp8_ar(fmt, kind, batch, rows, k, n)


def run_fuzz():
  """Every case of fuzz_cases.from_env, recorded and listed, never stopping at a failure. A
  kernel's recorded error (a timeout) is collected after each case, so it fails that case."""
  import fuzz_cases  # tests/ is this script's folder
  jaxflux.configure(timeout_s=15.0)  # a hung case then costs 15 s, not the default 30
  seed, cases = fuzz_cases.from_env(tp)
  print(f"FUZZ SEED {seed} CASES {len(cases)}", flush=True)
  start = time.monotonic()
  for case in cases:
    name = f"fuzz {case.op} {case.index} {case.describe()}"
    try:
      shards = fuzz_cases.make_shards(case)
      outs = fuzz_cases.run_case(case, shards, mesh, impl="fused")
      _runtime.check_errors()
      # The reference comes after the run: an error in it fails this case without leaving the
      # peer waiting in the kernel for this rank.
      verdicts = [fuzz_cases.check(fuzz_cases.reference(case, shards, rank), got)
                  for rank, got in sorted(outs.items())]
      failed = [v for v in verdicts if not v.ok]
      verdict = failed[0] if failed else max(verdicts, key=lambda v: v.err / v.bound)
    except Exception as e:  # noqa: BLE001 - listed as this case's failure; the run goes on
      with contextlib.suppress(Exception):
        _runtime.check_errors()  # a recorded error belongs to this case, not the next
      verdict = fuzz_cases.Verdict(False, float("nan"), float("nan"),
                                   f"{type(e).__name__}: {' '.join(str(e).split())[:400]}")
    if verdict.ok:
      print(f"PASS {name} {verdict}", flush=True)
    else:
      failures.append(f"{name}: {verdict.detail} (replay: {case.replay()})")
      print(f"FAIL {name} {verdict}; replay: {case.replay()}", flush=True)
  print(f"FUZZ DONE {len(cases)} cases, {len(failures)} failed, "
        f"{time.monotonic() - start:.0f} s (seed {seed})", flush=True)


def run_mlp():
  """The tensor-parallel MLP, forward and backward in one shard_map: its only communication is
  the fused ops' own (two ranks on one GPU have no NCCL)."""
  import fuzz_cases
  for dtype in ("bfloat16", "float16"):
    for i, (batch, m, d, h) in enumerate(fuzz_cases.MLP_SHAPES):
      h = h * tp // 2  # H is given at tp=2: every rank keeps the columns it has there
      name = f"mlp {dtype} batch={batch} rows/rank={m} D={d} H={h}"
      data = fuzz_cases.mlp_data(100 + i, batch, tp * m, d, h, dtype)
      want = fuzz_cases.mlp_reference(**data)
      b = (None,) * len(batch)
      tokens, cols, rows = P(*b, "tp", None), P(None, "tp"), P("tp", None)
      specs = {"x": tokens, "w1": cols, "w2": rows, "ct": tokens}
      f = shard_mapped(lambda *a: fuzz_cases.mlp_with_grads(*a, impl="fused"),
                       tuple(specs.values()), (tokens, tokens, cols, rows))
      outs = f(*(global_array(data[k].astype(fuzz_cases.DTYPES[dtype]), spec)
                 for k, spec in specs.items()))
      for out_name, out in zip(("z", "dx", "dw1", "dw2"), outs):
        verdicts = [fuzz_cases.mlp_check(s.data, want[out_name][s.index], dtype)
                    for s in out.addressable_shards]
        verdict = next((v for v in verdicts if not v.ok), verdicts[0])
        if verdict.ok and out.dtype == jnp.dtype(dtype):
          print(f"PASS {name} {out_name} {verdict}", flush=True)
        else:
          failures.append(f"{name} {out_name}: {verdict} ({out.dtype})")
          print(f"FAIL {name} {out_name} {verdict} ({out.dtype})", flush=True)


def moe_data(seed, m, k, n, out, experts, topk, dtype):
  """Global operands of an expert MLP at tp ranks of m tokens: x [tp*m, k], w1 [G, k, n],
  w2 [G, n, out], the router's picks ids [tp*m, topk] (distinct experts per token, drawn from
  the first experts only, so that the last ones get no rows) and weights [tp*m, topk]."""
  rng = np.random.default_rng(seed)
  cast = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))  # noqa: E731
  used = max(topk, experts - 2)  # the last two experts stay empty
  ids = np.stack([rng.permutation(used)[:topk] for _ in range(tp * m)]).astype(np.int32)
  return dict(x=cast(rng.standard_normal((tp * m, k))),
              w1=cast(rng.standard_normal((experts, k, n)) / np.sqrt(k)),
              w2=cast(rng.standard_normal((experts, n, out)) / np.sqrt(n)),
              ids=ids.reshape(tp * m, topk),
              weights=rng.uniform(0.1, 1.0, (tp * m, topk)).astype(np.float32))


def moe_reference(x, w1, w2, ids, weights, ct):
  """(z, rows' products y, dx, dw1, dw2, dweights) in float32 on the CPU: every token through
  every expert, then each token's top-k picked and weighted (no routing, no sort, no grouped
  GEMM). y: segment p's rows are rank p's (token, k) pairs sorted by expert (stable)."""
  def mlp(x, w1, w2, weights):
    hidden = jnp.einsum("tk,gkn->tgn", x, w1)
    every = jnp.einsum("tgn,gno->tgo", jax.nn.gelu(hidden, approximate=True), w2)
    picked = jnp.take_along_axis(every, ids[:, :, None], axis=1)  # [t, topk, out]
    return jnp.einsum("tj,tjo->to", weights, picked), hidden
  with jax.default_device(jax.devices("cpu")[0]):
    z, hidden = mlp(x, w1, w2, weights)
    grads = jax.grad(lambda *a: jnp.sum(mlp(*a)[0] * ct), argnums=(0, 1, 2, 3))(
        x, w1, w2, weights)
  m = x.shape[0] // tp
  topk = ids.shape[1]
  rows = []
  for p in range(tp):
    pairs = ids[p * m:(p + 1) * m].reshape(-1)
    order = np.argsort(pairs, kind="stable")
    rows.append(np.asarray(hidden)[p * m + order // topk, pairs[order]])
  return (np.asarray(z), np.concatenate(rows)) + tuple(np.asarray(g) for g in grads)


MOE_CASES = [  # (m tokens per rank, k, n, out, experts, topk, transpose_w)
    (64, 256, 256, 256, 6, 2, False),
    (13, 128, 128, 64, 8, 1, False),
    (40, 128, 256, 128, 5, 3, True),
    (128, 512, 512, 256, 8, 2, True),
]


def run_moe(dtypes, cases=MOE_CASES, back_to_back=True):
  """The MoE MLP on the fused MoE ops, forward and backward in one program (see MODE=moe), in
  each of `dtypes`; with `back_to_back`, the first case's forward 20 times more."""
  for dtype in dtypes:
    for i, (m, k, n, out, experts, topk, tw) in enumerate(cases):
      name = f"moe {jnp.dtype(dtype).name} m={m} k={k} n={n} out={out} G={experts} top{topk}" + (
          " transpose_w" if tw else "")
      d = moe_data(200 + i, m, k, n, out, experts, topk, dtype)
      ct = np.random.default_rng(300 + i).standard_normal((tp * m, out)).astype(np.float32)
      want = moe_reference(d["x"], d["w1"], d["w2"], d["ids"], d["weights"], ct)
      w1 = d["w1"].transpose(0, 2, 1) if tw else d["w1"]
      w2 = d["w2"].transpose(0, 2, 1) if tw else d["w2"]
      w1_spec = P(None, "tp", None) if tw else P(None, None, "tp")
      w2_spec = P(None, None, "tp") if tw else P(None, "tp", None)

      def model(x, w1, w2, ids_all, weights):
        routing = jaxflux.moe_routing(ids_all, experts, "tp", gathered=True)
        y = jaxflux.all_gather_grouped_matmul(x, w1, routing, axis_name="tp", impl="fused",
                                              transpose_w=tw)
        h = jax.nn.gelu(y.astype(jnp.float32), approximate=True).astype(y.dtype)
        z = jaxflux.grouped_matmul_reduce_scatter(h, w2, routing, weights, axis_name="tp",
                                                  impl="fused", transpose_w=tw)
        return z, y

      def step(x, w1, w2, ids_all, weights, ct):
        (z, y), vjp = jax.vjp(lambda *a: model(*a, ids_all, weights), x, w1, w2)
        dx, dw1, dw2 = vjp((ct.astype(z.dtype), jnp.zeros_like(y)))
        dweights = jax.grad(lambda wt: jnp.sum(
            model(x, w1, w2, ids_all, wt)[0].astype(jnp.float32) * ct))(weights)
        return z, y, dx, dw1, dw2, dweights

      tokens = P("tp", None)
      in_specs = (tokens, w1_spec, w2_spec, P(), tokens, tokens)
      out_specs = (tokens, P(None, "tp"), tokens, w1_spec, w2_spec, tokens)
      f = shard_mapped(step, in_specs, out_specs)
      args = (global_array(d["x"].astype(dtype), tokens), global_array(w1.astype(dtype), w1_spec),
              global_array(w2.astype(dtype), w2_spec),
              global_array(d["ids"].reshape(tp, m, topk), P()),
              global_array(d["weights"], tokens), global_array(ct, tokens))
      program = compiled(f, args)
      hlo = program.as_text()
      targets = ("jaxflux_all_gather_grouped_matmul",
                 "jaxflux_grouped_matmul_reduce_scatter")
      if all(t in hlo for t in targets) and not any(
          c in hlo for c in ("all-gather-start", "all-gather(", "reduce-scatter(")):
        print(f"PASS {name} hlo", flush=True)
      else:
        failures.append(f"{name}: the program lacks a fused call or has an XLA collective")
        print(f"FAIL {name} hlo", flush=True)
      outs = program(*args)
      z_want, y_want, dx, dw1, dw2, dweights = want
      dw1 = dw1.transpose(0, 2, 1) if tw else dw1
      dw2 = dw2.transpose(0, 2, 1) if tw else dw2
      for out_name, got, ref in zip(("z", "y", "dx", "dw1", "dw2", "dweights"), outs,
                                    (z_want, y_want, dx, dw1, dw2, dweights)):
        check(f"{name} {out_name}", got, ref, tol=2e-2)
      if i == 0 and back_to_back:
        fwd = shard_mapped(lambda *a: model(*a)[0], in_specs[:5], tokens)
        results, refs = [], []
        for j in range(20):  # back to back, fresh data, no host sync
          dj = moe_data(400 + j, m, k, n, out, experts, topk, dtype)
          results.append(fwd(global_array(dj["x"].astype(dtype), tokens),
                             global_array(dj["w1"].astype(dtype), w1_spec),
                             global_array(dj["w2"].astype(dtype), w2_spec),
                             global_array(dj["ids"].reshape(tp, m, topk), P()),
                             global_array(dj["weights"], tokens)))
          refs.append(dj)
        for j in range(0, 20, 6):
          zj = moe_reference(refs[j]["x"], refs[j]["w1"], refs[j]["w2"], refs[j]["ids"],
                             refs[j]["weights"], ct)[0]
          check(f"{name} back-to-back call {j}", results[j], zj, tol=2e-2)


def moe_layer_reference(params, x, topk, activation, ct):
  """(y, the load-balancing loss, d params, dx) of a dense float32 top-k expert MLP on the CPU:
  every token through every expert, then its top k weighted (renormalized for k > 1), as
  jaxflux.MoE computes it; the gradients of sum(y * ct) + the load-balancing loss, Switch
  Transformer's E * sum_e f_e * P_e over all tokens."""
  def layer(params, x):
    probs = jax.nn.softmax(x @ params["gate"], axis=-1)
    weights, chosen = jax.lax.top_k(probs, topk)
    if topk > 1:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if activation == "swiglu":
      h = (jax.nn.silu(jnp.einsum("th,ehi->tei", x, params["wi_0"]))
           * jnp.einsum("th,ehi->tei", x, params["wi_1"]))
    else:
      h = jax.nn.gelu(jnp.einsum("th,ehi->tei", x, params["wi"]))
    every = jnp.einsum("tei,eih->teh", h, params["wo"])
    picked = jnp.take_along_axis(every, chosen[:, :, None], axis=1)
    tokens, experts = probs.shape
    pairs = jnp.sum(jax.nn.one_hot(chosen, experts), axis=(0, 1))
    aux = experts * jnp.sum(pairs / (tokens * topk) * jnp.sum(probs, axis=0) / tokens)
    return jnp.einsum("tk,tkh->th", weights, picked), aux
  with jax.default_device(jax.local_devices(backend="cpu")[0]):
    y, aux = layer(params, x)
    grads = jax.grad(lambda p, x: jnp.sum(layer(p, x)[0] * ct) + layer(p, x)[1],
                     argnums=(0, 1))(params, x)
  return np.asarray(y), np.asarray(aux), jax.tree.map(np.asarray, grads)


def run_moe_layer():
  """jaxflux.MoE with the experts' intermediate dimension and the tokens over 'tp' (rule
  ("mlp", "tp")), impl="fused", bf16 compute: the fused MoE ops (ids gathered by jaxflux's
  all-gather), forward and backward (the experts' kernels and x) in one program with no XLA
  collective, against a dense float32 reference."""
  import flax.linen as nn
  from jax.sharding import AxisType

  explicit = jax.make_mesh((tp,), ("tp",), (AxisType.Explicit,))
  cases = [(32, 256, 512, 8, 2, "swiglu"), (13, 128, 256, 6, 1, "gelu"),
           (16, 128, 256, 8, 8, "swiglu")]  # (tokens per rank, hidden, inter, E, top-k, act)
  for i, (m, hidden, inter, experts, topk, act) in enumerate(cases):
    name = f"moe layer m={m} H={hidden} I={inter} E={experts} top{topk} {act}"
    rng = np.random.default_rng(700 + i)
    cast = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    gate = rng.standard_normal((hidden, experts)).astype(np.float32) / np.sqrt(hidden)
    gate[:, -2:] -= 4.0 / np.sqrt(hidden)  # the last experts rarely chosen: empty groups
    params = {"gate": gate, "wo": cast(rng.standard_normal((experts, inter, hidden))
                                       / np.sqrt(inter))}
    for w in (("wi_0", "wi_1") if act == "swiglu" else ("wi",)):
      params[w] = cast(rng.standard_normal((experts, hidden, inter)) / np.sqrt(hidden))
    x = cast(rng.standard_normal((tp * m, hidden)))
    ct = rng.standard_normal((tp * m, hidden)).astype(np.float32)
    y_want, aux_want, (dp_want, dx_want) = moe_layer_reference(params, x, topk, act, ct)
    layer = jaxflux.MoE(experts, topk, inter, activation=act, impl="fused", dtype=jnp.bfloat16)
    specs = {"gate": P(), "wo": P(None, "tp", None), "wi": P(None, None, "tp"),
             "wi_0": P(None, None, "tp"), "wi_1": P(None, None, "tp")}
    with jax.set_mesh(explicit), nn.logical_axis_rules((("mlp", "tp"),)):
      tokens = NamedSharding(explicit, P("tp", None))
      p_dev = {k: jax.make_array_from_callback(v.shape, NamedSharding(explicit, specs[k]),
                                               lambda idx, v=v: v[idx])
               for k, v in params.items()}
      x_dev, ct_dev = (jax.make_array_from_callback(a.shape, tokens, lambda idx, a=a: a[idx])
                       for a in (x, ct))

      # Every param's gradient, the router's included, and the sown load-balancing loss's: the
      # fused path sums both over the ranks with jaxflux's all-gather, no XLA collective.
      def step(params, x, ct):
        def apply(p, x):
          y, state = layer.apply({"params": p}, x, mutable=["intermediates"])
          return y, state["intermediates"]["load_balancing_loss"][0]
        (y, aux), vjp = jax.vjp(apply, params, x)
        return (y, aux, *vjp((ct.astype(y.dtype), jnp.ones((), aux.dtype))))

      step = jax.jit(step)
      program = step.lower(p_dev, x_dev, ct_dev).compile()
      hlo = program.as_text()
      collectives = [c for c in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all")
                     if c + "(" in hlo or c + "-start" in hlo]
      if collectives or "jaxflux_all_gather_grouped_matmul" not in hlo:
        failures.append(f"{name}: XLA collectives {collectives} or no fused MoE call")
        print(f"FAIL {name} hlo {collectives}", flush=True)
        continue
      print(f"PASS {name} hlo", flush=True)
      y, aux, dp, dx = program(p_dev, x_dev, ct_dev)
    check(f"{name} y", y, y_want, tol=2e-2)
    check(f"{name} load-balancing loss", aux, np.asarray(aux_want), tol=1e-4)
    check(f"{name} dx", dx, dx_want, tol=3e-2)
    for k in dp:
      check(f"{name} d{k}", dp[k], dp_want[k], tol=3e-2)


def shard_mapped(fn, in_specs, out_spec):
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec))


# Each of the kernels' kinds of wait on a peer (the one bounded spin-wait of
# xla_ffi/runtime/wait.cuh), by the op its timeout must name. The epilogue wait exists at tp=2
# only (the epilogue sums one peer's partial).
DIE_CASES = ("all_gather_matmul (the GEMM's tile wait)",
             "matmul_reduce_scatter (the own-rows GEMM's epilogue wait)",
             "matmul_reduce_scatter (the reduction pass's wait)",
             "all_gather (the gather kernel's wait)",
             "all_gather_grouped_matmul (the MoE gather's wait)",
             "grouped_matmul_reduce_scatter (the MoE combine's wait)")


def run_die():
  """Every case of DIE_CASES (at tp > 2 all but the epilogue wait) once with every rank alive
  (compiled, workspace sized), then process 1 exits and the others run each again: each must
  fail with its op's timeout naming the process's rank, not hang. Prints `DIE CASES <n>`."""
  jaxflux.configure(timeout_s=5.0)
  x, w = operands(5, 128 * tp, 256, 128 * tp)
  ag_args = (bf16(x, P("tp", None)), bf16(w, P(None, "tp")))
  x, w = operands(6, 128 * tp, 256 * tp, 256)
  rs_args = (bf16(x, P(None, "tp")), bf16(w, P("tp", None)))
  rs_in = (P(None, "tp"), P("tp", None))

  def rs_with(reduce):  # traced and compiled here, inside the override
    with tuning.override("matmul_reduce_scatter", reduce=reduce):
      return shard_mapped(lambda x, w: fused_calls.matmul_reduce_scatter(x, w, "tp"), rs_in,
                          P("tp", None)).lower(*rs_args).compile()

  gather = shard_mapped(lambda x: all_gather.all_gather(x, "tp", impl="fused")[None],
                        (P("tp", None),), P("tp"))  # each device's gathered copy
  d = moe_data(7, 64, 128, 128, 128, 4, 2, jnp.bfloat16)
  routing = lambda ids: jaxflux.moe_routing(ids, 4, "tp", gathered=True)  # noqa: E731
  moe_ag = shard_mapped(
      lambda x, w, ids: jaxflux.all_gather_grouped_matmul(x, w, routing(ids), axis_name="tp",
                                                          impl="fused"),
      (P("tp", None), P(None, None, "tp"), P()), P(None, "tp"))
  moe_rs = shard_mapped(
      lambda h, w, ids, wt: jaxflux.grouped_matmul_reduce_scatter(
          h, w, routing(ids), wt, axis_name="tp", impl="fused"),
      (P(None, "tp"), P(None, "tp", None), P(), P("tp", None)), P("tp", None))
  ids_all = global_array(d["ids"].reshape(tp, 64, 2), P())
  moe_ag_args = (bf16(d["x"], P("tp", None)), bf16(d["w1"], P(None, None, "tp")), ids_all)
  h = np.random.default_rng(8).standard_normal((tp * 64 * 2, 128)).astype(np.float32)
  moe_rs_args = (bf16(h, P(None, "tp")), bf16(d["w2"], P(None, "tp", None)), ids_all,
                 global_array(d["weights"], P("tp", None)))
  calls = dict(zip(DIE_CASES, ((ag, ag_args), (rs_with("epilogue") if tp == 2 else None, rs_args),
                               (rs_with("pass"), rs_args), (gather, ag_args[:1]),
                               (moe_ag, moe_ag_args), (moe_rs, moe_rs_args))))
  calls = {case: call for case, call in calls.items() if call[0] is not None}
  print(f"DIE CASES {len(calls)}", flush=True)
  for call, args in calls.values():
    call(*args).block_until_ready()
  _runtime.check_errors()
  print("PASS first calls", flush=True)
  if PROCESS_ID == 1:
    os._exit(0)  # dies without a word to anyone
  for case, (call, args) in calls.items():
    op = case.split()[0]
    try:
      call(*args).block_until_ready()
      _runtime.check_errors()
      failures.append(f"{case}: the call with a dead peer did not fail")
    except RuntimeError as e:
      if f"jaxflux {op}: rank {PROCESS_ID}" in str(e) and "timed out" in str(e):
        print(f"PASS dead peer, {case}: {str(e)[:160]}", flush=True)
      else:
        failures.append(f"{case}: unexpected error: {e}")
  print(f"WORKER OK {PROCESS_ID}" if not failures else f"FAILURES {failures}", flush=True)
  os._exit(0 if not failures else 1)  # skip jax.distributed's shutdown barrier (peer is gone)


def print_choices():
  """`TUNING <tables digest> <choices digest>`: the kernel tables this process reads and what
  they choose on the benchmark shapes at M 1024-16384 (tp=2), which every rank must share."""
  shapes = json.loads((pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
                       / "shapes.json").read_text())
  choices = []
  for M in (1024, 2048, 4096, 8192, 16384):
    for s in shapes["ag_gemm"]:
      choices.append(tuning.choose_all_gather_matmul(
          dtype="bfloat16", tp=2, rows=M, k=s["K"], n=s["N"] // 2, sms=_runtime.sm_count(),
          shard_rows=M // 2))
    for s in shapes["gemm_rs"]:
      choices.append(tuning.choose_matmul_reduce_scatter(
          dtype="bfloat16", tp=2, batch=1, m=M // 2, k=s["K"] // 2, n=s["N"], itemsize=2))
  text = repr(choices).encode()
  print(f"TUNING {tuning.active_tables().digest} {hashlib.sha256(text).hexdigest()}", flush=True)


if MODE in ("check", "quick"):
  print_choices()
  print(f"RANKS PER GPU {_runtime.ranks_per_gpu()}", flush=True)
  with jax.set_mesh(mesh):
    run_check() if MODE == "check" else run_quick()
  if not SHARED_GPU:  # its all-gather is an XLA collective: NCCL takes one rank per GPU
    run_check_gathered_slots()
  _runtime.check_errors()
elif MODE == "matrix":
  with jax.set_mesh(mesh):
    run_matrix()
  _runtime.check_errors()
elif MODE == "fp8":
  with jax.set_mesh(mesh):
    run_fp8()
  _runtime.check_errors()
elif MODE == "all_reduce":
  with jax.set_mesh(mesh):
    run_all_reduce()
  _runtime.check_errors()
elif MODE == "fuzz":
  with jax.set_mesh(mesh):
    run_fuzz()
elif MODE in ("moe", "moe_bfloat16"):
  with jax.set_mesh(mesh):
    run_moe((jnp.bfloat16,) if MODE == "moe_bfloat16" else (jnp.bfloat16, jnp.float16))
  _runtime.check_errors()
elif MODE == "moe_layer":
  run_moe_layer()
  _runtime.check_errors()
elif MODE == "cache":
  with jax.set_mesh(mesh):
    run_cache()
  _runtime.check_errors()
elif MODE == "mlp":
  with jax.set_mesh(mesh):
    run_mlp()
  _runtime.check_errors()
else:
  with jax.set_mesh(mesh):
    run_die()

if failures:
  print(f"FAILURES {failures}", flush=True)
  sys.exit(1)
print(f"WORKER OK {PROCESS_ID}", flush=True)
