"""The command line: arguments, the run of every row into one JSON record, and `main`."""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp

from jaxflux.bench import (device_clock, grouped_roofline, grouped_table, moe_record, moe_table,
                           processes, tuning_sweep)
from jaxflux.bench.config import (CHILD_MARKER, DEFAULT_VARIANTS, DEFINITIONS, EXTRA_VARIANTS,
                                  FP8_DTYPES, FP8_GEMM_VARIANTS, GEMM_FAMILIES,
                                  GEMM_VARIANTS, GROUPED_BACKWARD, GROUPED_FORWARD,
                                  GROUPED_VARIANTS, MOE_VARIANTS, OP_VARIANTS, OPS, ROUTINGS,
                                  WINDOWED_FLAGS, repo_root)
from jaxflux.bench.gemm_table import format_gemm_table, summarize_table
from jaxflux.bench.inputs import make_mesh
from jaxflux.bench.machine import provenance
from jaxflux.bench.measure import bench_row
from jaxflux.bench.output import output_path, write_json
from jaxflux.bench.rows import build_rows, find_shapes_file
from jaxflux.bench.table import format_table
from jaxflux.bench.timing import chain_kind
from jaxflux.bench.variants import PALLAS_CONFIGS, pallas_config_name
from jaxflux.bench.windowed import (merge_windowed, platforms_exclude_gpu, run_child,
                                    run_windowed_child)


def _row_summary(r: dict) -> str:
  parts = [f"{v}={t:.4f}" for v, t in r["ms"].items() if t is not None]
  text = "ms " + " ".join(parts)
  if r.get("speedup_vs_xla") is not None:
    text += f" | speedup_vs_xla={r['speedup_vs_xla']:.3f}"
  if r.get("overlap_efficiency") is not None:
    text += f" E={r['overlap_efficiency']:.2f}"
  return text


def _silent(*args, **kwargs) -> None:
  """The log of every process but process 0."""


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
                 help="comma-separated global token counts (default: the shapes file's M list; "
                      "--op gemm: 2048,4096,8192,16384; --op grouped_gemm: 16384 routed rows; "
                      "--op moe: 4096 tokens)")
  p.add_argument("--of", type=_csv(str), default=None,
                 help=f"--op gemm only: row families, any of {','.join(GEMM_FAMILIES)} "
                      "(default all; gemm_ar's default M: 1,8,32,128,512,2048,8192)")
  p.add_argument("--candidates", action="store_true",
                 help="--op gemm only: the tuning sweep. Each ag_gemm and gemm_rs row also "
                      "times every candidate of jaxflux.tuning.candidates (tile or own-rows "
                      "schedule, swizzle) against XLA's dot (see jaxflux/bench/tuning_sweep.py); "
                      "default --of ag_gemm,gemm_rs and --variants xla,xla_own_rows_c "
                      "(FP8 --dtype: xla_fp8_fast)")
  p.add_argument("--routing", type=_csv(str), default=None,
                 help=f"--op grouped_gemm only: how rows are spread over the experts, any of "
                      f"{','.join(ROUTINGS)} (default both; see jaxflux/bench/grouped_table.py)")
  p.add_argument("--backward", action="store_true",
                 help="--op grouped_gemm only: also time dx and dw of each variant "
                      f"({','.join(GROUPED_BACKWARD)})")
  p.add_argument("--sizes-mib", type=_csv(float), default=None,
                 help="all_gather only: per-device shard sizes in MiB instead of the shapes")
  p.add_argument("--dtype", default="bfloat16",
                 help="input dtype (default bfloat16); --op gemm also takes "
                      f"{' or '.join(FP8_DTYPES)}: the FP8 table (x in that format, the weight "
                      f"in e4m3 given [N, K], per-tensor scales, bf16 output; families "
                      f"{','.join(GEMM_FAMILIES)}, default ag_gemm,gemm_rs; variants "
                      f"{','.join(FP8_GEMM_VARIANTS)})")
  p.add_argument("--tp", type=int, default=None,
                 help="devices on the tp axis (default: all); --op gemm runs on one device the "
                      "per-device GEMMs of this tp (default 2)")
  p.add_argument("--iters", type=int, default=100, help="op calls per timed run (default 100)")
  p.add_argument("--warmup", type=int, default=10,
                 help="untimed calls before timing, run as whole timed runs, at least one "
                      "(default 10)")
  p.add_argument("--repeats", type=int, default=5,
                 help="timed runs per variant, interleaved (default 5)")
  p.add_argument("--variants", type=_csv(str), default=None,
                 help=f"comma-separated, any of {DEFAULT_VARIANTS + EXTRA_VARIANTS} "
                      f"(default {','.join(DEFAULT_VARIANTS)}); --op gemm: any of "
                      f"{GEMM_VARIANTS} (default all); --op grouped_gemm: any of "
                      f"{GROUPED_VARIANTS} (default {','.join(GROUPED_FORWARD)}, and the "
                      f"backward ones with --backward); --op moe: any of {MOE_VARIANTS} "
                      "(default both)")
  p.add_argument("--timing", choices=("auto", "loop", "dispatch", "device"), default="auto",
                 help="loop: calls chained in one jitted fori_loop; dispatch: Python loop of "
                      "async jitted calls, one sync; device (GPU): dispatch's calls timed by "
                      "the GPUs' own clocks, read in stream order around them "
                      "(jaxflux/bench/device_clock.py); auto (default): device on GPU with a "
                      "CUDA build of jaxflux (no host dispatch in the time), else dispatch there "
                      "(loop mode timed collectives impossibly fast on GPU), loop elsewhere "
                      "(queued CPU collectives deadlock)")
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
                 help="default: benchmarks/shapes.json of the repository")
  p.add_argument("--distributed", metavar="COORD,NUM,ID", nargs="?", const="auto",
                 help="join jax.distributed as process ID of NUM, coordinator at COORD "
                      "(host:port, process 0's); bare --distributed auto-detects them (SLURM, "
                      "Open MPI). Every process runs the same rows; process 0 prints and writes "
                      "the JSON. `python examples/launch_multiprocess.py --bench -- ARGS` sets it")
  p.add_argument("--local-device-ids", default=None,
                 help="with --distributed: the GPUs this process drives (e.g. 0)")
  p.add_argument("--cpu-devices", type=int, default=None,
                 help="CPU devices of this process (before JAX starts; for multi-process on CPU)")
  p.add_argument("--child-timeout", type=float, default=3600.0, help=argparse.SUPPRESS)
  p.add_argument("--_windowed-child", dest="_windowed_child", action="store_const", const=True,
                 default=False, help=argparse.SUPPRESS)
  # Test hook: the xla_windowed child runs off GPU too (where XLA ignores the flags).
  p.add_argument("--_windowed-anywhere", dest="_windowed_anywhere", action="store_true",
                 help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  try:
    args.dtype = jnp.dtype(args.dtype).name
  except TypeError:
    p.error(f"--dtype {args.dtype}: not a dtype name (e.g. bfloat16, float16, float8_e4m3fn)")
  fp8 = args.dtype in FP8_DTYPES
  if fp8 and args.op != "gemm":
    p.error(f"--dtype {args.dtype} applies to --op gemm (the FP8 GEMM-only table) only")
  gemm_variants = FP8_GEMM_VARIANTS if fp8 else GEMM_VARIANTS
  explicit_variants = args.variants is not None
  known = {"gemm": gemm_variants, "grouped_gemm": GROUPED_VARIANTS, "moe": MOE_VARIANTS}.get(
      args.op, DEFAULT_VARIANTS + EXTRA_VARIANTS)
  if args.variants is None:
    args.variants = list({"gemm": gemm_variants, "grouped_gemm": GROUPED_FORWARD,
                          "moe": MOE_VARIANTS}.get(args.op, DEFAULT_VARIANTS))
  _check_grouped_args(p, args)
  _check_moe_args(p, args)
  _check_candidates_args(p, args, explicit_variants)
  unknown = [v for v in args.variants if v not in known and
             not (args.op == "gemm" and tuning_sweep.is_candidate(v))]
  if unknown:
    kind = f" with --dtype {args.dtype}" if args.op == "gemm" else ""
    p.error(f"--variants: unknown {unknown} for --op {args.op}{kind}; choose from {known}")
  if args.of is not None:
    bad = [f for f in args.of if f not in GEMM_FAMILIES]
    if args.op != "gemm" or bad:
      p.error(f"--of applies to --op gemm and takes {GEMM_FAMILIES}; got {args.of}")
  if args.sizes_mib and args.op != "all_gather":
    p.error("--sizes-mib applies to --op all_gather only")
  for name in ("iters", "repeats"):
    if getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1")
  return args


def _check_grouped_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """--op grouped_gemm's own options: --routing and --backward (which adds the backward
  variants to --variants), one device, a floating --dtype."""
  if args.op != "grouped_gemm":
    if args.routing is not None or args.backward:
      p.error("--routing and --backward apply to --op grouped_gemm only")
    return
  bad = [r for r in args.routing or () if r not in ROUTINGS]
  if bad:
    p.error(f"--routing: unknown {bad}; choose from {ROUTINGS}")
  if args.tp not in (None, 1):
    p.error("--op grouped_gemm runs on one device: --tp must be 1 or left out")
  if not jnp.issubdtype(args.dtype, jnp.floating):
    p.error(f"--op grouped_gemm: --dtype {args.dtype} is not a floating dtype")
  if args.backward:
    args.variants = list(dict.fromkeys(args.variants + list(GROUPED_BACKWARD)))


def _check_candidates_args(p: argparse.ArgumentParser, args: argparse.Namespace,
                           explicit_variants: bool) -> None:
  """--candidates: --op gemm; adds the candidate variants of the rows' families (ag_gemm,
  gemm_rs) after the requested ones (default: the XLA references)."""
  if not args.candidates:
    return
  if args.op != "gemm":
    p.error("--candidates applies to --op gemm")
  if args.of is None:
    args.of = list(tuning_sweep.OPS)
  if not explicit_variants:
    args.variants = ([tuning_sweep.FP8_REFERENCE] if args.dtype in FP8_DTYPES else
                     [tuning_sweep.REFERENCES[of] for of in args.of if of in tuning_sweep.OPS])
  args.variants = list(dict.fromkeys(args.variants + tuning_sweep.variant_names(args.of)))


def _check_moe_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """--op moe: one device, a floating --dtype."""
  if args.op != "moe":
    return
  if args.tp not in (None, 1):
    p.error("--op moe runs on one device: --tp must be 1 or left out")
  if not jnp.issubdtype(args.dtype, jnp.floating):
    p.error(f"--op moe: --dtype {args.dtype} is not a floating dtype")


def _describe(row) -> str:
  if row.op == "moe":
    return row.describe()
  experts = f" G={row.experts} {row.routing}" if row.op == "grouped_gemm" else ""
  return (f"{row.op} {row.name} M={row.M} K={row.K} N={row.N}{experts} tp={row.tp} "
          f"{row.dtype}")


def _bench_rows(args, rows, mesh, variants, result, out_path, child, want_windowed, log,
                progress):
  """Measures the rows in order, adding each record to `result` (and writing it out)."""
  for i, row in enumerate(rows):
    log(f"[bench] row {i + 1}/{len(rows)}: {_describe(row)}", flush=True)
    if progress is not None:
      progress(i, len(rows), _describe(row))
    measure = {"grouped_gemm": grouped_table.bench_row, "moe": moe_table.bench_row}.get(
        row.op, bench_row)
    record = measure(row, mesh, variants, args, log=log)
    if row.op == "grouped_gemm":
      record["roofline"] = grouped_roofline.roofline(record, result["rates"])
    record["key"] = row.key()
    if want_windowed:
      merge_windowed(record, child)
    record.pop("key")
    result["rows"].append(record)
    if row.op == "gemm":
      result["summary"] = summarize_table(result["rows"])
    elif row.op == "grouped_gemm":
      result["summary"] = grouped_table.summarize_table(result["rows"])
    elif row.op == "moe":
      result["summary"] = moe_record.summarize_table(result["rows"])
    log("        " + _row_summary(record), flush=True)
    # Written after every row so that a run cut short keeps what it measured.
    if processes.is_leader():
      write_json(out_path, result)


def run(argv: list[str] | None = None, log=print, progress=None) -> dict:
  """Runs the benchmark described by command-line style `argv`; returns the result dict (also
  written as JSON, see --out). progress(done, total, row description) is called before each
  row."""
  args = parse_args(argv)
  if args.distributed or args.cpu_devices is not None:
    processes.join(args.distributed, args.local_device_ids, args.cpu_devices)
  if not processes.is_leader():
    log = _silent
  if args.timing == "auto":
    if jax.default_backend() != "gpu":
      args.timing = "loop"
    else:
      args.timing = "device" if device_clock.available() else "dispatch"
  if args.timing == "device" and jax.default_backend() != "gpu":
    raise SystemExit(f"--timing device reads the GPUs' clocks; this backend is "
                     f"{jax.default_backend()!r}. Use --timing loop or dispatch.")
  if args._windowed_child:
    return run_child(args)
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
  if want_windowed and jax.process_count() > 1:
    child = {"skipped": "not timed in multi-process runs (its child process would have to "
                        "join the group)"}
  elif want_windowed:
    child = platforms_exclude_gpu(args)
    child = {"skipped": child} if child else run_windowed_child(args, argv, shapes_path, log=log)

  if args.op == "gemm":  # one device, the per-device GEMMs of a tp group
    mesh, tp = make_mesh(1), args.tp or 2
  elif args.op in ("grouped_gemm", "moe"):  # one device: the op communicates nothing
    mesh, tp = make_mesh(1), 1
  else:
    mesh = make_mesh(args.tp or len(jax.devices()))
    tp = mesh.devices.size
  if args.op in ("grouped_gemm", "moe"):
    rows = {"grouped_gemm": grouped_table, "moe": moe_table}[args.op].build_rows(args, shapes)
  else:
    rows = build_rows(args, shapes, tp)
  platform = jax.default_backend()
  result: dict[str, Any] = {
      **provenance("python -m jaxflux.bench", argv, stamp),
      "settings": {
          "op": args.op, "tp": tp, "processes": jax.process_count(), "dtype": args.dtype,
          "iters": args.iters,
          "warmup": args.warmup, "repeats": args.repeats, "timing": args.timing,
          "chain": chain_kind(args) if args.timing == "loop" else None,
          "rotate_mib": args.rotate_mib, "seed": args.seed, "variants": variants,
          "shapes_file": os.path.relpath(shapes_path, repo_root()) if shapes_path else None,
          "pallas_configs": ([pallas_config_name(c) for c in PALLAS_CONFIGS]
                             if args.op == "ag_gemm" else None),
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "windowed_flags": list(WINDOWED_FLAGS),
          **({"fp8": {"x_dtype": args.dtype, "w_dtype": "float8_e4m3fn",
                      "w_layout": "[N, K] (transpose_w=True)", "out_dtype": "bfloat16",
                      "scales": "per-tensor float32 (amax / format max, a bf16 value); the "
                                "GEMM-only kernels get them broadcast to x's rows and the "
                                "output's columns"}} if args.dtype in FP8_DTYPES else {}),
          **({"grouped_gemm": grouped_table.settings(args)}
             if args.op == "grouped_gemm" else {}),
          **({"moe": moe_record.settings(args)} if args.op == "moe" else {}),
      },
      "definitions": DEFINITIONS,
      "rows": [],
  }
  out_path = output_path(args, platform, tp, stamp)
  if processes.is_leader():
    out_path.parent.mkdir(parents=True, exist_ok=True)
  # Under jax.distributed the fused ops learn their peers' workspace slots from a constant
  # table when traced under jax.set_mesh; without it each call would all-gather them first.
  ambient = jax.set_mesh(mesh) if jax.process_count() > 1 else contextlib.nullcontext()
  with ambient:
    if args.op == "grouped_gemm":  # the roofline's rates, measured before the rows
      result["rates"] = grouped_roofline.measure_rates(mesh, args, log)
    _bench_rows(args, rows, mesh, variants, result, out_path, child, want_windowed, log,
                progress)
  try:  # repo-relative where it can be, so committed records name no local folders
    result["output"] = str(out_path.resolve().relative_to(repo_root()))
  except ValueError:
    result["output"] = str(out_path)
  if processes.is_leader():
    write_json(out_path, result)
  result["output"] = str(out_path)
  tables = {"gemm": format_gemm_table, "grouped_gemm": grouped_table.format_table,
            "moe": moe_record.format_table}
  log(tables.get(args.op, format_table)(result))
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
