"""`--op gemm --candidates`: the tuning sweep behind jaxflux.tuning's table.

Each ag_gemm and gemm_rs row times every candidate choice of its fused op's GEMM
(`jaxflux.tuning.candidates`) beside XLA's dot on the same operands, interleaved as the other
variants are:
  ag_gemm rows  the AG+GEMM kernel with its waits off (as `gemm_only`) under each tile and
                swizzle, against `xla` (jnp.dot)
  gemm_rs rows  the own-rows kernel reading C (as `own_rows`) under each own-rows schedule and
                swizzle, against `xla_own_rows_c` (jnp.dot + C, which XLA fuses into the GEMM)
  FP8 rows      (--dtype float8_*) `fp8_gemm_only` under each candidate (gemm_rs: the peer rows'
                GEMM, then the own-rows kernel under the candidate), against `xla_fp8_fast`
                (XLA's FP8 dot, cuBLASLt, accumulating as the fused kernels do)
gemm_table.py builds the candidate variants; this module names and parses them and summarizes
their times. A candidate variant is named `<family>:<field>=<value>/<field>=<value>`; its ratio
to the family's reference is in the row's `candidate_ratios` (> 1: slower than cuBLAS), and the
summary gives each candidate's mean and worst ratio over the rows and each row's fastest
candidate.
"""
from __future__ import annotations

import statistics

from jaxflux import tuning

# The fused op each family's candidates tune, and the XLA variant they are measured against.
OPS = {"ag_gemm": "all_gather_matmul", "gemm_rs": "matmul_reduce_scatter"}
REFERENCES = {"ag_gemm": "xla", "gemm_rs": "xla_own_rows_c"}
FP8_REFERENCE = "xla_fp8_fast"


def reference(row) -> str:
  """The XLA variant a row's candidates are measured against."""
  return FP8_REFERENCE if row.fp8 else REFERENCES[row.of]


def name(of: str, fields: dict) -> str:
  return f"{of}:" + "/".join(f"{k}={v}" for k, v in fields.items())


def parse(variant: str) -> tuple[str, dict] | None:
  """(family, override fields) of a candidate variant's name; None for any other name."""
  of, sep, rest = variant.partition(":")
  if not sep or of not in OPS:
    return None
  fields = {}
  for item in rest.split("/"):
    key, eq, value = item.partition("=")
    if not eq:
      return None
    fields[key] = int(value) if value.isdigit() else value
  return of, fields


def is_candidate(variant: str) -> bool:
  return parse(variant) is not None


def applies(variant: str, row) -> bool:
  parsed = parse(variant)
  return parsed is not None and parsed[0] == row.of


def variant_names(families) -> list[str]:
  """Every candidate variant of these families, in the table's candidate order."""
  return [name(of, fields) for of in families if of in OPS
          for fields in tuning.candidates(OPS[of])]


def row_ratios(row, ms: dict) -> dict:
  """Each timed candidate's time over its family's reference (None where either is missing)."""
  ref = ms.get(reference(row)) if row.of in OPS else None
  return {v: (None if t is None or not ref else t / ref)
          for v, t in ms.items() if applies(v, row)}


def summarize(rows: list[dict]) -> dict:
  """Per family: each candidate's mean and worst ratio over the rows that timed it, and each
  row's fastest candidate with its ratio."""
  out = {}
  for of in OPS:
    mine = [r for r in rows if r.get("of") == of and r.get("candidate_ratios")]
    if not mine:
      continue
    per_candidate = {}
    for cand in dict.fromkeys(c for r in mine for c in r["candidate_ratios"]):
      values = [r["candidate_ratios"][cand] for r in mine
                if r["candidate_ratios"].get(cand) is not None]
      if values:
        per_candidate[cand] = {"rows": len(values), "mean": statistics.fmean(values),
                               "worst": max(values)}
    best = []
    for r in mine:
      timed = {c: v for c, v in r["candidate_ratios"].items() if v is not None}
      if timed:
        cand = min(timed, key=timed.get)
        best.append({"row": f"{r['name']} M={r['M']}", "candidate": cand, "ratio": timed[cand]})
    refs = sorted({FP8_REFERENCE if r["dtype"].startswith("float8") else REFERENCES[of]
                   for r in mine})
    out[of] = {"reference": ",".join(refs), "candidates": per_candidate, "best": best}
  return out


def format_summary(summary: dict) -> list[str]:
  lines = []
  for of, s in summary.items():
    lines.append(f"{of} candidates (time / {s['reference']}, mean and worst over rows):")
    for cand, c in sorted(s["candidates"].items(), key=lambda kv: kv[1]["mean"]):
      lines.append(f"  {cand:<72} mean {c['mean']:.3f} worst {c['worst']:.3f} ({c['rows']} rows)")
    for b in s["best"]:
      lines.append(f"  best {b['row']:<24} {b['candidate']} {b['ratio']:.3f}")
  return lines
