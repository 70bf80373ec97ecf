"""`--op grouped_gemm`: the MoE grouped GEMM, on one device.

Each row is one expert layer's grouped GEMM, y [M, N] = x_g [rows of g, K] @ w[g] [K, N] for
every expert g, with x [M, K] (M routed rows, sorted by expert), w [G, K, N] and the experts'
row counts [G] from a routing (`--routing`):
  even        M/G rows per expert, the remainder one each over the first experts
  dirichlet   shares drawn from a Dirichlet(0.5) over the G experts (numpy's
              default_rng(--seed)), rounded to whole rows summing to M (largest remainder): a
              skewed router, some experts with few or no rows; the same shares at every M and
              for every shape with the same G
Variants, timed side by side (interleaved repeats) as for the other ops:
  fused           jaxflux.grouped_matmul(impl="fused"): the fused grouped GEMM kernel; null,
                  with the reason, where it cannot run (FusedKernelUnavailableError)
  fused_<tile>    the same kernel with each tile config forced (cooperative_128x256,
                  pingpong_128x128): the evidence of jaxflux.tuning's tile choice
  ragged_dot      jaxflux.grouped_matmul(impl="xla"): lax.ragged_dot_general
  dense           one XLA dot x [M, K] @ w_dense [K, N]: the FLOPs of the grouped GEMM in one
                  dense GEMM (cuBLAS), the bar a grouped GEMM is measured against
  fused_fp8       the fused kernel on e4m3 x and w (w [G, N, K], as that kernel reads it),
                  per-tensor scales of 1, bf16 out: the FP8 grouped GEMM against the 16-bit one
                  (forward only, as FP8 calls are)
  tokamax         tokamax.ragged_dot (its own order of implementations: Mosaic GPU, Triton,
                  XLA) with the configuration its autotuner picks for the shape (a cache miss
                  autotunes, inside the variant's compile); null, with the reason, where
                  tokamax is not installed
  *_bwd           (--backward) dx and dw of each, through jax.vjp, given dy [M, N]: the forward's
                  output is unused, so the compiler drops it and only the backward is timed
FLOPs: 2*M*K*N forward, 4*M*K*N backward, for every routing (the sizes sum to M). Each variant
rotates among as many input sets as its own inputs need to stay out of L2 (--rotate-mib, as
the GEMM table does), and its output is checked against float32 products computed expert by
expert without ragged_dot (rel_err).

Roofline: the least time a grouped GEMM can take, max(2*M*K*N / dense rate, bytes / weight-read
rate), bytes = every expert's weight, x and y once; both rates measured in the same run before
the rows (measure_rates: one large dense GEMM, and a few rows against a weight far past L2, on
XLA's dot). Each grouped variant's fraction of it: roofline / ms forward, and 3 * roofline /
(ms forward + ms backward) for forward + backward (the backward's two products each cost
about a forward).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import zlib
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxflux.bench.config import (DIRICHLET_ALPHA, FLOOR_BANDWIDTH, GROUPED_BACKWARD,
                                  GROUPED_FP8_DTYPE, GROUPED_TABLE_M, GROUPED_TILE_VARIANTS,
                                  GROUPED_VARIANTS, ROOFLINE_VARIANTS, ROUTINGS)
from jaxflux.bench.inputs import random_input
from jaxflux.bench.measure import error_text, prepare, relative_error
from jaxflux.bench.routings import group_sizes
from jaxflux.bench.summary import ratio
from jaxflux.bench.table import error_lines, fmt
from jaxflux.bench.variants import Variant
from jaxflux import tuning
from jaxflux.ops.grouped_matmul import grouped_matmul

# ratio key: (numerator, denominator) of ms[numerator] / ms[denominator]; every ratio is higher
# for a faster grouped GEMM (a TFLOP/s fraction of dense's, or fused's speedup over ragged_dot).
RATIOS = {"fused_vs_dense": ("dense", "fused"),
          "ragged_dot_vs_dense": ("dense", "ragged_dot"),
          "ragged_over_fused": ("ragged_dot", "fused"),
          "tokamax_over_fused": ("tokamax", "fused"),
          "fp8_over_bf16": ("fused", "fused_fp8"),
          "fused_bwd_vs_dense_bwd": ("dense_bwd", "fused_bwd"),
          "ragged_dot_bwd_vs_dense_bwd": ("dense_bwd", "ragged_dot_bwd"),
          "ragged_over_fused_bwd": ("ragged_dot_bwd", "fused_bwd"),
          "tokamax_over_fused_bwd": ("tokamax_bwd", "fused_bwd")}
_IMPLS = {"fused": "fused", "ragged_dot": "xla"}


@dataclasses.dataclass(frozen=True)
class GroupedRow:
  """One row: x [M, K] @ w [G, K, N] (G = `experts`) with `group_sizes` [G] rows per expert
  (summing to M) from `routing`; run on one device."""
  name: str
  M: int
  K: int
  N: int
  experts: int
  routing: str
  dtype: str
  group_sizes: tuple[int, ...]
  op: ClassVar[str] = "grouped_gemm"
  tp: ClassVar[int] = 1

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.dtype).itemsize

  @property
  def shapes(self) -> dict[str, tuple[int, ...]]:
    """The arrays the variants take (group_sizes aside) and their shapes; fused_fp8 reads x and
    w in e4m3, w K-major ([G, N, K]) as its kernel takes it."""
    return {"x": (self.M, self.K), "w": (self.experts, self.K, self.N),
            "w_dense": (self.K, self.N), "dy": (self.M, self.N),
            "x_fp8": (self.M, self.K), "w_fp8": (self.experts, self.N, self.K)}

  def input_dtype(self, name: str) -> str:
    return GROUPED_FP8_DTYPE if name.endswith("_fp8") else self.dtype

  def flops(self, variant: str) -> int:
    return (4 if variant.endswith("_bwd") else 2) * self.M * self.K * self.N

  def key(self) -> list:
    return [self.op, self.name, self.M, self.K, self.N, self.experts, self.routing, self.dtype]


# --- rows ---------------------------------------------------------------------------------------

def build_rows(args, shapes: dict) -> list[GroupedRow]:
  """Every shapes.json "grouped_gemm" shape (--shapes filters) at each M (--M, default 16384)
  under each routing (--routing, default both)."""
  table = shapes.get("grouped_gemm", [])
  if args.shapes:
    known = {s["name"] for s in table}
    if not set(args.shapes) <= known:
      raise ValueError(f"--shapes: unknown name(s) {sorted(set(args.shapes) - known)}; the "
                       f"shapes file's grouped_gemm shapes are {sorted(known)}")
    table = [s for s in table if s["name"] in args.shapes]
  ms = args.M or list(GROUPED_TABLE_M)
  routings = args.routing or list(ROUTINGS)
  return [GroupedRow(s["name"], int(m), int(s["K"]), int(s["N"]), int(s["experts"]), r,
                     args.dtype, tuple(group_sizes(r, int(m), int(s["experts"]), args.seed)))
          for s in table for m in ms for r in routings]


# --- variants and their inputs ------------------------------------------------------------------

def _grouped(x, w, sizes, impl: str, **kwargs):
  """The op under test (a module function, so that tests can stand in for the fused kernel)."""
  return grouped_matmul(x, w, sizes, impl=impl, **kwargs)


def _with_tile(x, w, sizes, tile: str):
  """The fused kernel with its tile config forced (the evidence of the tuning's choice); traced
  inside the override block, which a forward-only variant needs no more of."""
  with tuning.override("grouped_matmul", tile=tile):
    return _grouped(x, w, sizes, "fused")


def _fp8(x8, w8, sizes):
  """The fused grouped GEMM on e4m3 operands (w [G, N, K]) with per-tensor scales of 1: the FP8
  kernel against the 16-bit one on the same shapes, bf16 out."""
  one = jnp.ones((), jnp.float32)
  return _grouped(x8, w8, sizes, "fused", transpose_w=True, x_scale=one, w_scale=one)


def _tokamax(x, w, sizes):
  """tokamax.ragged_dot, autotuned where its cache has no configuration for the shape."""
  try:
    import tokamax
  except ImportError as e:
    raise ImportError(f"tokamax is not installed ({e}); `pip install tokamax` (Python >= 3.12, "
                      "jax >= 0.11.1) adds this variant") from e
  with tokamax.config.autotuning_cache_miss_fallback("autotune"):
    return tokamax.ragged_dot(x, w, sizes)


def _forward(base: str) -> Callable:
  """The forward of a variant family: dense (x, w_dense) or grouped (x, w, group_sizes)."""
  if base == "dense":
    return jnp.dot
  if base == "tokamax":
    return _tokamax
  if base == "fused_fp8":
    return _fp8
  if base in GROUPED_TILE_VARIANTS:
    tile = base.removeprefix("fused_")
    return lambda x, w, sizes: _with_tile(x, w, sizes, tile)
  impl = _IMPLS[base]
  return lambda x, w, sizes: _grouped(x, w, sizes, impl)


def _backward(forward: Callable) -> Callable:
  """(x, w, *other, dy) -> (dx, dw) of forward(x, w, *other) for the cotangent dy."""

  def grads(x, w, *rest):
    *other, dy = rest
    return jax.vjp(lambda a, b: forward(a, b, *other), x, w)[1](dy)

  return grads


def make_variant(name: str) -> Variant:
  """The variant `name` (one of GROUPED_VARIANTS); x comes first, the input a loop-mode chain
  makes depend on the previous call."""
  base = name.removesuffix("_bwd")
  fn = _forward(base)
  inputs = {"dense": ("x", "w_dense"), "fused_fp8": ("x_fp8", "w_fp8", "group_sizes")}.get(
      base, ("x", "w", "group_sizes"))
  if name in GROUPED_BACKWARD:
    fn, inputs = _backward(fn), inputs + ("dy",)
  return Variant(name, fn, inputs)


def set_count(row: GroupedRow, inputs: tuple[str, ...], rotate_mib: float) -> int:
  """Input sets a variant rotates among so that its calls do not run from L2: enough for its
  own inputs' bytes to reach rotate_mib, at most 8 (inputs.input_set_count's rule)."""
  if rotate_mib <= 0:
    return 1
  nbytes = sum(math.prod(row.shapes[n]) * jnp.dtype(row.input_dtype(n)).itemsize
               for n in inputs if n in row.shapes)
  return int(min(8, max(1, math.ceil(rotate_mib * 2**20 / nbytes))))


def _random(shape: tuple[int, ...], dtype: str, sharding: NamedSharding) -> Callable:
  """Standard-normal values in dtype (FP8 ones drawn in float32 and rounded: N(0, 1) lies well
  inside e4m3's range)."""
  if dtype == GROUPED_FP8_DTYPE:
    return jax.jit(lambda key: jax.random.normal(key, shape, jnp.float32).astype(dtype),
                   out_shardings=sharding)
  return random_input(shape, dtype, sharding)


def make_inputs(row: GroupedRow, mesh: Mesh, counts: dict[str, tuple[tuple[str, ...], int]],
                seed: int) -> list[dict[str, jax.Array]]:
  """Input sets for variants given as {name: (inputs, sets)}: set s holds every array that some
  variant reads from set s (fresh standard-normal data, like the other ops' inputs) and the
  routing's group_sizes, shared by all sets."""
  copies: dict[str, int] = {}
  for inputs, n in counts.values():
    for name in inputs:
      copies[name] = max(copies.get(name, 0), n)
  sharding = NamedSharding(mesh, P())
  sizes = jax.device_put(np.asarray(row.group_sizes, np.int32), sharding)
  base = jax.random.fold_in(jax.random.key(seed), zlib.crc32(repr(row.key()).encode()) >> 1)
  sets = []
  for s in range(max(copies.values(), default=1)):
    arrays = {"group_sizes": sizes}
    for i, name in enumerate(sorted(row.shapes)):
      if copies.get(name, 0) > s:
        key = jax.random.fold_in(jax.random.fold_in(base, s), i)
        arrays[name] = _random(row.shapes[name], row.input_dtype(name), sharding)(key)
    sets.append(arrays)
  jax.block_until_ready(sets)
  return sets


# --- float32 references -------------------------------------------------------------------------

def _dot(a, b):
  return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision=lax.Precision.HIGHEST)


def _reference(name: str, row: GroupedRow) -> Callable:
  """The variant's product in float32 without ragged_dot: y [M, N], or (dx [M, K], dw [G, K, N])
  for a *_bwd variant. Grouped: a loop over the experts of full-size dots masked to each
  expert's rows (G times the FLOPs, but one dot shape to compile whatever the routing)."""
  owner = jnp.asarray(np.repeat(np.arange(row.experts), row.group_sizes))  # [M] rows' experts

  def mine(g, a):
    return jnp.where((owner == g)[:, None], a, 0)

  def grouped(x, w, _):
    body = lambda g, y: y + mine(g, _dot(x, w[g]))  # noqa: E731
    return lax.fori_loop(0, row.experts, body, jnp.zeros((row.M, row.N), jnp.float32))

  def grouped_grads(x, w, _, dy):
    def body(g, grads):
      dx, dw = grads
      return dx + mine(g, _dot(dy, w[g].T)), dw.at[g].set(_dot(mine(g, x).T, dy))
    zeros = (jnp.zeros((row.M, row.K), jnp.float32), jnp.zeros(w.shape, jnp.float32))
    return lax.fori_loop(0, row.experts, body, zeros)

  def grouped_fp8(x8, w8, sizes):  # the kernel's product of the e4m3 values, scales of 1
    return grouped(x8.astype(jnp.float32), w8.astype(jnp.float32).transpose(0, 2, 1), sizes)

  return {"dense": _dot, "dense_bwd": lambda x, w, dy: (_dot(dy, w.T), _dot(x.T, dy)),
          "fused_fp8": grouped_fp8,
          "fused": grouped, "ragged_dot": grouped, "tokamax": grouped,
          "fused_bwd": grouped_grads, "ragged_dot_bwd": grouped_grads,
          "tokamax_bwd": grouped_grads,
          **{tiled: grouped for tiled in GROUPED_TILE_VARIANTS}}[name]


def _check(name: str, row: GroupedRow, timed, y, cache: dict) -> float:
  """Largest rel_err over the outputs (y, or dx and dw) of the last warm-up call against the
  float32 reference on that call's inputs (the loop's last call takes set 0; dispatched calls
  cycle through the sets); one reference per family and set, shared by its variants."""
  last = 0 if timed.mode == "loop" else (timed.calls - 1) % len(timed.args)
  kind = "dense" if name.startswith("dense") else "fp8" if name == "fused_fp8" else "grouped"
  family = (kind, name in GROUPED_BACKWARD, last)
  if family not in cache:
    args = timed.args[last]  # the variant's inputs, in its order
    cache[family] = jax.jit(_reference(name, row))(*args)
  pairs = zip(jax.tree.leaves(y), jax.tree.leaves(cache[family]))
  return max(float(relative_error(a, b)) for a, b in pairs)


# --- one row ------------------------------------------------------------------------------------

def time_interleaved(prepared: dict, repeats: int, errors: dict) -> dict[str, list[float]]:
  """ms per call of each prepared variant over `repeats` rounds, the order rotated each round;
  a variant that fails while timing is dropped with its error."""
  samples: dict[str, list[float]] = {n: [] for n in prepared}
  names = list(prepared)
  for r in range(repeats):
    shift = r % max(1, len(names))
    for name in (n for n in names[shift:] + names[:shift] if n in prepared):
      try:
        samples[name].append(prepared[name].timed.time_ms())
      except Exception as e:  # noqa: BLE001 - recorded; the other variants go on
        errors[name] = "failed while timing: " + error_text(e)
        del prepared[name], samples[name]
  return samples


def bench_row(row: GroupedRow, mesh: Mesh, variants: list[str], args, log=print) -> dict:
  """Builds, checks, warms up and times the requested variants of one row on mesh's one
  device; returns the row's JSON record."""
  built = {v: make_variant(v) for v in GROUPED_VARIANTS if v in variants}
  counts = {v: (b.inputs, set_count(row, b.inputs, args.rotate_mib)) for v, b in built.items()}
  input_sets = make_inputs(row, mesh, counts, args.seed)
  errors: dict[str, str] = {}
  rel_err: dict[str, float] = {}
  prepared: dict = {}
  references: dict = {}
  for name, variant in built.items():
    sets = input_sets[:counts[name][1]]
    try:
      prep, y = prepare(variant, mesh, sets, args)
    except Exception as e:  # noqa: BLE001 - a variant that cannot run is recorded, never replaced
      errors[name] = error_text(e)
      continue
    try:
      rel_err[name] = _check(name, row, prep.timed, y, references)
    except Exception as e:  # noqa: BLE001 - the check's failure does not stop the timing
      errors[f"{name}relative_error"] = error_text(e)
    del y
    prepared[name] = prep
  del references
  samples = time_interleaved(prepared, args.repeats, errors)
  record = summarize_row(row, samples, errors, rel_err,
                         {n: p.timed.calls for n, p in prepared.items()},
                         {n: round(p.compile_s, 3) for n, p in prepared.items()},
                         {n: c[1] for n, c in counts.items()})
  if args.timing == "device":
    record["device_queue_filled"] = {n: p.timed.queue_filled for n, p in prepared.items()}
  del prepared, input_sets
  return record


# --- the record ---------------------------------------------------------------------------------

def _floor_ms(row: GroupedRow, variant: str) -> float:
  """Time to move a variant's least bytes once at FLOOR_BANDWIDTH (x and y, or x, dy, dx; the
  weights of the experts that have rows, twice backward): a real call cannot beat it."""
  M, K, N = row.M, row.K, row.N
  weights = 1 if variant.startswith("dense") else sum(1 for s in row.group_sizes if s)
  backward = variant in GROUPED_BACKWARD
  elements = (2 * M * K + M * N if backward else M * K + M * N) + (1 + backward) * weights * K * N
  return elements * row.itemsize / FLOOR_BANDWIDTH * 1e3


def _floor_warnings(row: GroupedRow, ms: dict) -> list[str]:
  out = []
  for v, t in ms.items():
    floor = _floor_ms(row, v)
    if t is not None and t < floor:
      out.append(f"{v}: {t:.4g} ms per call is below the time to move its bytes once at "
                 f"{FLOOR_BANDWIDTH / 1e12:g} TB/s ({floor:.4g} ms): calls were dropped or "
                 "merged (a *_bwd variant's backward dead-code eliminated?)")
  return out


def summarize_row(row: GroupedRow, samples: dict, errors: dict, rel_err: dict, calls: dict,
                  compile_s: dict, input_sets: dict) -> dict:
  """The JSON record of a row: every variant of the op, null (with the reason in `errors`)
  where it did not run."""
  ms = {v: (statistics.median(samples[v]) if samples.get(v) else None) for v in GROUPED_VARIANTS}
  for v, t in ms.items():
    if t is None and v not in errors:
      errors[v] = "not requested"
  sizes = row.group_sizes
  return {
      "op": row.op, "name": row.name, "M": row.M, "K": row.K, "N": row.N,
      "experts": row.experts, "routing": row.routing, "dtype": row.dtype, "tp": row.tp,
      "group_sizes": list(sizes), "group_sizes_min": min(sizes), "group_sizes_max": max(sizes),
      "empty_groups": sum(1 for s in sizes if s == 0),
      "shapes": {n: list(s) for n, s in row.shapes.items()},
      "flops": {"forward": row.flops("fused"), "backward": row.flops("fused_bwd")},
      "input_sets": input_sets, "calls_per_run": calls, "compile_and_first_run_s": compile_s,
      "ms": ms,
      "spread_ms": {v: ([min(samples[v]), max(samples[v])] if samples.get(v) else None)
                    for v in GROUPED_VARIANTS},
      "samples_ms": samples,
      "tflops": {v: (None if t is None else row.flops(v) / t / 1e9) for v, t in ms.items()},
      "ratios": {k: ratio(ms[a], ms[b]) for k, (a, b) in RATIOS.items()},
      "rel_err": rel_err, "errors": errors, "warnings": _floor_warnings(row, ms),
  }


def _row_label(r: dict) -> str:
  return f"{r['name']} M={r['M']} {r['routing']}"


def _summary_values(rows: list[dict]) -> dict[str, list[tuple[float, str]]]:
  """(value, row label) per summary key: each ratio, and each variant's roofline fractions
  (`<variant>_of_roofline`, `<variant>_fwd_bwd_of_roofline`)."""
  values: dict[str, list[tuple[float, str]]] = {}
  for key in RATIOS:
    values[key] = [(r["ratios"][key], _row_label(r)) for r in rows
                   if r["ratios"].get(key) is not None]
  for v in ROOFLINE_VARIANTS:
    for part, suffix in (("fraction", "of_roofline"), ("fraction_fwd_bwd", "fwd_bwd_of_roofline")):
      values[f"{v}_{suffix}"] = [(r["roofline"][part][v], _row_label(r)) for r in rows
                                 if (r.get("roofline") or {}).get(part, {}).get(v) is not None]
  return values


def summarize_table(rows: list[dict]) -> dict[str, Any]:
  """Per ratio and roofline fraction: rows measured, mean, and the worst (lowest: each is
  higher-is-better)."""
  out: dict[str, Any] = {}
  for key, pairs in _summary_values(rows).items():
    if not pairs:
      continue
    worst = min(pairs)
    out[key] = {"rows": len(pairs), "of_rows": len(rows),
                "mean": statistics.fmean(p[0] for p in pairs),
                "worst": worst[0], "worst_row": worst[1]}
  return out


def _block(rows: list[dict], suffix: str) -> list[str]:
  """One table line per row for the forward variants (suffix "") or the backward ("_bwd")."""
  fused, ragged, dense, toka = (f"{v}{suffix}" for v in ("fused", "ragged_dot", "dense",
                                                           "tokamax"))
  title = "backward, dx and dw (4*M*K*N)" if suffix else "forward (2*M*K*N)"
  part = "fraction_fwd_bwd" if suffix else "fraction"
  lines = [f"{title}: ms per call, TF/s; f/dense = fused's TF/s over dense's, r/f and t/f = "
           "ragged_dot's and tokamax's time over fused's, roof = fused's fraction of the "
           "roofline" + (" (forward + backward against three forwards')" if suffix else ""),
           f"{'name':<22}{'M':>7} {'routing':<10}{'G':>4}{'rows/expert':>13}"
           f"{'fused':>9}{'ragged':>9}{'tokamax':>9}{'dense':>9}{'TF fused':>10}"
           f"{'TF dense':>10}{'f/dense':>9}{'r/f':>7}{'t/f':>7}{'roof':>7}"]
  for r in rows:
    ms, tf, ratios = r["ms"], r["tflops"], r["ratios"]
    roof = (r.get("roofline") or {}).get(part, {}).get("fused")
    spread = f"{r['group_sizes_min']}-{r['group_sizes_max']}"
    lines.append(f"{r['name']:<22}{r['M']:>7} {r['routing']:<10}{r['experts']:>4}{spread:>13}"
                 f"{fmt(ms[fused]):>9}{fmt(ms[ragged]):>9}{fmt(ms[toka]):>9}{fmt(ms[dense]):>9}"
                 f"{fmt(tf[fused], '.1f'):>10}{fmt(tf[dense], '.1f'):>10}"
                 f"{fmt(ratios[f'{fused}_vs_{dense}']):>9}"
                 f"{fmt(ratios[f'ragged_over_fused{suffix}'], '.2f'):>7}"
                 f"{fmt(ratios[f'tokamax_over_fused{suffix}'], '.2f'):>7}{fmt(roof, '.2f'):>7}")
  return lines


def format_table(result: dict) -> str:
  """The table printed at the end of a run: forward, then backward when it was asked for."""
  rows = result["rows"]
  if not rows:
    return "(no rows)"
  lines = _block(rows, "")
  if any(v in GROUPED_BACKWARD for v in result["settings"]["variants"]):
    lines += _block(rows, "_bwd")
  rates = result.get("rates") or {}
  lines.append(f"roofline rates (XLA's dot, this run): dense "
               f"{fmt(rates.get('dense_tflops'), '.1f')} TFLOP/s, weight read "
               f"{fmt(rates.get('weight_read_tbps'), '.2f')} TB/s")
  for key, s in result.get("summary", {}).items():
    lines.append(f"{key}: mean {fmt(s['mean'])}, worst {fmt(s['worst'])} ({s['worst_row']}), "
                 f"{s['rows']} of {s['of_rows']} rows")
  lines.extend(error_lines(rows))
  return "\n".join(lines)


def settings(args) -> dict:
  """The op's own entries of the record's `settings`."""
  return {"routing": list(args.routing or ROUTINGS), "dirichlet_alpha": DIRICHLET_ALPHA,
          "dirichlet_seed": args.seed,
          "backward": "dx and dw through jax.vjp given dy; the unused forward dropped by the "
                      "compiler, so not timed",
          "reference": "float32 products expert by expert (each expert's rows masked out of a "
                       "full dot), precision HIGHEST"}
