"""`--op moe`'s record: the checks of the fused step against ragged_dot's, a row's JSON record,
the table's summary and printout, and the op's settings (the measuring is in moe_table, whose
MoERow is the `row` taken here)."""
from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np

from jaxflux.bench.config import (FLOOR_BANDWIDTH, MOE_AUX_WEIGHT, MOE_MAX_REL_DIFF,
                                  MOE_PARAM_DTYPE, MOE_VARIANTS)
from jaxflux.bench.measure import relative_error
from jaxflux.bench.summary import ratio
from jaxflux.bench.table import error_lines, fmt

# ratio key: (numerator, denominator) of ms[numerator] / ms[denominator]; higher is a faster
# fused step.
RATIOS = {"ragged_over_fused": ("ragged_dot", "fused")}
STEP_VARIANTS = ("fused", "ragged_dot")  # the train step itself; fused_gemms is its GEMMs
# The loss and its terms, in the order a call returns them.
LOSS_TERMS = ("total", "output", "load_balancing")


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


# --- the record ---------------------------------------------------------------------------------

def _floor_ms(row) -> float:
  """Time to move a step's least bytes once at FLOOR_BANDWIDTH (read x, ct and the params;
  write dx and the params' gradients): a real call cannot beat it."""
  params = sum(row.nbytes(n) for n in row.weight_names)
  return (2 * params + 3 * row.nbytes("x")) / FLOOR_BANDWIDTH * 1e3


def _warnings(row, ms: dict, losses: dict, checks: dict | None) -> list[str]:
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


def summarize_row(row, samples: dict, errors: dict, losses: dict, checks: dict | None,
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
