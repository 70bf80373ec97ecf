"""Checks benchmark JSONs (python -m jaxflux.bench) against the performance criteria of the fused
kernel issues (4: AllGather+GEMM, 5: GEMM+ReduceScatter) and prints one line per criterion:
PASS / FAIL / INCOMPLETE, the figure, and the rows that miss.

    python benchmarks/issue_criteria.py RESULT.json [RESULT.json ...] [--op ag_gemm|gemm_rs]

Rows are pooled over the files (e.g. one file per M from `STAGES=tables`); a row measured in
several files keeps its last measurement. Ratios are of medians, row by row, as the issues
define them: `gemm` = XLA's dot (cuBLAS) on the same per-device shape, E = overlap efficiency
(T_gemm + T_comm - T_jaxflux) / T_comm. A criterion is INCOMPLETE when a row it needs lacks a
variant or the issue's M list is not covered (the figure is still printed).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
from dataclasses import dataclass

ISSUE_M = (1024, 2048, 4096, 8192, 16384)  # the M list both issues ask for


@dataclass(frozen=True)
class Limits:
  """One issue's numbers (its text, "Performance")."""
  gemm_only_mean: float = 1.03   # GEMM-only / cuBLAS, mean over M >= 2048
  gemm_only_row: float = 1.05    # ... every row
  fused_mean: float = 1.03       # jaxflux / GEMM alone, mean over M >= 2048
  fused_row: float = 1.05        # ... every row
  speedup_mean: float = 1.05     # XLA unfused / jaxflux, mean over 2048 <= M <= 16384
  overlap_mean: float = 0.80     # overlap efficiency, mean over M >= 2048
  auto_slack: float = 1.02       # auto / XLA unfused, every row (any M)
  pallas: bool = True            # jaxflux vs the Pallas Mosaic-GPU kernel (AG+GEMM only)


LIMITS = {
    "ag_gemm": Limits(),
    "gemm_rs": Limits(fused_mean=1.04, fused_row=1.06, overlap_mean=0.75, pallas=False),
}


def load_rows(paths: list[str], op: str) -> list[dict]:
  rows: dict[tuple, dict] = {}
  for path in paths:
    record = json.loads(pathlib.Path(path).read_text())
    for row in record["rows"]:
      if row["op"] == op:
        rows[(row["name"], row["M"], row["K"], row["N"], row["tp"], row["dtype"])] = row
  return sorted(rows.values(), key=lambda r: (r["name"], r["M"]))


def _ratio(row: dict, a: str, b: str) -> float | None:
  ta, tb = row["ms"].get(a), row["ms"].get(b)
  return None if ta is None or tb is None or tb <= 0 else ta / tb


def _label(row: dict) -> str:
  return f"{row['name']} M={row['M']}"


@dataclass
class Verdict:
  name: str
  status: str   # PASS, FAIL or INCOMPLETE
  figure: str
  misses: list[str]

  def line(self) -> str:
    text = f"{self.status:10s} {self.name}: {self.figure}"
    if self.misses:
      text += "; misses: " + ", ".join(self.misses)
    return text


def _check(name: str, rows: list[dict], value, *, mean_limit=None, row_limit=None,
           higher_is_better=False, fmt="{:.3f}") -> Verdict:
  """value(row) -> float | None. Mean and/or per-row limit over `rows`."""
  values = [(row, value(row)) for row in rows]
  missing = [_label(r) for r, v in values if v is None]
  got = [(r, v) for r, v in values if v is not None]
  if not got:
    return Verdict(name, "INCOMPLETE", "no row has the variants it needs", missing)
  ok = lambda v, lim: v >= lim if higher_is_better else v <= lim  # noqa: E731
  parts, fails = [], []
  if mean_limit is not None:
    mean = statistics.mean(v for _, v in got)
    parts.append(f"mean {fmt.format(mean)} (limit {fmt.format(mean_limit)})")
    if not ok(mean, mean_limit):
      fails.append("mean")
  misses = []
  if row_limit is not None:
    worst = (max if not higher_is_better else min)(got, key=lambda rv: rv[1])
    parts.append(f"worst {fmt.format(worst[1])} at {_label(worst[0])} "
                 f"(limit {fmt.format(row_limit)} per row)")
    misses = [f"{_label(r)} {fmt.format(v)}" for r, v in got if not ok(v, row_limit)]
    if misses:
      fails.append("rows")
  status = "FAIL" if fails else ("INCOMPLETE" if missing else "PASS")
  figure = "; ".join(parts) + f" over {len(got)} rows"
  if missing:
    figure += f" ({len(missing)} rows lack a variant: {', '.join(missing)})"
  return Verdict(name, status, figure, misses)


def evaluate(rows: list[dict], op: str) -> list[Verdict]:
  lim = LIMITS[op]
  big = [r for r in rows if r["M"] >= 2048]
  verdicts = [
      _check("GEMM-only mode / XLA's dot, M >= 2048", big,
             lambda r: _ratio(r, "gemm_only", "gemm"),
             mean_limit=lim.gemm_only_mean, row_limit=lim.gemm_only_row),
      _check("jaxflux / GEMM alone, M >= 2048", big, lambda r: _ratio(r, "jaxflux", "gemm"),
             mean_limit=lim.fused_mean, row_limit=lim.fused_row),
      _check("XLA unfused / jaxflux, 2048 <= M <= 16384", [r for r in big if r["M"] <= 16384],
             lambda r: _ratio(r, "xla", "jaxflux"), mean_limit=lim.speedup_mean, row_limit=1.0,
             higher_is_better=True),
      _check("overlap efficiency, M >= 2048", big, lambda r: r.get("overlap_efficiency"),
             mean_limit=lim.overlap_mean, higher_is_better=True),
      _check("auto / XLA unfused, every M", rows, lambda r: _ratio(r, "auto", "xla"),
             row_limit=lim.auto_slack),
  ]
  if lim.pallas:
    verdicts.append(_check("jaxflux / Pallas Mosaic-GPU, M >= 2048", big,
                           lambda r: _ratio(r, "jaxflux", "pallas"), mean_limit=1.0,
                           row_limit=1.02))
  covered = sorted({r["M"] for r in rows})
  absent = [m for m in ISSUE_M if m not in covered]
  for v in verdicts:
    if absent and v.status == "PASS":
      v.status = "INCOMPLETE"
      v.figure += f" (M not measured: {', '.join(map(str, absent))})"
  return verdicts


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("results", nargs="+", help="benchmark JSON files")
  p.add_argument("--op", choices=sorted(LIMITS), default=None,
                 help="the op to check (default: the op of the first file's first row)")
  args = p.parse_args(argv)
  op = args.op or json.loads(pathlib.Path(args.results[0]).read_text())["rows"][0]["op"]
  rows = load_rows(args.results, op)
  if not rows:
    raise SystemExit(f"no {op} rows in {', '.join(args.results)}")
  shapes = sorted({r["name"] for r in rows})
  print(f"{op}: {len(rows)} rows ({', '.join(shapes)}; M {sorted({r['M'] for r in rows})})")
  verdicts = evaluate(rows, op)
  for v in verdicts:
    print(v.line())
  return 0 if all(v.status == "PASS" for v in verdicts) else 1


if __name__ == "__main__":
  raise SystemExit(main())
