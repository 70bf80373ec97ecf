"""Compares two benchmark JSONs of the same rows, variant by variant: time in B / time in A.

    python benchmarks/compare_runs.py A.json B.json [--variants jaxflux,xla] [--limit 1.03]

Made for issue 6's check (the fused ops timed with one process per GPU against one process
driving all GPUs: within 3%), but any two runs of `python -m jaxflux.bench` over the same rows
compare. Rows are matched by (op, name, M, K, N, tp, dtype). Exits with 1 when a ratio is above
--limit, or when a row or variant of A has no time in B.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROW_KEY = ("op", "name", "M", "K", "N", "tp", "dtype")


def rows_by_key(record: dict) -> dict[tuple, dict]:
  return {tuple(r[k] for k in ROW_KEY): r for r in record["rows"]}


def compare(a: dict, b: dict, variants: list[str] | None) -> list[dict]:
  """One entry per row of A and variant timed in A: both times and their ratio B / A (None when
  B lacks the row or the time)."""
  b_rows = rows_by_key(b)
  out = []
  for key, row in rows_by_key(a).items():
    other = b_rows.get(key)
    for variant, ms in row["ms"].items():
      if ms is None or (variants and variant not in variants):
        continue
      ms_b = other["ms"].get(variant) if other else None
      out.append({"row": f"{row['op']} {row['name']} M={row['M']}", "variant": variant,
                  "a_ms": ms, "b_ms": ms_b, "ratio": ms_b / ms if ms_b else None})
  return out


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("a")
  p.add_argument("b")
  p.add_argument("--variants", default=None, help="comma-separated (default: every variant)")
  p.add_argument("--limit", type=float, default=None,
                 help="largest acceptable ratio B / A (default: none, only report)")
  args = p.parse_args(argv)
  a, b = (json.loads(pathlib.Path(x).read_text()) for x in (args.a, args.b))
  variants = args.variants.split(",") if args.variants else None
  entries = compare(a, b, variants)
  print(f"{'row':36} {'variant':10} {'A ms':>9} {'B ms':>9} {'B / A':>7}")
  bad = 0
  for e in entries:
    missing = e["ratio"] is None
    over = not missing and args.limit is not None and e["ratio"] > args.limit
    bad += missing or over
    b_ms = f"{'-':>9}" if missing else f"{e['b_ms']:9.4f}"
    ratio = f"{'-':>7}" if missing else f"{e['ratio']:7.3f}"
    note = "  <- not in B" if missing else "  <- over the limit" if over else ""
    print(f"{e['row']:36} {e['variant']:10} {e['a_ms']:9.4f} {b_ms} {ratio}{note}")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
