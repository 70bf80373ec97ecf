"""The table printed at the end of a run."""
from __future__ import annotations

import jax.numpy as jnp


def fmt(x, spec=".3f") -> str:
  """x with `spec`, "-" for a missing value."""
  return "-" if x is None else format(x, spec)


def error_lines(rows: list[dict], quiet=lambda error: error == "not requested") -> list[str]:
  """The table's closing lines: each distinct variant error of the rows, cut at 200
  characters, under a heading; none when every error is `quiet`."""
  notes = sorted({f"{v}: {e}" for r in rows for v, e in r["errors"].items() if not quiet(e)})
  if not notes:
    return []
  return ["null variants / errors:"] + ["  " + (n if len(n) < 200 else n[:200] + "...")
                                         for n in notes]


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
      lines.append(f"{r['name']:<28}{r['M']:>7}{r['K']:>7}{mib:>9.2f}{fmt(r['ms']['xla']):>9}"
                   f"{fmt(r['ms'].get('jaxflux')):>9}{fmt(r['gbps']['xla'], '.1f'):>10}"
                   f"{fmt(r['gbps'].get('jaxflux'), '.1f'):>9}"
                   f"{fmt(r['speedup_vs_xla'], '.3f'):>9}")
  else:
    cols = [v for v in ("gemm", "gemm_only", "comm", "xla", "xla_windowed", "pallas", "jaxflux",
                        "jaxflux_wt", "auto", "xla_gspmd") if v in rows[0]["ms"]]
    short = {"xla_windowed": "xla_win", "xla_gspmd": "gspmd", "gemm_only": "gemm_jf",
             "jaxflux_wt": "jf_wt"}
    head = f"{'name':<16}{'M':>7}{'K':>7}{'N':>7}" + "".join(
        f"{short.get(c, c):>9}" for c in cols) + f"{'TF/s jf':>9}{'spd':>7}{'E jf':>7}{'E xla':>7}"
    lines.append(head + "   (ms per call; E = overlap efficiency)")
    for r in rows:
      line = f"{r['name']:<16}{r['M']:>7}{r['K']:>7}{r['N']:>7}"
      line += "".join(f"{fmt(r['ms'].get(c)):>9}" for c in cols)
      line += f"{fmt(r['tflops'].get('jaxflux'), '.0f'):>9}{fmt(r['speedup_vs_xla']):>7}"
      line += f"{fmt(r['overlap_efficiency'], '.2f'):>7}"
      line += f"{fmt(r['overlap_efficiency_all'].get('xla'), '.2f'):>7}"
      lines.append(line)
  lines.extend(error_lines(rows))
  return "\n".join(lines)
