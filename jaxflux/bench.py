"""Benchmark harness: `python -m jaxflux.bench --op {all_gather,ag_gemm,gemm_rs}`.

Times every variant of one op side by side in one process, on fresh random data, over a 1-D
mesh ('tp',) of the local devices, and writes a JSON record (command, machine, versions, one row
per shape) under benchmarks/results/. DESIGN.md section 5 says what counts; benchmarks/README.md
says how to run it and how to read the JSON.

Variants (per row; each runs under `jit`, inside `jax.shard_map` except the two GSPMD ones, on
inputs already placed with the sharding the program expects, so no resharding is timed):
  gemm          XLA dot alone on the per-device shape, no collective
                  (ag_gemm: [M, K] @ [K, N/tp]; gemm_rs: [M, K/tp] @ [K/tp, N])
  comm          the collective alone (lax.all_gather of the [M/tp, K] shard; lax.psum_scatter of
                  the [M, N] partial)
  xla           jaxflux op, impl="xla" (all_gather + dot / dot + psum_scatter)
  xla_windowed  the same matmul written globally (GSPMD) and compiled with XLA's windowed-einsum
                  flags, in a child process (the flags are per process); GPU only
  pallas        jax.experimental.pallas.ops.gpu.collective_matmul_mgpu.all_gather_lhs_matmul,
                  best of a few TuningConfigs (ag_gemm, GPU, bf16/fp16 only)
  jaxflux       jaxflux op, impl="fused"; null with the error where no fused kernel exists
  auto          jaxflux op, impl="auto"
  xla_gspmd     (not run by default) the GSPMD program of xla_windowed without the flags
For --op all_gather: `xla` is lax.all_gather and `jaxflux` the internal copy-engine all-gather
(jaxflux.ops.all_gather.all_gather(x, axis_name, impl="fused")).

Timing (see `_Timed` and `_chain`): on GPU the default is `--timing dispatch` (below); elsewhere
one jitted program runs the op `--iters` times
in a `lax.fori_loop` and the host synchronizes once; each call is made to depend on the previous
call's output (an optimization barrier on GPU, a one-element in-place nudge elsewhere) so that
XLA can neither hoist, merge nor overlap calls; small shapes rotate among several input sets so
they don't run from L2. `--timing dispatch` queues jitted single calls from Python instead.
Repeats are interleaved round-robin across variants (the order rotates each repeat); a row
reports the median and the min/max over repeats of the time per call.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib
import importlib.metadata
import json
import math
import os
import pathlib
import re
import shlex
import statistics
import subprocess
import sys
import time
import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

OPS = ("all_gather", "ag_gemm", "gemm_rs")
AXIS = "tp"
DEFAULT_VARIANTS = ("gemm", "gemm_only", "comm", "xla", "xla_windowed", "pallas", "jaxflux", "auto")
EXTRA_VARIANTS = ("xla_gspmd",)
# Variants that apply to each op, in the order they run (xla first: it is the reference output).
OP_VARIANTS = {
    "all_gather": ("xla", "jaxflux"),
    "ag_gemm": ("xla", "gemm", "gemm_only", "comm", "pallas", "jaxflux", "auto", "xla_windowed",
                "xla_gspmd"),
    "gemm_rs": ("xla", "gemm", "gemm_only", "comm", "jaxflux", "auto", "xla_windowed",
                "xla_gspmd"),
}
# Variants whose output is the op's output (checked against `xla`).
OUTPUT_VARIANTS = ("xla", "pallas", "jaxflux", "auto", "xla_windowed", "xla_gspmd")
WINDOWED_FLAGS = ("--xla_gpu_threshold_for_windowed_einsum_mib=0",
                  "--xla_gpu_multi_streamed_windowed_einsum=true")
DISPLAY_ORDER = ("gemm", "gemm_only", "comm", "xla", "xla_windowed", "pallas", "jaxflux", "auto", "xla_gspmd")
CHILD_MARKER = "JAXFLUX_BENCH_CHILD_JSON:"
# Above any device memory's bandwidth today (H200: 4.8 TB/s): a sanity floor, see `_floor_ms`.
FLOOR_BANDWIDTH = 10e12
# A config that computes wrong values must not win the Pallas sweep.
PALLAS_MAX_REL_ERR = 5e-2

DEFINITIONS = {
    "ms": "median over repeats of (wall time of one timed run) / (op calls in it), milliseconds",
    "spread_ms": "[min, max] over repeats of the same per-call time",
    "tflops": "per-device TFLOP/s: 2*M*K*N/tp / time (the GEMM each device does)",
    "gbps": ("bytes each device receives per second, GB/s (1e9): (tp-1)*shard_bytes / time; "
             "shard_bytes is the [M/tp, K] shard for all-gather, the [M/tp, N] output chunk for "
             "reduce-scatter. Equals NCCL's bus bandwidth; algbw = gbps*tp/(tp-1)"),
    "speedup_vs_xla": "ms['xla'] / ms['jaxflux']",
    "speedup_vs_xla_all": ("ms['xla'] / ms[v]; for xla_windowed, the child process's own xla "
                           "time over its windowed time (same process, same clocks); for gemm "
                           "it is the ceiling a perfect overlap would reach"),
    "overlap_efficiency": ("FLUX's E = (T_gemm + T_comm - T_v) / T_comm for v = jaxflux; "
                           "overlap_efficiency_all for every fused or unfused variant. 1 = the "
                           "collective fully hidden, 0 = no overlap, < 0 = slower than serial"),
    "rel_err": "||y_v - y_xla||_F / ||y_xla||_F on one call's output, computed in float32",
}


# ----------------------------------------------------------------------------- rows and shapes


@dataclasses.dataclass(frozen=True)
class Row:
  """One benchmark row. M, K, N are the global GEMM shape y[M, N] = x[M, K] @ w[K, N]
  (for all_gather: the gathered array is [M, K] and N is unused, 0)."""
  op: str
  name: str
  M: int
  K: int
  N: int
  tp: int
  dtype: str

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.dtype).itemsize

  @property
  def flops_per_device(self) -> int:
    return 0 if self.op == "all_gather" else 2 * self.M * self.K * self.N // self.tp

  @property
  def comm_bytes_per_device(self) -> int:
    """Bytes each device receives in the collective ((tp-1) chunks)."""
    chunk = self.M // self.tp * (self.N if self.op == "gemm_rs" else self.K)
    return (self.tp - 1) * chunk * self.itemsize

  @property
  def per_device_shapes(self) -> dict:
    m, k, n = self.M // self.tp, self.K // self.tp, self.N // self.tp
    if self.op == "all_gather":
      return {"x": [m, self.K], "out": [self.M, self.K]}
    if self.op == "ag_gemm":
      return {"x": [m, self.K], "w": [self.K, n], "out": [self.M, n]}
    return {"x": [self.M, k], "w": [k, self.N], "out": [m, self.N]}

  def key(self) -> list:
    return [self.op, self.name, self.M, self.K, self.N, self.tp, self.dtype]


def repo_root() -> pathlib.Path:
  return pathlib.Path(__file__).resolve().parent.parent


def find_shapes_file(explicit: str | None) -> pathlib.Path:
  """--shapes-file, else shared/bench/shapes.json beside or inside the repo (or the cwd), else
  the copy in benchmarks/shapes.json."""
  if explicit:
    path = pathlib.Path(explicit)
    if not path.is_file():
      raise FileNotFoundError(f"--shapes-file {explicit}: no such file")
    return path
  roots = (repo_root(), pathlib.Path.cwd())
  candidates = [r / sub / "bench" / "shapes.json" for r in roots for sub in ("../shared", "shared")]
  candidates.append(repo_root() / "benchmarks" / "shapes.json")  # the copy committed with the repo
  for path in candidates:
    if path.is_file():
      return path.resolve()
  raise FileNotFoundError("shapes.json not found; looked in " + ", ".join(map(str, candidates)) +
                          ". Pass --shapes-file PATH.")


def _all_gather_width(elements: int) -> int:
  k = 8192
  while k > 1 and (elements % k or elements < k):
    k //= 2
  return k


def build_rows(args, shapes: dict, tp: int) -> list[Row]:
  """The rows to run, from shapes.json filtered by --shapes/--M, or --sizes-mib for all_gather."""
  ms = args.M or list(shapes.get("M", []))
  if args.op == "all_gather" and args.sizes_mib:
    rows = []
    itemsize = jnp.dtype(args.dtype).itemsize
    for mib in args.sizes_mib:
      elements = int(round(mib * 2**20 / itemsize))
      k = _all_gather_width(elements)
      rows.append(Row("all_gather", f"{mib:g}MiB", elements // k * tp, k, 0, tp, args.dtype))
    return rows
  table = shapes.get("ag_gemm" if args.op == "all_gather" else args.op, [])
  if args.shapes:
    known = {s["name"] for s in table}
    missing = [n for n in args.shapes if n not in known]
    if missing:
      raise ValueError(f"--shapes: unknown name(s) {missing}; the shapes file has {sorted(known)}")
    table = [s for s in table if s["name"] in args.shapes]
  rows: list[Row] = []
  if args.op == "all_gather":
    # The AllGather+GEMM shapes' [M/tp, K] shards; shapes that share K share a row.
    names_by_k: dict[int, list[str]] = {}
    for s in table:
      names_by_k.setdefault(int(s["K"]), []).append(s["name"])
    for m in ms:
      for k, names in names_by_k.items():
        rows.append(Row("all_gather", "+".join(names), int(m), k, 0, tp, args.dtype))
  else:
    for s in table:
      for m in ms:
        rows.append(Row(args.op, s["name"], int(m), int(s["K"]), int(s["N"]), tp, args.dtype))
  for row in rows:
    sharded = {"M": row.M, "N": row.N} if row.op == "ag_gemm" else {"M": row.M}
    if row.op == "gemm_rs":
      sharded["K"] = row.K
    for dim, size in sharded.items():
      if size % tp:
        raise ValueError(f"row {row.name}: {dim}={size} is not divisible by tp={tp}; pick "
                         "another --M / --tp.")
  return rows


# ----------------------------------------------------------------------------- inputs


def make_mesh(tp: int) -> Mesh:
  devices = jax.devices()
  if tp > len(devices):
    raise ValueError(f"--tp {tp}: only {len(devices)} local devices")
  return Mesh(np.asarray(devices[:tp]), (AXIS,), axis_types=(AxisType.Auto,))


def _input_layouts(row: Row) -> dict[str, tuple[tuple[int, ...], P]]:
  """Global shape and PartitionSpec of every array a row's variants take."""
  M, K, N, tp = row.M, row.K, row.N, row.tp
  if row.op == "all_gather":
    return {"x": ((M, K), P(AXIS, None))}
  if row.op == "ag_gemm":
    return {"x": ((M, K), P(AXIS, None)), "w": ((K, N), P(None, AXIS)),
            # gemm: each device multiplies its own full [M, K] by its w shard.
            "x_full": ((tp * M, K), P(AXIS, None))}
  return {"x": ((M, K), P(None, AXIS)), "w": ((K, N), P(AXIS, None)),
          # comm: each device reduce-scatters its own [M, N] partial.
          "partial": ((tp * M, N), P(AXIS, None))}


def _main_input_bytes_per_device(row: Row) -> int:
  names = ("x",) if row.op == "all_gather" else ("x", "w")
  layouts = _input_layouts(row)
  return sum(math.prod(layouts[n][0]) for n in names) // row.tp * row.itemsize


def input_set_count(row: Row, rotate_mib: float) -> int:
  """How many independent input sets to rotate through so repeated calls don't run from L2."""
  if rotate_mib <= 0:
    return 1
  return int(min(8, max(1, math.ceil(rotate_mib * 2**20 / _main_input_bytes_per_device(row)))))


@functools.lru_cache(maxsize=64)
def _generator(shape: tuple[int, ...], dtype: str, sharding: NamedSharding) -> Callable:
  return jax.jit(lambda key: jax.random.normal(key, shape, jnp.dtype(dtype)),
                 out_shardings=sharding)


def make_inputs(row: Row, mesh: Mesh, n_sets: int, seed: int) -> list[dict[str, jax.Array]]:
  """Fresh standard-normal arrays (never zeros), generated in place with their final sharding."""
  sets = []
  base = jax.random.fold_in(jax.random.key(seed), zlib.crc32(json.dumps(row.key()).encode()) >> 1)
  for s in range(n_sets):
    arrays = {}
    for i, (name, (shape, spec)) in enumerate(sorted(_input_layouts(row).items())):
      key = jax.random.fold_in(jax.random.fold_in(base, s), i)
      arrays[name] = _generator(shape, row.dtype, NamedSharding(mesh, spec))(key)
    sets.append(arrays)
  jax.block_until_ready(sets)
  return sets


# ----------------------------------------------------------------------------- variants


@dataclasses.dataclass
class Variant:
  """A per-device function under shard_map (or, with `gspmd`, a global function under jit)."""
  name: str
  fn: Callable
  inputs: tuple[str, ...]
  check_vma: bool = True
  gspmd_out_spec: P | None = None  # set for global (GSPMD) programs
  note: str | None = None


class Unavailable(Exception):
  """A variant that cannot run here (reason recorded, not a failure of the harness)."""


def _jaxflux_op(op: str, impl: str) -> Callable:
  if op == "all_gather":
    try:
      module = importlib.import_module("jaxflux.ops.all_gather")
    except ImportError as e:
      raise Unavailable(f"jaxflux.ops.all_gather is not importable: {e}") from e
    return lambda x: module.all_gather(x, AXIS, impl=impl)
  import jaxflux
  if op == "ag_gemm":
    return lambda x, w: jaxflux.all_gather_matmul(x, w, AXIS, impl=impl)
  return lambda x, w: jaxflux.matmul_reduce_scatter(x, w, AXIS, impl=impl)


def make_variant(name: str, row: Row) -> Variant:
  """The variant `name` for `row`; raises Unavailable with a reason where it cannot run."""
  op = row.op
  if name not in OP_VARIANTS[op]:
    raise Unavailable(f"not applicable to --op {op}")
  if op == "all_gather":
    if name == "xla":
      return Variant(name, lambda x: lax.all_gather(x, AXIS, axis=0, tiled=True), ("x",))
    return Variant(name, _jaxflux_op(op, "fused"), ("x",))
  if name == "gemm":
    return Variant(name, jnp.dot, ("x_full", "w") if op == "ag_gemm" else ("x", "w"))
  if name == "gemm_only":  # the fused kernels' own GEMM with communication off, same shape
    from jaxflux.ops import gemm as gemm_module
    try:
      probe = jax.ShapeDtypeStruct((8, 8), row.dtype)
      jax.eval_shape(gemm_module.gemm, probe, probe)
    except Exception as e:  # noqa: BLE001 - recorded as the reason the variant is null
      raise Unavailable(f"{type(e).__name__}: {e}") from e
    if op == "ag_gemm":
      return Variant(name, functools.partial(gemm_module.gemm, tile_order="all_gather_matmul"),
                     ("x_full", "w"))
    return Variant(name, gemm_module.gemm, ("x", "w"))
  if name == "comm":
    if op == "ag_gemm":
      return Variant(name, lambda x: lax.all_gather(x, AXIS, axis=0, tiled=True), ("x",))
    return Variant(name, lambda p: lax.psum_scatter(p, AXIS, scatter_dimension=0, tiled=True),
                   ("partial",))
  if name in ("xla", "jaxflux", "auto"):
    impl = {"xla": "xla", "jaxflux": "fused", "auto": "auto"}[name]
    return Variant(name, _jaxflux_op(op, impl), ("x", "w"))
  if name in ("xla_windowed", "xla_gspmd"):
    out_spec = P(None, AXIS) if op == "ag_gemm" else P(AXIS, None)
    return Variant(name, jnp.dot, ("x", "w"), gspmd_out_spec=out_spec)
  raise Unavailable(f"unknown variant {name!r}")  # pallas is built per config


def _is_gpu() -> bool:
  return jax.default_backend() in ("gpu", "cuda", "rocm")


def _chain_kind(args) -> str:
  """--chain auto: the free barrier on GPU, the data dependency elsewhere (see `_chain`)."""
  if args.chain != "auto":
    return args.chain
  return "barrier" if _is_gpu() else "perturb"


# A few configs around what the module's own sweep explores: CTA tiles 128x256, 256x128,
# 128x128 with different rasterization. Failures (shared memory, divisibility) are recorded.
PALLAS_CONFIGS = (
    dict(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, wg_dimension="N",
         grid_minor_dim="M", grid_tile_width=8),
    dict(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, wg_dimension="M",
         grid_minor_dim="N", grid_tile_width=8),
    dict(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=3, wg_dimension="N",
         grid_minor_dim="N", grid_tile_width=16),
    dict(tile_m=128, tile_n=64, tile_k=64, max_concurrent_steps=4, wg_dimension="N",
         grid_minor_dim="M", grid_tile_width=8),
    dict(tile_m=64, tile_n=128, tile_k=64, max_concurrent_steps=4, wg_dimension="M",
         grid_minor_dim="M", grid_tile_width=4),
)


def pallas_config_name(cfg: dict) -> str:
  return (f"tm{cfg['tile_m']}_tn{cfg['tile_n']}_tk{cfg['tile_k']}_s{cfg['max_concurrent_steps']}"
          f"_wg{cfg['wg_dimension']}_minor{cfg['grid_minor_dim']}_w{cfg['grid_tile_width']}")


def _pallas_module():
  try:
    return importlib.import_module("jax.experimental.pallas.ops.gpu.collective_matmul_mgpu")
  except Exception as e:  # noqa: BLE001 - any import failure means "not here"
    raise Unavailable(f"cannot import collective_matmul_mgpu: {type(e).__name__}: {e}") from e


def pallas_variants(row: Row) -> list[Variant]:
  """One Variant per TuningConfig; raises Unavailable where the kernel cannot run at all."""
  if row.op != "ag_gemm":
    raise Unavailable(f"not applicable to --op {row.op}")
  if not _is_gpu():
    raise Unavailable(f"needs a GPU (platform is {jax.default_backend()})")
  if jnp.dtype(row.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise Unavailable(f"the Pallas kernel takes bfloat16/float16 only, not {row.dtype}")
  if row.tp != jax.device_count():
    raise Unavailable(f"the Pallas kernel needs the axis to span all {jax.device_count()} "
                      f"devices; --tp is {row.tp}")
  cm = _pallas_module()
  dims = cm.MatmulDimension
  dtype = jnp.dtype(row.dtype)
  out = []
  for cfg in PALLAS_CONFIGS:
    config = cm.TuningConfig(**{k: (dims[v] if k in ("wg_dimension", "grid_minor_dim") else v)
                                for k, v in cfg.items()})
    fn = functools.partial(cm.all_gather_lhs_matmul, axis_name=AXIS, config=config, dtype=dtype)
    out.append(Variant("pallas", fn, ("x", "w"), check_vma=False, note=pallas_config_name(cfg)))
  return out


# ----------------------------------------------------------------------------- timing


def _chain(fn: Callable, sets: list[tuple], n_outer: int, chain: str, eps,
           constrain: Callable = lambda a: a):
  """Calls fn on sets[0], then n_outer times on each of sets[1:] + sets[:1] in turn, every
  call made to depend on the previous call's output y, so that XLA can neither hoist a call out
  of the loop, merge calls on the same inputs, nor overlap one call with the next.

  chain "barrier": the first input passes through `lax.optimization_barrier` with y. Free at
    run time; relies on the barrier surviving XLA's loop optimizations, which holds on GPU (the
    GPU compiler removes barriers only after scheduling) but not on CPU (seen: the CPU compiler
    hoisted the whole loop body out).
  chain "perturb": adds eps * y[0, ..., 0] (eps a run-time 0.0 the compiler cannot see) to
    element [0, ..., 0] of the first input, in place: a true data dependency on any platform,
    for the price of one tiny kernel per call.
  """
  order = list(range(1, len(sets))) + [0]

  def depend(args, y):
    first = args[0]
    if chain == "barrier":  # only the first input: the others need not pass through it
      first, _ = lax.optimization_barrier((first, y))
      return (first,) + tuple(args[1:])
    corner = (0,) * first.ndim
    nudge = (eps * y[(0,) * y.ndim]).astype(first.dtype)
    first = lax.dynamic_update_slice(first, first[tuple(slice(0, 1) for _ in corner)] + nudge,
                                     corner)
    return (first,) + tuple(args[1:])

  perturb = chain == "perturb"

  def body(_, carry):
    # Under "perturb" the nudged first inputs are carried, so each call sees the last nudge.
    firsts, y = carry
    firsts = list(firsts)
    for s in order:
      first = firsts[s] if perturb else sets[s][0]
      args = constrain(depend((first,) + tuple(sets[s][1:]), y))
      if perturb:
        firsts[s] = args[0]
      y = constrain(fn(*args))
    return tuple(firsts), y

  y = constrain(fn(*sets[0]))
  firsts = tuple(s[0] for s in sets) if perturb else ()
  return lax.fori_loop(0, n_outer, body, (firsts, y))[1]


class _Timed:
  """A compiled timed run of one variant: `calls` op invocations, one sync at the end.

  mode "loop": one jitted program runs the calls in a `lax.fori_loop` (see `_chain`), so there
    is no per-call dispatch at all; this is the default and suits any op size.
  mode "dispatch": a Python loop dispatches a jitted single call `calls` times asynchronously,
    then blocks once (what DESIGN.md's baseline numbers used); fine for ms-scale ops, but host
    dispatch (tens of µs a call) shows through on small ones. On CPU every call is waited for
    (queued multi-device CPU programs can deadlock in XLA's in-process collectives).
  """

  def __init__(self, variant: Variant, mesh: Mesh, input_sets: list[dict], iters: int, mode: str,
               chain: str):
    self.variant = variant
    self.mode = mode
    self.sync_each = mode == "dispatch" and not _is_gpu()
    n_sets = len(input_sets)
    self.args = [tuple(s[n] for n in variant.inputs) for s in input_sets]
    out_sharding = None
    if variant.gspmd_out_spec is not None:
      out_sharding = NamedSharding(mesh, variant.gspmd_out_spec)
      in_shardings = tuple(a.sharding for a in self.args[0])

      def constrain(t):
        if isinstance(t, tuple):
          return tuple(lax.with_sharding_constraint(a, s) for a, s in zip(t, in_shardings))
        return lax.with_sharding_constraint(t, out_sharding)
    else:
      constrain = lambda t: t  # noqa: E731
    layouts = tuple(a.sharding.spec for a in self.args[0])

    def compile_(f, in_specs):
      if variant.gspmd_out_spec is not None:
        return jax.jit(f, out_shardings=out_sharding)
      return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=P(AXIS),
                                   check_vma=variant.check_vma))

    if mode == "loop":
      self.n_outer = max(1, math.ceil((iters - 1) / n_sets))
      self.calls = 1 + self.n_outer * n_sets
      n_outer, k = self.n_outer, len(variant.inputs)

      def program(eps, *flat):
        sets = [tuple(flat[i * k:(i + 1) * k]) for i in range(n_sets)]
        return _chain(variant.fn, sets, n_outer, chain, eps, constrain)

      self._program = compile_(program, (P(),) + layouts * n_sets)
      eps_sharding = NamedSharding(mesh, P())
      self._flat = [jax.device_put(jnp.zeros((), jnp.float32), eps_sharding)]
      self._flat += [a for s in self.args for a in s]
    elif mode == "dispatch":
      self.calls = max(1, iters)
      self._program = compile_(variant.fn, layouts)
    else:
      raise ValueError(f"--timing {mode!r}: use 'loop' or 'dispatch'")

  def run(self) -> jax.Array:
    """Queues one timed run and returns its last output (not waited for)."""
    if self.mode == "loop":
      return self._program(*self._flat)
    y = None
    for c in range(self.calls):
      y = self._program(*self.args[c % len(self.args)])
      if self.sync_each:
        y.block_until_ready()
    return y

  def time_ms(self) -> float:
    """Milliseconds per call of one timed run."""
    t0 = time.perf_counter()
    self.run().block_until_ready()
    return (time.perf_counter() - t0) * 1e3 / self.calls

  def hlo_text(self) -> str:
    if self.mode == "loop":
      return self._program.lower(*self._flat).compile().as_text()
    return self._program.lower(*self.args[0]).compile().as_text()


@jax.jit
def _rel_err(y, ref):
  y, ref = y.astype(jnp.float32), ref.astype(jnp.float32)
  return jnp.linalg.norm((y - ref).ravel()) / jnp.linalg.norm(ref.ravel())


def _as_stacked(y: jax.Array, row: Row, variant: Variant) -> jax.Array:
  """A GSPMD ag_gemm output [M, N] in the shard_map variants' layout (device outputs stacked)."""
  if variant.gspmd_out_spec is not None and row.op == "ag_gemm":
    n = row.N // row.tp
    return y.reshape(row.M, row.tp, n).transpose(1, 0, 2).reshape(row.tp * row.M, n)
  return y


def _error_text(e: BaseException, limit: int = 600) -> str:
  text = f"{type(e).__name__}: {e}".strip()
  text = re.sub(r"\s+", " ", text)
  return text if len(text) <= limit else text[:limit] + "..."


@dataclasses.dataclass
class _Prepared:
  timed: _Timed
  compile_s: float


def _prepare(variant: Variant, mesh, input_sets, args) -> tuple[_Prepared, jax.Array]:
  """Builds, compiles and warms up a variant; returns it and the last output of the warm-up."""
  t0 = time.perf_counter()
  timed = _Timed(variant, mesh, input_sets, args.iters, args.timing, _chain_kind(args))
  y = timed.run()
  y.block_until_ready()
  compile_s = time.perf_counter() - t0
  for _ in range(max(0, math.ceil(args.warmup / timed.calls) - 1)):
    y = timed.run()
  y.block_until_ready()
  return _Prepared(timed, compile_s), y


def bench_row(row: Row, mesh: Mesh, variants: list[str], args, log=print) -> dict:
  """Times the requested variants of one row; returns the row's JSON record."""
  n_sets = input_set_count(row, args.rotate_mib)
  input_sets = make_inputs(row, mesh, n_sets, args.seed)
  applicable = [v for v in OP_VARIANTS[row.op] if v in variants]
  errors: dict[str, str] = {}
  prepared: dict[str, _Prepared] = {}
  rel_err: dict[str, float] = {}
  extra: dict[str, Any] = {}
  reference = None

  def check(variant, y):
    if reference is None:
      return None
    return float(_rel_err(_as_stacked(y, row, variant), reference))

  for name in applicable:
    if name == "xla_windowed" and not args._windowed_child:
      continue  # timed in the child process (merged later)
    if name == "pallas":
      try:
        candidates = pallas_variants(row)
      except Unavailable as e:
        errors[name] = str(e)
        continue
      sweep, best = {}, None
      for variant in candidates:
        try:
          prep, y = _prepare(variant, mesh, input_sets, args)
          err = check(variant, y)
          del y
          if err is not None and not err <= PALLAS_MAX_REL_ERR:
            raise RuntimeError(f"wrong result: rel_err {err:.3g} vs xla")
          ms = min(prep.timed.time_ms() for _ in range(2))
          sweep[variant.note] = {"ms": ms, "rel_err": err}
          if best is None or ms < best[1]:
            best = (prep, ms, variant.note, err)
        except Exception as e:  # noqa: BLE001 - record every config's failure and go on
          sweep[variant.note] = {"error": _error_text(e)}
      extra["pallas_sweep"] = sweep
      if best is None:
        errors[name] = "every TuningConfig failed (see pallas_sweep)"
        continue
      prepared[name], _, extra["pallas_config"], rel_err[name] = best
      continue
    try:
      variant = make_variant(name, row)
      prep, y = _prepare(variant, mesh, input_sets, args)
    except Exception as e:  # noqa: BLE001 - a variant that fails is recorded, never substituted
      errors[name] = _error_text(e)
      continue
    if name == "xla":
      reference = y
    elif name in OUTPUT_VARIANTS:
      err = check(variant, y)
      if err is not None:
        rel_err[name] = err
    del y
    prepared[name] = prep
    if name == "xla_windowed":
      try:
        extra["windowed_loop_in_hlo"] = "windowed_dot_general" in prep.timed.hlo_text()
      except Exception as e:  # noqa: BLE001
        extra["windowed_loop_in_hlo"] = None
        errors["windowed_hlo"] = _error_text(e)
  del reference

  samples: dict[str, list[float]] = {n: [] for n in prepared}
  order = list(prepared)
  for r in range(args.repeats):
    shift = r % max(1, len(order))
    for name in order[shift:] + order[:shift]:
      if name not in prepared:
        continue
      try:
        samples[name].append(prepared[name].timed.time_ms())
      except Exception as e:  # noqa: BLE001
        errors[name] = "failed while timing: " + _error_text(e)
        del prepared[name]
        samples.pop(name)

  record = summarize_row(row, variants, samples, errors, rel_err,
                         {n: p.timed.calls for n, p in prepared.items()},
                         {n: round(p.compile_s, 3) for n, p in prepared.items()}, n_sets)
  record.update(extra)
  del prepared, input_sets
  return record


# ----------------------------------------------------------------------------- summary


def _ratio(a, b):
  return None if a is None or b is None or b <= 0 else a / b


def _overlap(t_gemm, t_comm, t_v):
  if t_gemm is None or t_comm is None or t_v is None or t_comm <= 0:
    return None
  return (t_gemm + t_comm - t_v) / t_comm


def summarize_row(row: Row, requested: list[str], samples: dict, errors: dict, rel_err: dict,
                  calls: dict, compile_s: dict, n_sets: int) -> dict:
  """The JSON record of a row: every variant the op has, null (with a reason) where not run."""
  names = [v for v in DISPLAY_ORDER if v in OP_VARIANTS[row.op] and
           (v in DEFAULT_VARIANTS or v in requested)]
  ms, spread, warnings = {}, {}, []
  for v in names:
    s = samples.get(v)
    ms[v] = statistics.median(s) if s else None
    spread[v] = [min(s), max(s)] if s else None
    if not s and v not in errors:
      errors[v] = "not requested" if v not in requested else "not run"
    floor = _floor_ms(row, v)
    if ms[v] is not None and ms[v] < floor:
      warnings.append(f"{v}: {ms[v]:.4g} ms per call is below the time to move its bytes once at "
                      f"{FLOOR_BANDWIDTH / 1e12:g} TB/s ({floor:.4g} ms): calls were likely "
                      "hoisted or merged; check with --timing dispatch or --chain perturb")
  record: dict[str, Any] = {
      "op": row.op, "name": row.name, "M": row.M, "K": row.K, "N": row.N, "tp": row.tp,
      "dtype": row.dtype, "per_device": row.per_device_shapes,
      "flops_per_device": row.flops_per_device, "comm_bytes_per_device": row.comm_bytes_per_device,
      "input_sets": n_sets, "calls_per_run": calls, "compile_and_first_run_s": compile_s,
      "ms": ms, "spread_ms": spread,
      "samples_ms": {v: s for v, s in samples.items()},
  }
  gemm_like = ("gemm", "gemm_only", "xla", "xla_windowed", "xla_gspmd", "pallas", "jaxflux", "auto")
  if row.op == "all_gather":
    record["gbps"] = {v: (None if t is None else row.comm_bytes_per_device / t / 1e6)
                      for v, t in ms.items()}
  else:
    record["tflops"] = {v: (None if ms.get(v) is None else row.flops_per_device / ms[v] / 1e9)
                        for v in gemm_like if v in ms}
    record["gbps"] = {"comm": (None if ms.get("comm") is None
                               else row.comm_bytes_per_device / ms["comm"] / 1e6)}
  record["speedup_vs_xla"] = _ratio(ms.get("xla"), ms.get("jaxflux"))
  if row.op != "all_gather":  # > 1: the fused kernels' GEMM is faster than XLA's dot (cuBLAS)
    record["gemm_only_vs_gemm"] = _ratio(ms.get("gemm"), ms.get("gemm_only"))
  record["speedup_vs_xla_all"] = {v: _ratio(ms.get("xla"), ms.get(v)) for v in ms
                                  if v not in ("xla", "comm")}
  if row.op != "all_gather":
    eff = {v: _overlap(ms.get("gemm"), ms.get("comm"), ms.get(v))
           for v in ("xla", "xla_windowed", "xla_gspmd", "pallas", "jaxflux", "auto") if v in ms}
    record["overlap_efficiency"] = eff.get("jaxflux")
    record["overlap_efficiency_all"] = eff
  record["rel_err"] = rel_err
  record["errors"] = errors
  record["warnings"] = warnings
  return record


def _floor_ms(row: Row, variant: str) -> float:
  """Time to read each input and write each output once per device at FLOOR_BANDWIDTH: no real
  call can beat it, so a faster number means the timing loop was optimized away."""
  m, k, n, M, K, N = row.M // row.tp, row.K // row.tp, row.N // row.tp, row.M, row.K, row.N
  if row.op == "all_gather":
    elements = M * K
  elif variant == "comm":
    elements = M * K if row.op == "ag_gemm" else M * N + m * N
  elif row.op == "ag_gemm":
    elements = (M if variant in ("gemm", "gemm_only") else m) * K + K * n + M * n
  else:
    elements = M * k + k * N + (M if variant in ("gemm", "gemm_only") else m) * N
  return elements * row.itemsize / FLOOR_BANDWIDTH * 1e3


# ----------------------------------------------------------------------------- windowed child


def _windowed_anywhere() -> bool:
  """Test hook: run the xla_windowed child on any platform (the flags then do nothing)."""
  return os.environ.get("JAXFLUX_BENCH_WINDOWED_ON_CPU") == "1"


def _platforms_exclude_gpu() -> str | None:
  """A reason when JAX is configured for platforms without a GPU (checked without starting
  the backends, so the child can run before this process claims GPU memory)."""
  platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS") or ""
  has_gpu = any(p in platforms for p in ("cuda", "gpu", "rocm"))
  if platforms and not has_gpu and not _windowed_anywhere():
    return f"needs a GPU (jax_platforms={platforms!r})"
  return None


def _child_argv(argv: list[str], shapes_path: pathlib.Path | None) -> list[str]:
  """The parent's own arguments, with the variants narrowed and the child flag added (argparse
  keeps the last occurrence of an option)."""
  extra = ["--shapes-file", str(shapes_path)] if shapes_path else []
  return [*argv, *extra, "--variants", "xla,xla_windowed", "--_windowed-child"]


def run_windowed_child(args, argv: list[str], shapes_path, log=print) -> dict:
  """Times xla and xla_windowed in a child process with the windowed-einsum XLA flags.

  Returns {row_key_json: child_row_record} or {"error": reason}. Runs before this process
  starts its GPU backend, so the child may use the memory XLA would otherwise preallocate here.
  """
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + " ".join(WINDOWED_FLAGS)).strip()
  root = str(repo_root())
  env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  cmd = [sys.executable, "-m", "jaxflux.bench", *_child_argv(argv, shapes_path)]
  log(f"[bench] xla_windowed: child process with XLA_FLAGS={env['XLA_FLAGS']!r}", flush=True)
  try:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=args.child_timeout, cwd=os.getcwd())
  except subprocess.TimeoutExpired:
    return {"error": f"child process timed out after {args.child_timeout} s"}
  payload = None
  for line in proc.stdout.splitlines():
    if line.startswith(CHILD_MARKER):
      payload = json.loads(line[len(CHILD_MARKER):])
  if payload is None:
    tail = (proc.stderr or proc.stdout or "")[-1500:]
    return {"error": f"child process (rc={proc.returncode}) printed no result: {tail}"}
  if proc.stderr:
    sys.stderr.write(proc.stderr[-3000:])
  return payload


def _merge_windowed(record: dict, child: dict) -> None:
  if "error" in child or "skipped" in child:
    record["ms"]["xla_windowed"] = None
    record["errors"]["xla_windowed"] = child.get("error") or child.get("skipped")
    return
  crow = child["rows"].get(json.dumps(record["key"]))
  if crow is None:
    record["errors"]["xla_windowed"] = "child process returned no row for this shape"
    return
  for field in ("ms", "spread_ms", "samples_ms", "calls_per_run", "compile_and_first_run_s"):
    value = crow[field].get("xla_windowed")
    if value is not None or field in ("ms", "spread_ms"):
      record[field]["xla_windowed"] = value
  if crow["errors"].get("xla_windowed"):
    record["errors"]["xla_windowed"] = crow["errors"]["xla_windowed"]
  else:
    record["errors"].pop("xla_windowed", None)
  if "xla_windowed" in crow.get("rel_err", {}):
    record["rel_err"]["xla_windowed"] = crow["rel_err"]["xla_windowed"]
  t, ref = crow["ms"].get("xla_windowed"), crow["ms"].get("xla")
  record["xla_windowed_detail"] = {
      "flags": list(WINDOWED_FLAGS), "xla_ms_in_child": ref,
      "windowed_loop_in_hlo": crow.get("windowed_loop_in_hlo"),
  }
  record["speedup_vs_xla_all"]["xla_windowed"] = _ratio(ref, t)
  if t is not None:
    if "tflops" in record:
      record["tflops"]["xla_windowed"] = record["flops_per_device"] / t / 1e9
    ms = record["ms"]
    record["overlap_efficiency_all"]["xla_windowed"] = _overlap(ms.get("gemm"), ms.get("comm"), t)


# ----------------------------------------------------------------------------- machine info


def _dist_version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def _nvidia_smi() -> list[dict] | None:
  try:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
  except (OSError, subprocess.SubprocessError):
    return None
  if out.returncode != 0:
    return None
  gpus = []
  for line in out.stdout.strip().splitlines():
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 4:
      gpus.append(dict(zip(("name", "driver_version", "memory_total", "max_sm_clock"), parts)))
  return gpus or None


def machine_info() -> dict:
  """What ran the benchmark, without host names."""
  devices = jax.devices()
  info: dict[str, Any] = {
      "platform": jax.default_backend(),
      "device_count": len(devices),
      "device_kinds": sorted({d.device_kind for d in devices}),
      "core_count": getattr(devices[0], "core_count", None),
  }
  try:
    from jax.extend import backend as jax_backend
    info["platform_version"] = jax_backend.get_backend().platform_version
  except Exception:  # noqa: BLE001 - optional detail
    info["platform_version"] = None
  if _is_gpu():
    smi = _nvidia_smi()
    info["nvidia_smi"] = smi
    info["driver_version"] = smi[0]["driver_version"] if smi else None
  return info


def versions() -> dict:
  import jaxflux
  v = {name: _dist_version(name) for name in (
      "jax", "jaxlib", "flax", "numpy", "jax-cuda12-plugin", "jax-cuda12-pjrt",
      "jax-cuda13-plugin", "jax-cuda13-pjrt")}
  v = {k: x for k, x in v.items() if x is not None}
  v["python"] = sys.version.split()[0]
  v["jaxflux"] = getattr(jaxflux, "__version__", None) or _dist_version("jaxflux")
  try:
    from jaxflux import _runtime
    v["jaxflux_cuda_built"] = _runtime.cuda_built()
  except Exception:  # noqa: BLE001
    v["jaxflux_cuda_built"] = None
  v["jaxflux_has_cuda"] = jaxflux.has_cuda()
  try:
    rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                         cwd=repo_root(), timeout=10)
    dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                           cwd=repo_root(), timeout=10)
    if rev.returncode == 0:
      v["jaxflux_git"] = rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
  except (OSError, subprocess.SubprocessError):
    pass
  return v


# ----------------------------------------------------------------------------- table


def _fmt(x, spec=".3f"):
  return "-" if x is None else format(x, spec)


def format_table(result: dict) -> str:
  rows = result["rows"]
  if not rows:
    return "(no rows)"
  op = rows[0]["op"]
  lines = []
  if op == "all_gather":
    head = f"{'name':<28}{'M':>7}{'K':>7}{'MiB/dev':>9}{'xla ms':>9}{'jaxflux':>9}" \
           f"{'xla GB/s':>10}{'jf GB/s':>9}{'speedup':>9}"
    lines.append(head)
    for r in rows:
      mib = r["M"] // r["tp"] * r["K"] * jnp.dtype(r["dtype"]).itemsize / 2**20
      lines.append(f"{r['name']:<28}{r['M']:>7}{r['K']:>7}{mib:>9.2f}{_fmt(r['ms']['xla']):>9}"
                   f"{_fmt(r['ms'].get('jaxflux')):>9}{_fmt(r['gbps']['xla'], '.1f'):>10}"
                   f"{_fmt(r['gbps'].get('jaxflux'), '.1f'):>9}"
                   f"{_fmt(r['speedup_vs_xla'], '.3f'):>9}")
  else:
    cols = [v for v in ("gemm", "gemm_only", "comm", "xla", "xla_windowed", "pallas", "jaxflux", "auto",
                        "xla_gspmd") if v in rows[0]["ms"]]
    short = {"xla_windowed": "xla_win", "xla_gspmd": "gspmd", "gemm_only": "gemm_jf"}
    head = f"{'name':<16}{'M':>7}{'K':>7}{'N':>7}" + "".join(
        f"{short.get(c, c):>9}" for c in cols) + f"{'TF/s jf':>9}{'spd':>7}{'E jf':>7}{'E xla':>7}"
    lines.append(head + "   (ms per call; E = overlap efficiency)")
    for r in rows:
      line = f"{r['name']:<16}{r['M']:>7}{r['K']:>7}{r['N']:>7}"
      line += "".join(f"{_fmt(r['ms'].get(c)):>9}" for c in cols)
      line += f"{_fmt(r['tflops'].get('jaxflux'), '.0f'):>9}{_fmt(r['speedup_vs_xla']):>7}"
      line += f"{_fmt(r['overlap_efficiency'], '.2f'):>7}"
      line += f"{_fmt(r['overlap_efficiency_all'].get('xla'), '.2f'):>7}"
      lines.append(line)
  notes = sorted({f"{v}: {e}" for r in rows for v, e in r["errors"].items()
                  if e not in ("not requested",)})
  if notes:
    lines.append("null variants / errors:")
    lines.extend("  " + (n if len(n) < 200 else n[:200] + "...") for n in notes)
  return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI


def _row_summary(r: dict) -> str:
  parts = [f"{v}={t:.4f}" for v, t in r["ms"].items() if t is not None]
  text = "ms " + " ".join(parts)
  if r.get("speedup_vs_xla") is not None:
    text += f" | speedup_vs_xla={r['speedup_vs_xla']:.3f}"
  if r.get("overlap_efficiency") is not None:
    text += f" E={r['overlap_efficiency']:.2f}"
  return text


def _csv(cast):
  def parse(text):
    return [cast(t) for t in text.split(",") if t.strip()]
  return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog="python -m jaxflux.bench",
      description="Times the variants of one tensor-parallel op side by side and writes JSON "
                  "under benchmarks/results/ (see benchmarks/README.md).")
  p.add_argument("--op", required=True, choices=OPS)
  p.add_argument("--shapes", type=_csv(str), default=None,
                 help="comma-separated shape names from the shapes file (default: all)")
  p.add_argument("--M", type=_csv(int), default=None,
                 help="comma-separated global token counts (default: the shapes file's M list)")
  p.add_argument("--sizes-mib", type=_csv(float), default=None,
                 help="all_gather only: per-device shard sizes in MiB instead of the shapes")
  p.add_argument("--dtype", default="bfloat16", help="input dtype (default bfloat16)")
  p.add_argument("--tp", type=int, default=None, help="devices on the tp axis (default: all)")
  p.add_argument("--iters", type=int, default=100, help="op calls per timed run (default 100)")
  p.add_argument("--warmup", type=int, default=10,
                 help="untimed calls before timing, run as whole timed runs, at least one "
                      "(default 10)")
  p.add_argument("--repeats", type=int, default=5,
                 help="timed runs per variant, interleaved (default 5)")
  p.add_argument("--variants", type=_csv(str), default=list(DEFAULT_VARIANTS),
                 help=f"comma-separated, any of {DEFAULT_VARIANTS + EXTRA_VARIANTS} "
                      f"(default {','.join(DEFAULT_VARIANTS)})")
  p.add_argument("--timing", choices=("auto", "loop", "dispatch"), default="auto",
                 help="loop: calls chained in one jitted fori_loop; dispatch: Python loop of "
                      "async jitted calls, one sync; auto (default): dispatch on GPU (loop mode "
                      "timed collectives impossibly fast there, 1042 GB/s for a 16 MiB "
                      "all-gather on 2xH200), loop elsewhere (queued CPU collectives deadlock)")
  p.add_argument("--chain", choices=("auto", "barrier", "perturb"), default="auto",
                 help="how loop-mode calls are made to depend on each other: barrier "
                      "(free; GPU), perturb (one tiny kernel per call; works everywhere); auto "
                      "picks barrier on GPU, perturb elsewhere")
  p.add_argument("--rotate-mib", type=float, default=256.0,
                 help="rotate among up to 8 input sets until their per-device bytes reach this "
                      "(keeps small shapes out of L2); 0 = one set (default 256)")
  p.add_argument("--seed", type=int, default=0, help="random data seed (default 0)")
  p.add_argument("--out", default=None,
                 help="output folder (default: benchmarks/results/ of the repo) or a .json path")
  p.add_argument("--shapes-file", default=None,
                 help="default: shared/bench/shapes.json beside the repo (../shared) or in it")
  p.add_argument("--child-timeout", type=float, default=3600.0, help=argparse.SUPPRESS)
  p.add_argument("--_windowed-child", dest="_windowed_child", action="store_const", const=True,
                 default=False, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  unknown = [v for v in args.variants if v not in DEFAULT_VARIANTS + EXTRA_VARIANTS]
  if unknown:
    p.error(f"--variants: unknown {unknown}; choose from {DEFAULT_VARIANTS + EXTRA_VARIANTS}")
  if args.sizes_mib and args.op != "all_gather":
    p.error("--sizes-mib applies to --op all_gather only")
  for name in ("iters", "repeats"):
    if getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1")
  return args


def _output_path(args, platform: str, tp: int, stamp: datetime.datetime) -> pathlib.Path:
  name = f"{args.op}_{'gpu' if platform in ('gpu', 'cuda', 'rocm') else platform}_tp{tp}_" \
         f"{stamp.strftime('%Y%m%dT%H%M%SZ')}.json"
  if args.out and args.out.endswith(".json"):
    return pathlib.Path(args.out)
  if args.out:
    return pathlib.Path(args.out) / name
  root = repo_root()
  base = root if (root / "pyproject.toml").is_file() else pathlib.Path.cwd()
  return base / "benchmarks" / "results" / name


def _rounded(obj):
  """Floats to 6 significant digits, so the JSON stays readable."""
  if isinstance(obj, float):
    return float(f"{obj:.6g}")
  if isinstance(obj, dict):
    return {k: _rounded(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_rounded(v) for v in obj]
  return obj


def _dumps(obj, indent: int = 0) -> str:
  """JSON with one key per line but lists of scalars on one line (readable diffs)."""
  pad = " " * (indent + 1)
  if isinstance(obj, dict) and obj:
    items = [f"{pad}{json.dumps(str(k))}: {_dumps(v, indent + 1)}" for k, v in obj.items()]
    return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
  if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
    items = [pad + _dumps(v, indent + 1) for v in obj]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
  return json.dumps(obj)


def _write_json(path: pathlib.Path, result: dict) -> None:
  path.write_text(_dumps(_rounded(result)) + "\n")


def _run_child(args) -> dict:
  """The --_windowed-child mode: time xla and xla_windowed for the given rows, return JSON."""
  if not _is_gpu() and not _windowed_anywhere():
    return {"skipped": f"needs a GPU (platform is {jax.default_backend()})"}
  shapes_path = None if args.op == "all_gather" and args.sizes_mib else find_shapes_file(
      args.shapes_file)
  shapes = json.loads(shapes_path.read_text()) if shapes_path else {}
  mesh = make_mesh(args.tp or len(jax.devices()))
  out = {"platform": jax.default_backend(), "rows": {}}
  for row in build_rows(args, shapes, mesh.devices.size):
    record = bench_row(row, mesh, ["xla", "xla_windowed"], args, log=lambda *a, **k: None)
    out["rows"][json.dumps(row.key())] = record
  return out


def run(argv: list[str] | None = None, log=print) -> dict:
  """Runs the benchmark described by command-line style `argv`; returns the result dict (also
  written as JSON, see --out)."""
  args = parse_args(argv)
  if args.timing == "auto":
    args.timing = "dispatch" if jax.default_backend() == "gpu" else "loop"
  if args._windowed_child:
    return _run_child(args)
  shapes_path = None if args.op == "all_gather" and args.sizes_mib else find_shapes_file(
      args.shapes_file)
  shapes = json.loads(shapes_path.read_text()) if shapes_path else {}
  argv = list(sys.argv[1:] if argv is None else argv)
  variants = list(dict.fromkeys(args.variants))
  stamp = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)

  # The windowed child runs first, before this process starts its backends and claims
  # (by default 75% of) GPU memory; it builds the same rows from the same arguments.
  child = None
  want_windowed = "xla_windowed" in variants and "xla_windowed" in OP_VARIANTS[args.op]
  if want_windowed:
    child = _platforms_exclude_gpu()
    child = {"skipped": child} if child else run_windowed_child(args, argv, shapes_path, log=log)

  mesh = make_mesh(args.tp or len(jax.devices()))
  tp = mesh.devices.size
  rows = build_rows(args, shapes, tp)
  platform = jax.default_backend()
  result: dict[str, Any] = {
      "command": "python -m jaxflux.bench " + shlex.join(argv),
      "argv": argv,
      # Knobs that change what is measured (JAXFLUX_AG_ABLATE, JAXFLUX_AG_MAX_CHUNKS, XLA_FLAGS).
      "env": {k: v for k, v in sorted(os.environ.items())
              if k.startswith("JAXFLUX_") or k == "XLA_FLAGS"},
      "date": stamp.isoformat().replace("+00:00", "Z"),
      "machine": machine_info(),
      "versions": versions(),
      "settings": {
          "op": args.op, "tp": tp, "dtype": args.dtype, "iters": args.iters,
          "warmup": args.warmup, "repeats": args.repeats, "timing": args.timing,
          "chain": _chain_kind(args) if args.timing == "loop" else None,
          "rotate_mib": args.rotate_mib, "seed": args.seed, "variants": variants,
          "shapes_file": os.path.relpath(shapes_path, repo_root()) if shapes_path else None,
          "pallas_configs": ([pallas_config_name(c) for c in PALLAS_CONFIGS]
                             if args.op == "ag_gemm" else None),
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "windowed_flags": list(WINDOWED_FLAGS),
      },
      "definitions": DEFINITIONS,
      "rows": [],
  }
  out_path = _output_path(args, platform, tp, stamp)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  for i, row in enumerate(rows):
    log(f"[bench] row {i + 1}/{len(rows)}: {row.op} {row.name} M={row.M} K={row.K} N={row.N} "
        f"tp={row.tp} {row.dtype}", flush=True)
    record = bench_row(row, mesh, variants, args, log=log)
    record["key"] = row.key()
    if want_windowed:
      _merge_windowed(record, child)
    record.pop("key")
    result["rows"].append(record)
    log("        " + _row_summary(record), flush=True)
    # Written after every row so that a run cut short keeps what it measured.
    _write_json(out_path, result)
  try:  # repo-relative where it can be, so committed records name no local folders
    result["output"] = str(out_path.resolve().relative_to(repo_root()))
  except ValueError:
    result["output"] = str(out_path)
  _write_json(out_path, result)
  result["output"] = str(out_path)
  log(format_table(result))
  log(f"[bench] wrote {out_path}")
  return result


def main(argv: list[str] | None = None) -> int:
  args_list = sys.argv[1:] if argv is None else argv
  if "--_windowed-child" in args_list:
    result = run(args_list)
    print(CHILD_MARKER + json.dumps(result), flush=True)
    return 0
  run(args_list)
  return 0


if __name__ == "__main__":
  sys.exit(main())
