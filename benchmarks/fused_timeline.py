"""The GPU timeline of a fused op (2+ GPUs): every kernel and copy of a few back-to-back calls,
per GPU and stream, from a jax.profiler trace.

    python benchmarks/fused_timeline.py M K N OUTDIR [--op gemm_rs|ag_gemm] [--modes ...] [--calls 4]

M, K, N are the benchmark's global shape (shapes.json): gemm_rs multiplies x [M, K] sharded along
K by w [K, N] sharded along K; ag_gemm multiplies x [M, K] sharded along M by w [K, N] sharded
along N. --modes: gemm_rs's reduction modes (pass, epilogue); ag_gemm's `fused` (env knobs,
e.g. JAXFLUX_AG_GEMM_LOCAL=copy, select variants); for both, `gemm_only`: the op's GEMM alone
on the same per-device shape with communication off, as the benchmark's gemm_only column;
for gemm_rs, `own_rows`, `own_rows_c`, `own_rows_chunked`, `own_rows_c_chunked`: the epilogue
mode's own-rows kernel alone, without or with its source C, in CUTLASS's tile order or swept
along N as for a partial pushed in chunks (what the C read costs apart from the pushes);
`own_rows_c_chunked_cutlass_scheduler`: the last under CUTLASS's own scheduler (what the fused
ops' scheduler costs); `own_rows_c[_chunked]_pingpong`: with C, ping-pong 128x128 tiles.
Prints `GPU  stream  start_us  duration_us  name` rows (start from the trace's first GPU event).
It is how GEMM+RS's epilogue stall was found: the peer's push (MemcpyP2P) ran 19-24x slower
while the own-rows GEMM spun on its flag (benchmarks/logs/gemm_rs_timeline_hostpoll_session5_*.log).
"""
from __future__ import annotations

import argparse
import functools
import gzip
import importlib
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

# The modules (jaxflux.ops re-exports their functions under the same names).
rs = importlib.import_module("jaxflux.ops.matmul_reduce_scatter")
ag = importlib.import_module("jaxflux.ops.all_gather_matmul")
gemm_module = importlib.import_module("jaxflux.ops.gemm")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from profile_summary import newest_trace  # noqa: E402 (beside this script, not a package)


def gpu_events(trace_dir: pathlib.Path) -> list[tuple[str, str, float, float, str]]:
  with gzip.open(newest_trace(trace_dir)) as f:
    events = json.load(f)["traceEvents"]
  meta = [e for e in events if e.get("ph") == "M"]
  processes = {e["pid"]: e["args"]["name"] for e in meta if e.get("name") == "process_name"}
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta
             if e.get("name") == "thread_name"}
  gpu = [e for e in events if e.get("ph") == "X" and "GPU" in processes.get(e["pid"], "")]
  t0 = min(e["ts"] for e in gpu)
  return [(processes[e["pid"]], str(threads.get((e["pid"], e["tid"]), e["tid"])),
           e["ts"] - t0, e["dur"], e["name"]) for e in sorted(gpu, key=lambda e: (e["pid"],
                                                                              e["ts"]))]


# gemm_rs's own-rows kernel (the epilogue reduction's GEMM) alone, communication off: without
# and with its source C, in CUTLASS's tile order or swept along N as for chunked pushes (the
# weight as the forward op gives it: the K-major variants are benchmarks/ncu_gemms.py's).
OWN_ROWS_MODES = tuple(v for v in gemm_module.OWN_ROWS_VARIANTS
                       if not gemm_module.own_rows_variant(v)[1]["transpose_w"])


def gemm_summary(events) -> list[tuple[str, int, float]]:
  """(kind, count, median us) of the GEMM kernels among `events`: the fused ops' scheduler
  (the AG+GEMM kernel, GEMM+RS's own-rows kernel) apart from CUTLASS's (GEMM+RS's other GEMMs),
  in order of first appearance."""
  durations: dict[str, list[float]] = {}
  for _, _, _, dur, name in events:
    if "cutlass" not in name:
      continue
    kind = "fused-scheduler GEMM" if "AgGemmScheduler" in name else "CUTLASS-scheduler GEMM"
    durations.setdefault(kind, []).append(dur)
  return [(kind, len(d), float(np.median(d))) for kind, d in durations.items()]


def fused_call(op: str, mode: str, mesh: Mesh):
  """The jitted fused op over `mesh` (global operands in, global result out); mode gemm_only:
  its GEMM alone on the same per-device shape, communication off (the benchmark's column)."""
  if mode == "gemm_only":
    if op == "gemm_rs":  # every device: all M rows by its K-slice, in the owners' order
      body = functools.partial(gemm_module.gemm, tile_order="matmul_reduce_scatter",
                               owners=mesh.shape["tp"])
      return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
                                   out_specs=P("tp", None)))
    body = functools.partial(gemm_module.gemm, tile_order="all_gather_matmul")
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, "tp")),
                                 out_specs=P(None, "tp")))
  if mode.startswith("own_rows"):  # gemm_rs's own-rows kernel alone (jaxflux.ops.gemm)
    if op != "gemm_rs" or mode not in OWN_ROWS_MODES:
      raise SystemExit(f"own-rows modes are gemm_rs's: {', '.join(OWN_ROWS_MODES)}")
    tp = mesh.shape["tp"]

    def own_rows(a, b):  # this device's own rows (a slice: its copy is a kernel of its own)
      rows = a.shape[0] // tp
      with_c, options = gemm_module.own_rows_variant(mode)
      c = jnp.full((rows, b.shape[1]), 0.5, a.dtype) if with_c else None
      return gemm_module.gemm_own_rows(a[:rows], b, c, **options)
    return jax.jit(jax.shard_map(own_rows, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
                                 out_specs=P("tp", None)))
  if op == "gemm_rs":
    return jax.jit(jax.shard_map(lambda a, b: rs._fused(a, b, "tp", reduce=mode), mesh=mesh,
                                 in_specs=(P(None, "tp"), P("tp", None)),
                                 out_specs=P("tp", None)))
  if mode != "fused":
    raise SystemExit(f"--op ag_gemm's modes are fused and gemm_only (got {mode!r})")
  return jax.jit(jax.shard_map(lambda a, b: ag._fused(a, b, "tp", False)[0], mesh=mesh,
                               in_specs=(P("tp", None), P(None, "tp")),
                               out_specs=P(None, "tp")))


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("M", type=int)
  p.add_argument("K", type=int)
  p.add_argument("N", type=int)
  p.add_argument("outdir", type=pathlib.Path)
  p.add_argument("--op", choices=("gemm_rs", "ag_gemm"), default="gemm_rs")
  p.add_argument("--modes", default=None,
                 help="gemm_rs: pass, epilogue (default both), " + ", ".join(OWN_ROWS_MODES)
                      + "; ag_gemm: fused (default); both: gemm_only")
  p.add_argument("--calls", type=int, default=4)
  args = p.parse_args(argv)
  modes = args.modes or ("pass,epilogue" if args.op == "gemm_rs" else "fused")
  mesh = Mesh(np.asarray(jax.devices()), ("tp",))
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (args.M, args.K), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (args.K, args.N), jnp.float32) / np.sqrt(args.K)).astype(
      jnp.bfloat16)
  for mode in modes.split(","):
    f = fused_call(args.op, mode, mesh)
    for _ in range(3):  # compile and warm up outside the trace
      f(x, w).block_until_ready()
    trace_dir = args.outdir / f"trace_{args.op}_{mode}"
    with jax.profiler.trace(str(trace_dir)):
      for _ in range(args.calls):
        out = f(x, w)
      out.block_until_ready()
    print(f"==== {args.op} {mode}")
    events = gpu_events(trace_dir)
    for gpu, stream, start, dur, name in events:
      print(f"{gpu[:14]:14s} {stream[:22]:>22s} {start:10.1f} {dur:9.1f}  {name[:90]}")
    for kind, count, median in gemm_summary(events):
      print(f"summary {args.op} M={args.M} {mode}: {kind} x{count}, median {median:.1f} us")


if __name__ == "__main__":
  main()
