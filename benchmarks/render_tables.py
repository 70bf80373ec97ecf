"""Renders the READMEs' result tables from benchmarks/results/, so the two cannot drift.

Every block between `<!-- table:NAME -->` and `<!-- end table:NAME -->` in README.md and
benchmarks/README.md is rewritten from the result files (a file without such blocks is left as
it is). `--check` rewrites nothing and exits 1 if any block differs from what the results give.

  python benchmarks/render_tables.py [--check]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = (ROOT / "README.md", ROOT / "benchmarks" / "README.md")
BLOCK = re.compile(r"(<!-- table:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- end table:(?P=name) -->)",
                   re.S)
NOT_MEASURED = "Not measured yet: `{}` is produced on the GPU by `STAGES=tables bash " \
               "benchmarks/gpu_check.sh`.\n"


def load(results: pathlib.Path, name: str) -> dict | None:
  path = results / name
  if not path.is_file():
    return None
  data = json.loads(path.read_text())
  return data if "runs" in data else {"description": "", "runs": [data]}


def _x(v: float) -> str:
  return f"{v:.2f}×"


def _provenance(run: dict) -> str:
  m, v = run.get("machine", {}), run.get("versions", {})
  kinds = "/".join(k.replace("NVIDIA ", "") for k in m.get("device_kinds", [])) or "?"
  timing = run.get("settings", {}).get("timing")
  parts = [f"{m.get('device_count', '?')}×{kinds}", f"jax {v.get('jax', '?')}",
           f"driver {m.get('driver_version') or '?'}", run.get("date", "?")[:10]]
  return ", ".join(parts + ([f"{timing} clock"] if timing in ("device", "dispatch") else []))


def _table_rows(data: dict) -> tuple[list[dict], list[dict]]:
  runs = [r for r in data["runs"] if r.get("table")] or data["runs"][:1]
  return runs, [row for r in runs for row in r["rows"]]


def _op_line(op: str, data: dict) -> tuple[str, str]:
  runs, rows = _table_rows(data)
  speed = [(r["ms"]["xla"] / r["ms"]["jaxflux"], r) for r in rows
           if r["ms"].get("xla") and r["ms"].get("jaxflux")]
  slower = [f"{r['name']} M={r['M']}" for s, r in speed if s < 1]
  alone = [r["ms"]["jaxflux"] / r["ms"]["gemm"] for r in rows
           if r["ms"].get("gemm") and r["ms"].get("jaxflux")]
  ms = sorted({r["M"] for r in rows})
  sizes = f"{len({r['name'] for r in rows})} shapes × M {ms[0]}–{ms[-1]}"
  if op == "all-gather":
    sizes = f"shards of {rows[0]['name']}–{rows[-1]['name']}"
  mean = statistics.fmean(s for s, _ in speed)
  line = (f"| {op} | {len(speed)} ({sizes}) | {_x(mean)} ({_x(min(s for s, _ in speed))}–"
          f"{_x(max(s for s, _ in speed))}) | {', '.join(slower) or 'none'} | "
          + (f"{statistics.fmean(alone):.2f} ({max(alone):.2f})" if alone else "—") + " |")
  return line, _provenance(runs[0])


def _xla_wins(op: str, data: dict) -> str:
  below, above = [], []
  for run in data["runs"]:
    for r in run["rows"]:
      if r["ms"].get("xla") and r["ms"].get("jaxflux"):
        (below if r["M"] < 2048 else above).append((r["ms"]["xla"] / r["ms"]["jaxflux"], r))
  text = []
  for name, group in (("below 2048 tokens", below), ("from 2048 tokens up", above)):
    lost = [(s, r) for s, r in group if s < 1]
    if group:
      worst = min(lost, key=lambda p: p[0]) if lost else None
      text.append(f"{name} on {len(lost)} of {len(group)}" +
                  (f" (worst {_x(worst[0])}, {worst[1]['name']} M={worst[1]['M']})"
                   if worst else ""))
  return f"- {op}, every run in the file: XLA faster {'; '.join(text)}."


def render_ops(results: pathlib.Path) -> str:
  files = (("AG+GEMM", "h200x2_ag_gemm_tp2.json"), ("GEMM+RS", "h200x2_gemm_rs_tp2.json"),
           ("all-gather", "h200x2_all_gather_tp2.json"))
  lines = ["| op (tp=2) | rows | speedup over XLA unfused: mean (min–max) | XLA faster on | "
           "fused / GEMM alone: mean (worst) |", "|---|---|---|---|---|"]
  notes = []
  for op, name in files:
    data = load(results, name)
    if data is None:
      lines.append(f"| {op} | not measured yet | | | |")
      continue
    line, prov = _op_line(op, data)
    lines.append(line)
    notes.append(f"- {op}: `benchmarks/results/{name}` (the run marked `table`), {prov}.")
    if op != "all-gather":
      notes.append(_xla_wins(op, data))
  return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


# (file, family, label, which rows): the decode rows of GEMM+AllReduce come from their own run.
GEMM_FILES = (("h200_gemm_table.json", "ag_gemm", "AG+GEMM", None),
              ("h200_gemm_table.json", "gemm_rs", "GEMM+RS", None),
              ("h200_gemm_all_reduce.json", "gemm_ar", "GEMM+AR, M > 128", lambda m: m > 128),
              ("h200_gemm_decode.json", "gemm_ar", "GEMM+AR, M ≤ 128", lambda m: m <= 128))
H100_GEMM_FILES = (("h100_gemm_table.json", "ag_gemm", "AG+GEMM", None),
                   ("h100_gemm_table.json", "gemm_rs", "GEMM+RS", None))


def _decode_rates(rows: list[dict]) -> str:
  """gemm_ar rows at M <= 128: the weight read rates of cuBLAS and the GEMM-only mode, TB/s."""
  decode = [r for r in rows if r.get("of") == "gemm_ar" and r["M"] <= 128
            and r["weight_tbps"].get("gemm_only") and r["weight_tbps"].get("xla")]
  if not decode:
    return ""
  rates = {v: [r["weight_tbps"][v] for r in decode] for v in ("xla", "gemm_only")}
  return (f"- GEMM+AR at M ≤ 128 ({len(decode)} rows), weight read: cuBLAS "
          f"{min(rates['xla']):.1f}–{max(rates['xla']):.1f} TB/s, GEMM-only "
          f"{min(rates['gemm_only']):.1f}–{max(rates['gemm_only']):.1f} TB/s.\n")


def _ratio_cell(rows: list[dict], key: str) -> str:
  """mean (worst, its row) of a ratio over the rows that have it, or a dash."""
  pairs = [(r["ratios"][key], f"{r['name']} M={r['M']}") for r in rows
           if r["ratios"].get(key) is not None]
  if not pairs:
    return "—"
  worst = max(pairs)
  return f"{statistics.fmean(p for p, _ in pairs):.3f} ({worst[0]:.3f}, {worst[1]})"


def render_gemm(results: pathlib.Path, files=GEMM_FILES) -> str:
  lines = ["| GEMM of (per device, tp=2) | rows | GEMM-only / cuBLAS: mean (worst) | "
           "own rows + C / cuBLAS + C: mean (worst) |", "|---|---|---|---|"]
  notes, decode = [], ""
  for name, of, label, which in files:
    data = load(results, name)
    if data is None:
      note = NOT_MEASURED.format(f"benchmarks/results/{name}").rstrip("\n")
      notes += [] if note in notes else [note]
      continue
    runs, rows = _table_rows(data)
    mine = [r for r in rows if r.get("of") == of and (which is None or which(r["M"]))]
    if not mine:
      continue
    cells = [_ratio_cell(mine, key) for key in ("gemm_only_vs_xla", "own_rows_vs_xla_own_rows_c")]
    lines.append(f"| {label} | {len(mine)} | {cells[0]} | {cells[1]} |")
    note = f"`benchmarks/results/{name}`: {_provenance(runs[0])}."
    notes += [] if note in notes else [note]
    decode += _decode_rates(mine)
  return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n" + ("\n" + decode if decode else "")


def render_train(results: pathlib.Path) -> str:
  name = "h200x2_train_llama70b_8l.json"
  data = load(results, name)
  if data is None:
    return NOT_MEASURED.format(f"benchmarks/results/{name}")
  lines = ["| group | mode | steps timed | median ms | min ms | tokens/s | xla / this | "
           "windowed / this |", "|---|---|---|---|---|---|---|---|"]
  groups: dict[str, list[dict]] = {}
  for run in data["runs"]:
    groups.setdefault(run.get("group", ""), []).append(run)
  for group, runs in groups.items():
    by_mode = {r["mode"]: r["step_ms_median"] for r in runs}
    for r in runs:
      t = r["step_ms_median"]
      rel = [f"{by_mode[m] / t:.3f}" if m in by_mode else "—" for m in ("xla", "windowed")]
      lines.append(f"| {group} | {r['mode']} | {r['timed_steps']} | {t:.1f} | "
                   f"{r['step_ms_min']:.1f} | {r['tokens_per_s']:,.0f} | {rel[0]} | {rel[1]} |")
  return "\n".join(lines) + f"\n\n`benchmarks/results/{name}`: {_provenance(data['runs'][0])}.\n"


RENDERERS = {"ops_h200x2": render_ops, "gemm_h200": render_gemm,
             "gemm_h100": lambda results: render_gemm(results, H100_GEMM_FILES),
             "train_h200x2": render_train}


def render_text(text: str, results: pathlib.Path = RESULTS) -> str:
  def body(match):
    name = match.group("name")
    if name not in RENDERERS:
      raise ValueError(f"unknown table {name!r}; known: {sorted(RENDERERS)}")
    return match.group(1) + RENDERERS[name](results) + match.group(4)
  return BLOCK.sub(body, text)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--check", action="store_true", help="exit 1 if a block is stale; write nothing")
  args = p.parse_args(argv)
  stale = []
  for doc in DOCS:
    if not doc.is_file():
      continue
    text = doc.read_text()
    new = render_text(text)
    if new != text:
      stale.append(doc.relative_to(ROOT))
      if not args.check:
        doc.write_text(new)
  if args.check and stale:
    print("stale tables in " + ", ".join(map(str, stale)) +
          ": run python benchmarks/render_tables.py", file=sys.stderr)
    return 1
  if not args.check:
    print("rewrote " + (", ".join(map(str, stale)) or "nothing (up to date)"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
