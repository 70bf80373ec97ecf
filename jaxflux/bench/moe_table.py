"""`--op moe`: the train step of the MoE layer (`jaxflux.MoE`, Linen), on one device.

Each row is one MoE block of a model: M tokens x [M, hidden] through `jaxflux.MoE` (router,
top-k routing, expert MLP on grouped matmuls, weighted sum over the k experts) with the block's
experts, experts per token, intermediate size and activation; params in float32 (the layer's
default param_dtype, as a mixed-precision training step keeps them), computation in --dtype.
The step, under `jax.jit`:

  loss(params, x) = mean(y * ct) + MOE_AUX_WEIGHT * load_balancing_loss
  step(params, x) = jax.value_and_grad(loss, argnums=(params, x))

with ct [M, hidden] a fixed standard-normal cotangent and load_balancing_loss the one the layer
sows (`intermediates/load_balancing_loss`). A call returns the loss, its two terms and every
gradient (gate, wi_*, wo and x), so the compiler can drop no part of the backward.
Variants, timed side by side (interleaved repeats) as for the other ops, on the same params and
inputs:
  fused        jaxflux.MoE(impl="fused"): the expert GEMMs on the fused grouped GEMM kernel,
               forward and backward; null, with the reason, where it cannot run
               (FusedKernelUnavailableError)
  ragged_dot   the same layer with impl="xla": lax.ragged_dot_general
  fused_gemms  the fused step's grouped GEMMs alone, on the kernel: the expert MLP's
               projections forward (x_rows [M*k, hidden] by each wi, h [M*k, I] by wo) and
               their dx and dw, on the router's group sizes of the first input set, weights
               already in --dtype; `outside_gemms_share` = 1 - its time / fused's, what the
               step spends on the router, sorts, permutes, casts, the activation and the
               combine (rows sorted by expert; fresh data, so no value is checked)
Checks, on the last warm-up call of each (same input set): the losses of the two variants and
their relative difference (`loss_rel_diff`, and `output_loss_rel_diff` for the mean(y * ct) term
alone: the load-balancing term comes from the router, the same program in both), and the
relative difference of each gradient, ||g_fused - g_ragged||_F / ||g_ragged||_F
(`grad_rel_diff`, the largest in `grad_rel_diff_max`); a difference above MOE_MAX_REL_DIFF is a
warning. FLOPs: 3x the forward's matmuls (router 2*M*hidden*E, expert MLP
2*M*k*hidden*I per projection), the usual forward + backward count.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import zlib
from typing import Any, Callable, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxflux.bench.config import (FLOOR_BANDWIDTH, MOE_AUX_WEIGHT, MOE_MAX_REL_DIFF,
                                  MOE_PARAM_DTYPE, MOE_TABLE_M, MOE_VARIANTS)
from jaxflux.bench.grouped_table import time_interleaved
from jaxflux.bench.inputs import random_input
from jaxflux.bench.measure import error_text, prepare, relative_error
from jaxflux.bench.summary import ratio
from jaxflux.bench.table import error_lines, fmt
from jaxflux.bench.timing import chain_kind
from jaxflux.bench.variants import Variant
from jaxflux.layers import _moe
from jaxflux.layers.moe_linen import MoE
from jaxflux.ops.grouped_matmul import grouped_matmul

# ratio key: (numerator, denominator) of ms[numerator] / ms[denominator]; higher is a faster
# fused step.
RATIOS = {"ragged_over_fused": ("ragged_dot", "fused")}
STEP_VARIANTS = ("fused", "ragged_dot")  # the train step itself; fused_gemms is its GEMMs
_IMPLS = {"fused": "fused", "ragged_dot": "xla"}
# The loss and its terms, in the order a call returns them.
LOSS_TERMS = ("total", "output", "load_balancing")


@dataclasses.dataclass(frozen=True)
class MoERow:
  """One row: M tokens [M, hidden] through an MoE block of `experts` experts, `top_k` per
  token, each an MLP of width `intermediate`; run on one device."""
  name: str
  M: int
  hidden: int
  intermediate: int
  experts: int
  top_k: int
  activation: str
  norm_topk_prob: bool
  dtype: str
  op: ClassVar[str] = "moe"
  tp: ClassVar[int] = 1
  param_dtype: ClassVar[str] = MOE_PARAM_DTYPE

  @property
  def weight_names(self) -> tuple[str, ...]:
    """The layer's params, in the order the variants take them."""
    return ("gate", *_moe.expert_param_names(self.activation), "wo")

  @property
  def shapes(self) -> dict[str, tuple[int, ...]]:
    """Every array the variants take and its shape: x and ct in dtype, the params in
    param_dtype."""
    H, E, I = self.hidden, self.experts, self.intermediate
    wi = {n: (E, H, I) for n in _moe.expert_param_names(self.activation)}
    rows = self.M * self.top_k
    return {"x": (self.M, H), "ct": (self.M, H), "gate": (H, E), **wi, "wo": (E, I, H),
            # fused_gemms': the routed rows, the hidden rows, and the weights in dtype
            "x_rows": (rows, H), "h_rows": (rows, I), "dy_rows": (rows, H),
            **{f"{n}_{self.dtype}": (E, H, I) for n in wi}, f"wo_{self.dtype}": (E, I, H)}

  def inputs(self, variant: str) -> tuple[str, ...]:
    """A variant's inputs, in its order: fused_gemms' the rows, the group sizes and the expert
    kernels in the computation dtype; the train step's x, ct and the params."""
    if variant == "fused_gemms":
      return ("x_rows", "h_rows", "dy_rows", "group_sizes",
              *(f"{n}_{self.dtype}" for n in self.weight_names[1:]))
    return ("x", "ct", *self.weight_names)

  @property
  def gemm_flops(self) -> int:
    """fused_gemms' FLOPs: the expert projections, forward and backward (3x the forward)."""
    projections = len(_moe.expert_param_names(self.activation)) + 1
    return 3 * 2 * self.M * self.top_k * self.hidden * self.intermediate * projections

  @property
  def flops(self) -> int:
    """Matmul FLOPs of one step: 3x the forward's (router and expert MLP)."""
    return 3 * 2 * self.M * self.hidden * self.experts + self.gemm_flops

  def nbytes(self, name: str) -> int:
    dtype = self.param_dtype if name in self.weight_names else self.dtype
    return math.prod(self.shapes[name]) * jnp.dtype(dtype).itemsize

  def key(self) -> list:
    return [self.op, self.name, self.M, self.hidden, self.intermediate, self.experts,
            self.top_k, self.activation, self.norm_topk_prob, self.dtype]

  def describe(self) -> str:
    return (f"{self.op} {self.name} M={self.M} hidden={self.hidden} "
            f"intermediate={self.intermediate} E={self.experts} k={self.top_k} "
            f"{self.activation} tp={self.tp} {self.dtype}")


# --- rows ---------------------------------------------------------------------------------------

def build_rows(args, shapes: dict) -> list[MoERow]:
  """Every shapes.json "moe" block (--shapes filters) at each M (--M, default 4096 tokens)."""
  table = shapes.get("moe", [])
  if args.shapes:
    known = {s["name"] for s in table}
    if not set(args.shapes) <= known:
      raise ValueError(f"--shapes: unknown name(s) {sorted(set(args.shapes) - known)}; the "
                       f"shapes file's moe blocks are {sorted(known)}")
    table = [s for s in table if s["name"] in args.shapes]
  ms = args.M or list(MOE_TABLE_M)
  return [MoERow(s["name"], int(m), int(s["hidden"]), int(s["intermediate"]),
                 int(s["experts"]), int(s["top_k"]), s.get("activation", "swiglu"),
                 bool(s.get("norm_topk_prob", True)), args.dtype)
          for s in table for m in ms]


# --- the layer, the step, the inputs ------------------------------------------------------------

def _layer(row: MoERow, impl: str) -> MoE:
  """The layer under test (a module function, so that tests can stand in for the fused
  kernel)."""
  return MoE(num_experts=row.experts, num_experts_per_tok=row.top_k,
             intermediate_size=row.intermediate, activation=row.activation,
             norm_topk_prob=row.norm_topk_prob, dtype=jnp.dtype(row.dtype),
             param_dtype=jnp.dtype(row.param_dtype), impl=impl)


def train_step(layer: MoE, weight_names: tuple[str, ...]) -> Callable:
  """(x, ct, *params) -> (losses [3] float32: LOSS_TERMS, grads {param: d, "x": dx}) of the loss
  in the module docstring."""

  def loss(params, x, ct):
    y, state = layer.apply({"params": params}, x, mutable=["intermediates"])
    output = jnp.mean(y.astype(jnp.float32) * ct.astype(jnp.float32))
    balance = state["intermediates"]["load_balancing_loss"][0]
    return output + MOE_AUX_WEIGHT * balance, (output, balance)

  def step(x, ct, *weights):
    params = dict(zip(weight_names, weights))
    (total, (output, balance)), (dparams, dx) = jax.value_and_grad(
        loss, argnums=(0, 1), has_aux=True)(params, x, ct)
    return jnp.stack([total, output, balance]), {**dparams, "x": dx}

  return step


def _grouped(x, w, sizes):
  """The kernel under test in fused_gemms (a module function, so that tests can stand in)."""
  return grouped_matmul(x, w, sizes, impl="fused")


def expert_gemms(x_rows, h_rows, dy_rows, sizes, *weights):
  """The expert MLP's grouped GEMMs of one step, without anything around them: each first
  projection x_rows @ wi and h_rows @ wo forward, and the dx and dw of each (dy_rows the
  cotangent of the second, h_rows' first columns reused for the first ones')."""
  *wi, wo = weights

  def forward(x, h, wi, wo):
    return [_grouped(x, w, sizes) for w in wi], _grouped(h, wo, sizes)

  (ys, z), vjp = jax.vjp(forward, x_rows, h_rows, tuple(wi), wo)
  return vjp(([h_rows.astype(y.dtype) for y in ys], dy_rows.astype(z.dtype)))


def make_variant(name: str, row: MoERow) -> Variant:
  """The variant `name` (one of MOE_VARIANTS); x (x_rows) comes first, the input a loop-mode
  chain makes depend on the previous call (through the output's first leaf)."""
  if name == "fused_gemms":
    return Variant(name, expert_gemms, row.inputs(name))
  fn = train_step(_layer(row, _IMPLS[name]), row.weight_names)
  return Variant(name, fn, row.inputs(name))


def set_count(row: MoERow, args, names: tuple[str, ...]) -> int:
  """Input sets the variants rotate among so that their calls do not run from L2: enough for the
  bytes of the inputs `names` (params included) to reach --rotate-mib, at most 8
  (inputs.input_set_count's rule). One in loop mode with the perturb chain: it makes each call
  depend on the previous call's loss only, so within a loop step every call but the last could
  lose its gradients."""
  if args.rotate_mib <= 0 or (args.timing == "loop" and chain_kind(args) == "perturb"):
    return 1
  nbytes = sum(row.nbytes(n) for n in names if n in row.shapes)
  return int(min(8, max(1, math.ceil(args.rotate_mib * 2**20 / max(1, nbytes)))))


def _initializer(row: MoERow, sharding: NamedSharding) -> Callable:
  """key -> the layer's params as its own initializers draw them (float32), compiled once per
  layer: the rows of a layer at several M share it."""
  return _layer_initializer(dataclasses.replace(row, M=1), sharding)


@functools.lru_cache(maxsize=16)
def _layer_initializer(row: MoERow, sharding: NamedSharding) -> Callable:
  layer = _layer(row, "xla")  # the params do not depend on impl
  probe = jnp.zeros((1, row.hidden), row.dtype)
  return jax.jit(lambda key: nn.unbox(layer.init(key, probe))["params"], out_shardings=sharding)


def make_inputs(row: MoERow, mesh: Mesh, n_sets: int, seed: int,
                gemms: bool = True) -> list[dict[str, jax.Array]]:
  """`n_sets` input sets, shared by every variant: x and ct fresh standard-normal data in the
  row's dtype, the params the layer's own initializers draw (float32), and the group sizes the
  router gives on the first set; with `gemms`, fused_gemms' rows x_rows, h_rows and dy_rows
  likewise and the expert params cast to the dtype."""
  sharding = NamedSharding(mesh, P())
  base = jax.random.fold_in(jax.random.key(seed), zlib.crc32(repr(row.key()).encode()) >> 1)
  init = _initializer(row, sharding)
  sets = []
  for s in range(n_sets):
    key = jax.random.fold_in(base, s)
    names = ("x", "ct") + (("x_rows", "h_rows", "dy_rows") if gemms else ())
    arrays = {name: random_input(row.shapes[name], row.dtype, sharding)(jax.random.fold_in(key, i))
              for i, name in enumerate(names)}
    params = init(jax.random.fold_in(key, len(names)))
    arrays.update({name: params[name] for name in row.weight_names})
    if gemms:
      arrays.update({f"{n}_{row.dtype}": params[n].astype(row.dtype) for n in row.weight_names
                     if n != "gate"})
    sets.append(arrays)
  sizes = jnp.asarray(expert_rows(row, sets[0]), jnp.int32)
  for arrays in sets:
    arrays["group_sizes"] = jax.device_put(sizes, sharding)
  jax.block_until_ready(sets)
  return sets


def expert_rows(row: MoERow, inputs: dict[str, jax.Array]) -> list[int]:
  """(token, expert) pairs per expert that the router makes of an input set (both variants
  route alike: the router does not depend on impl)."""
  fn = jax.jit(lambda x, gate: _moe.route(x, gate, row.top_k, row.norm_topk_prob, None)[2])
  return [int(round(float(n))) for n in np.asarray(fn(inputs["x"], inputs["gate"]))]


# --- the checks ---------------------------------------------------------------------------------

def _rel_diff(a: float, b: float) -> float | None:
  """|a - b| / |b|; 0 when equal, None where it is undefined (b = 0 alone, or NaN)."""
  if a == b:
    return 0.0
  if b == 0 or not math.isfinite(a) or not math.isfinite(b):
    return None
  return abs(a - b) / abs(b)


def compare(fused, ragged) -> dict[str, Any]:
  """The fused step's output against ragged_dot's on the same inputs: the losses' relative
  differences and each gradient's relative Frobenius difference."""
  (lf, gf), (lr, gr) = fused, ragged
  lf, lr = (np.asarray(a, np.float64) for a in (lf, lr))
  grads = {name: float(relative_error(gf[name], gr[name])) for name in gr}
  finite = [v for v in grads.values() if math.isfinite(v)]
  return {"loss_rel_diff": _rel_diff(float(lf[0]), float(lr[0])),
          "output_loss_rel_diff": _rel_diff(float(lf[1]), float(lr[1])),
          "grad_rel_diff": grads,
          "grad_rel_diff_max": (max(grads.values()) if len(finite) == len(grads) and grads
                                else None)}


def _last_set(timed) -> int:
  """The input set of a timed run's last call (the loop's last call takes set 0; dispatched
  calls cycle through the sets)."""
  return 0 if timed.mode == "loop" else (timed.calls - 1) % len(timed.args)


# --- one row ------------------------------------------------------------------------------------

def bench_row(row: MoERow, mesh: Mesh, variants: list[str], args, log=print) -> dict:
  """Builds, warms up, checks and times the requested variants of one row on mesh's one device;
  returns the row's JSON record."""
  names = {n for v in MOE_VARIANTS if v in variants for n in row.inputs(v)}
  n_sets = set_count(row, args, tuple(names))
  input_sets = make_inputs(row, mesh, n_sets, args.seed, gemms="fused_gemms" in variants)
  errors: dict[str, str] = {}
  prepared: dict = {}
  outputs: dict[str, tuple[int, Any]] = {}
  losses: dict[str, dict[str, float]] = {}
  for name in (v for v in MOE_VARIANTS if v in variants):
    try:
      prep, y = prepare(make_variant(name, row), mesh, input_sets, args)
    except Exception as e:  # noqa: BLE001 - a variant that cannot run is recorded, never replaced
      errors[name] = error_text(e)
      continue
    prepared[name] = prep
    if name not in STEP_VARIANTS:  # fused_gemms: its GEMMs' time alone, no loss
      del y
      continue
    losses[name] = dict(zip(LOSS_TERMS, (float(v) for v in np.asarray(y[0], np.float64))))
    outputs[name] = (_last_set(prep.timed), y)
    del y
  checks = None
  if len(outputs) == 2:
    (set_f, y_f), (set_r, y_r) = outputs["fused"], outputs["ragged_dot"]
    try:
      if set_f != set_r:
        raise RuntimeError(f"the warm-up outputs come from input sets {set_f} and {set_r}")
      checks = compare(y_f, y_r)
    except Exception as e:  # noqa: BLE001 - the check's failure does not stop the timing
      errors["comparison"] = error_text(e)
    del y_f, y_r
  outputs.clear()
  rows_per_expert = [int(n) for n in np.asarray(input_sets[0]["group_sizes"])]
  samples = time_interleaved(prepared, args.repeats, errors)
  record = summarize_row(row, samples, errors, losses, checks,
                         {n: p.timed.calls for n, p in prepared.items()},
                         {n: round(p.compile_s, 3) for n, p in prepared.items()}, n_sets,
                         rows_per_expert)
  if args.timing == "device":
    record["device_queue_filled"] = {n: p.timed.queue_filled for n, p in prepared.items()}
  del prepared, input_sets
  return record


# --- the record ---------------------------------------------------------------------------------

def _floor_ms(row: MoERow) -> float:
  """Time to move a step's least bytes once at FLOOR_BANDWIDTH (read x, ct and the params;
  write dx and the params' gradients): a real call cannot beat it."""
  params = sum(row.nbytes(n) for n in row.weight_names)
  return (2 * params + 3 * row.nbytes("x")) / FLOOR_BANDWIDTH * 1e3


def _warnings(row: MoERow, ms: dict, losses: dict, checks: dict | None) -> list[str]:
  out = []
  floor = _floor_ms(row)
  for v, t in ms.items():
    if v in STEP_VARIANTS and t is not None and t < floor:
      out.append(f"{v}: {t:.4g} ms per call is below the time to move its bytes once at "
                 f"{FLOOR_BANDWIDTH / 1e12:g} TB/s ({floor:.4g} ms): calls were dropped or "
                 "merged")
  for v, terms in losses.items():
    if not all(math.isfinite(t) for t in terms.values()):
      out.append(f"{v}: a loss term is not finite: {terms}")
  if checks is not None:
    for key in ("output_loss_rel_diff", "grad_rel_diff_max"):
      value = checks[key]
      if value is None or not value <= MOE_MAX_REL_DIFF:
        out.append(f"{key} {value}: the fused step does not match ragged_dot's (limit "
                   f"{MOE_MAX_REL_DIFF:g})")
  return out


def summarize_row(row: MoERow, samples: dict, errors: dict, losses: dict, checks: dict | None,
                  calls: dict, compile_s: dict, input_sets: int,
                  rows_per_expert: list[int] | None) -> dict:
  """The JSON record of a row: both variants, null (with the reason in `errors`) where one did
  not run; the checks null unless both ran."""
  ms = {v: (statistics.median(samples[v]) if samples.get(v) else None) for v in MOE_VARIANTS}
  for v, t in ms.items():
    if t is None and v not in errors:
      errors[v] = "not requested"
  checks = checks or {}
  gemm_share = ratio(ms["fused_gemms"], ms["fused"])
  return {
      "op": row.op, "name": row.name, "M": row.M, "hidden": row.hidden,
      "intermediate": row.intermediate, "experts": row.experts, "top_k": row.top_k,
      "activation": row.activation, "norm_topk_prob": row.norm_topk_prob, "dtype": row.dtype,
      "param_dtype": row.param_dtype, "tp": row.tp, "routed_rows": row.M * row.top_k,
      "expert_rows": rows_per_expert,
      "expert_rows_min": None if rows_per_expert is None else min(rows_per_expert),
      "expert_rows_max": None if rows_per_expert is None else max(rows_per_expert),
      "shapes": {n: list(s) for n, s in row.shapes.items()},
      "flops": row.flops, "input_sets": input_sets, "calls_per_run": calls,
      "compile_and_first_run_s": compile_s,
      "ms": ms,
      "spread_ms": {v: ([min(samples[v]), max(samples[v])] if samples.get(v) else None)
                    for v in MOE_VARIANTS},
      "samples_ms": samples,
      "tflops": {v: (None if t is None else
                     (row.gemm_flops if v == "fused_gemms" else row.flops) / t / 1e9)
                 for v, t in ms.items()},
      "gemm_share": gemm_share,
      "outside_gemms_share": None if gemm_share is None else 1 - gemm_share,
      "ratios": {k: ratio(ms[a], ms[b]) for k, (a, b) in RATIOS.items()},
      "loss": {v: (losses[v]["total"] if v in losses else None) for v in STEP_VARIANTS},
      "loss_terms": {v: losses.get(v) for v in STEP_VARIANTS},
      "loss_rel_diff": checks.get("loss_rel_diff"),
      "output_loss_rel_diff": checks.get("output_loss_rel_diff"),
      "grad_rel_diff": checks.get("grad_rel_diff"),
      "grad_rel_diff_max": checks.get("grad_rel_diff_max"),
      "errors": errors, "warnings": _warnings(row, ms, losses, checks or None),
  }


def _row_label(r: dict) -> str:
  return f"{r['name']} M={r['M']}"


def summarize_table(rows: list[dict]) -> dict[str, Any]:
  """ragged_over_fused: rows measured, mean and the worst (lowest); each check and the share
  outside the GEMMs: the worst (largest) and its row."""
  out: dict[str, Any] = {}
  for key in RATIOS:
    pairs = [(r["ratios"][key], _row_label(r)) for r in rows if r["ratios"].get(key) is not None]
    if pairs:
      worst = min(pairs)
      out[key] = {"rows": len(pairs), "of_rows": len(rows),
                  "mean": statistics.fmean(p[0] for p in pairs),
                  "worst": worst[0], "worst_row": worst[1]}
  for key in ("loss_rel_diff", "output_loss_rel_diff", "grad_rel_diff_max",
              "outside_gemms_share"):
    pairs = [(r[key], _row_label(r)) for r in rows if r.get(key) is not None]
    if pairs:
      worst = max(pairs)
      out[key] = {"rows": len(pairs), "of_rows": len(rows), "worst": worst[0],
                  "worst_row": worst[1]}
  return out


def format_table(result: dict) -> str:
  """The table printed at the end of a run."""
  rows = result["rows"]
  if not rows:
    return "(no rows)"
  lines = ["MoE layer train step (forward + backward): ms per call, TF/s (3x the forward's "
           "matmul FLOPs); r/f = ragged_dot's time over fused's; out = the share of fused's "
           "step outside its grouped GEMMs;",
           "loss = ragged_dot's; d loss, d grad = relative differences of fused's loss and "
           "gradients (the largest) from ragged_dot's",
           f"{'name':<16}{'M':>7}{'E':>5}{'k':>3}{'rows/expert':>13}{'fused':>10}{'ragged':>10}"
           f"{'r/f':>7}{'out':>6}{'TF fused':>10}{'TF ragged':>10}{'loss':>11}{'d loss':>10}"
           f"{'d grad':>10}"]
  for r in rows:
    ms, tf = r["ms"], r["tflops"]
    spread = ("-" if r["expert_rows_min"] is None
              else f"{r['expert_rows_min']}-{r['expert_rows_max']}")
    lines.append(f"{r['name']:<16}{r['M']:>7}{r['experts']:>5}{r['top_k']:>3}{spread:>13}"
                 f"{fmt(ms['fused']):>10}{fmt(ms['ragged_dot']):>10}"
                 f"{fmt(r['ratios']['ragged_over_fused'], '.2f'):>7}"
                 f"{fmt(r['outside_gemms_share'], '.2f'):>6}"
                 f"{fmt(tf['fused'], '.1f'):>10}{fmt(tf['ragged_dot'], '.1f'):>10}"
                 f"{fmt(r['loss']['ragged_dot'], '.4g'):>11}{fmt(r['loss_rel_diff'], '.1e'):>10}"
                 f"{fmt(r['grad_rel_diff_max'], '.1e'):>10}")
  for key, s in result.get("summary", {}).items():
    if "mean" in s:
      lines.append(f"{key}: mean {fmt(s['mean'])}, worst {fmt(s['worst'])} ({s['worst_row']}), "
                   f"{s['rows']} of {s['of_rows']} rows")
    else:
      lines.append(f"{key}: worst {fmt(s['worst'], '.2e')} ({s['worst_row']}), {s['rows']} of "
                   f"{s['of_rows']} rows")
  lines.extend(error_lines(rows))
  lines.extend(f"warning: {w}" for r in rows for w in r["warnings"])
  return "\n".join(lines)


def settings(args) -> dict:
  """The op's own entries of the record's `settings`."""
  return {"layer": "jaxflux.MoE (Linen), params in float32, computation in --dtype",
          "param_dtype": MOE_PARAM_DTYPE,
          "loss": f"mean(y * ct) + {MOE_AUX_WEIGHT:g} * load_balancing_loss, ct [M, hidden] "
                  "a fixed standard-normal cotangent",
          "aux_weight": MOE_AUX_WEIGHT,
          "step": "jax.jit of jax.value_and_grad(loss) w.r.t. the params and x; a call returns "
                  "the loss terms and every gradient",
          "reference": "ragged_dot: the checks compare fused's loss and gradients with it",
          "max_rel_diff": MOE_MAX_REL_DIFF}
