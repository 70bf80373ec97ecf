"""Hardware counters of the single-GPU GEMMs behind the fused ops, under Nsight Compute (GPU
machine): is a kernel slower than cuBLAS because it takes more cycles, or because it runs at a
lower clock (the GPUs sit at their power cap, benchmarks/README.md, session 9), and how many
bytes does each move through HBM?

    XLA_PYTHON_CLIENT_PREALLOCATE=false \\
    ncu --clock-control none --profile-from-start off --csv --page raw --kernel-name-base demangled \\
        --kernel-name regex:'cutlass|gemm|nvjet|xmma' \\
        --metrics $(python benchmarks/ncu_gemms.py metrics) \\
        python benchmarks/ncu_gemms.py run VARIANT M K N [--calls 3] > OUT.csv 2>&1
    python benchmarks/ncu_gemms.py summarize OUT.csv [OUT2.csv ...]

`run` makes random bf16 operands on one GPU (no communication: a kernel that waits on a peer
can't be replayed), calls VARIANT once unprofiled (compilation, XLA's autotuning) and then
--calls times between cuProfilerStart/Stop, each call one GEMM kernel. Without preallocation
(XLA_PYTHON_CLIENT_PREALLOCATE=false) ncu's kernel replay saves and restores megabytes, not
JAX's whole memory pool (with both, two of the first reports on the GPU ran past 100 s):
  cublas              XLA's dot (the benchmark's `gemm` column; autotuned at compile)
  cutlass             jaxflux's GEMM with CUTLASS's scheduler (the GEMM-only op, GEMM+RS's peer rows)
  ag_gemm_only        the AG+GEMM kernel with its waits off (tile_order="all_gather_matmul")
  own_rows[_c][_chunked]  GEMM+RS's own-rows kernel (jaxflux.ops.gemm.gemm_own_rows): with a
                      source C, and/or the tiles swept along N as for a chunked push
  own_rows_c_chunked_cutlass_scheduler  the same under CUTLASS's scheduler: what the fused
                      ops' scheduler costs apart from the source-C epilogue
  own_rows[_c][_chunked]_pingpong  the own-rows kernel with ping-pong 128x128 tiles
  own_rows_c[_chunked][_pingpong]_kmajor  ... with the weight given as [N, K], read K-major (the
                      fused op's backward of a column-parallel layer)
  cublas_kmajor       XLA's dot of x with the [N, K] weight, contracted in place (x @ wᵀ)
  ag_gemm_only_configI  ag_gemm_only with its tile config forced to AG_GEMM_CONFIGS[I]
                      (jaxflux.ops.gemm), not the kernel's choice
`summarize` prints, per CSV (one variant each), the last profiled kernel (the last call): time,
SM cycles, the clock they imply, HBM bytes read and written, L2 hit rate, SM throughput. Cycles compare kernels independently of the clock.

Without ncu, `time` times several variants on the same operands, back to back and interleaved:

    python benchmarks/ncu_gemms.py time cublas,own_rows_c_chunked,own_rows_c_chunked_pingpong \
        M K N [--calls 50] [--rounds 5] [--json OUT.json]

each round queues --calls calls of each variant in turn with one sync (after an untimed round,
each round starting one variant later); per variant the median (and fastest) round's time per
call, and its ratio to the first variant's median. Interleaving spreads clock and power drift
over all variants alike. `table` does the same for every shape
of one op in shapes.json at each M, on the GEMM one device runs at tensor-parallel degree --tp,
in one process, into one JSON:

    python benchmarks/ncu_gemms.py table --op ag_gemm --M 2048,4096,8192,16384 \
        --variants cublas,ag_gemm_only,ag_gemm_only_config0,ag_gemm_only_config3 --json OUT.json

--op ag_gemm: the gathered x [M, K] times the weight's columns [K, N/tp]; --op gemm_rs: the
whole local GEMM [M, K/tp] x [K/tp, N] (--part device, the issue's GEMM-only comparison) or
the own rows a rank reduces into, [M/tp, K/tp] x [K/tp, N] (--part own_rows).
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import io
import sys

METRICS = ("gpu__time_duration.sum", "sm__cycles_elapsed.max", "dram__bytes_read.sum",
           "dram__bytes_write.sum", "lts__t_sector_hit_rate.pct",
           "sm__throughput.avg.pct_of_peak_sustained_elapsed")
VARIANTS = ("cublas", "cublas_kmajor", "cutlass", "ag_gemm_only", "own_rows", "own_rows_c",
            "own_rows_chunked", "own_rows_c_chunked", "own_rows_c_chunked_cutlass_scheduler",
            "own_rows_pingpong", "own_rows_c_pingpong", "own_rows_chunked_pingpong",
            "own_rows_c_chunked_pingpong", "own_rows_c_kmajor",
            "own_rows_c_pingpong_kmajor", "own_rows_c_chunked_kmajor",
            "own_rows_c_chunked_pingpong_kmajor") + tuple(f"ag_gemm_only_config{i}"
                                                          for i in range(4))


def kmajor(variant: str) -> bool:
  """Whether `variant` takes the weight as [N, K] (the others: [K, N])."""
  return variant.endswith("_kmajor")


def make_call(variant: str):
  """The jitted single-device function of `variant`: (x, w, c) -> x @ w [+ c], w [K, N]; or,
  for the kmajor variants, (x, wt, c) -> x @ wtᵀ [+ c], wt [N, K]."""
  import jax

  from jaxflux.ops import gemm as gemm_module
  if variant == "cublas":
    return jax.jit(lambda x, w, c: x @ w)
  if variant == "cublas_kmajor":
    return jax.jit(lambda x, wt, c: jax.lax.dot_general(x, wt, (((1,), (1,)), ((), ()))))
  if variant == "cutlass":
    return jax.jit(lambda x, w, c: gemm_module.gemm(x, w))
  if variant == "ag_gemm_only":
    return jax.jit(lambda x, w, c: gemm_module.gemm(x, w, tile_order="all_gather_matmul"))
  if variant.startswith("ag_gemm_only_config") and variant in VARIANTS:
    config = gemm_module.AG_GEMM_CONFIGS[int(variant.removeprefix("ag_gemm_only_config"))]
    return jax.jit(lambda x, w, c: gemm_module.gemm(x, w, tile_order="all_gather_matmul",
                                                    config=config))
  if variant.startswith("own_rows") and variant in VARIANTS:
    with_c, options = gemm_module.own_rows_variant(variant)
    return jax.jit(lambda x, w, c: gemm_module.gemm_own_rows(x, w, c if with_c else None,
                                                             **options))
  raise SystemExit(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")


def operands(m: int, k: int, n: int, variant: str = "cublas"):
  """Random bf16 x [m, k], w [k, n] (or [n, k] for a kmajor variant), c [m, n] on the first
  device."""
  import jax
  import jax.numpy as jnp

  device = jax.devices()[0]
  keys = jax.random.split(jax.random.key(0), 3)
  w_shape = (n, k) if kmajor(variant) else (k, n)
  return tuple(jax.device_put(jax.random.normal(key, shape, jnp.bfloat16), device)
               for key, shape in zip(keys, ((m, k), w_shape, (m, n))))


def run(variant: str, m: int, k: int, n: int, calls: int) -> None:
  import jax

  device = jax.devices()[0]
  x, w, c = operands(m, k, n, variant)
  call = make_call(variant)
  # The first call compiles (and XLA autotunes cuBLAS's algorithms: dozens of kernels ncu would
  # replay pass by pass) outside the profiled range; ncu runs with --profile-from-start off.
  call(x, w, c).block_until_ready()
  # The CUDA driver's cuProfilerStart/Stop bound ncu's profiled range (no driver on a CPU run).
  driver = ctypes.CDLL("libcuda.so.1") if device.platform == "gpu" else None
  if driver is not None:
    driver.cuProfilerStart()
  for _ in range(calls):
    call(x, w, c).block_until_ready()
  if driver is not None:
    driver.cuProfilerStop()
  print(f"ncu_gemms: {variant} {m}x{k}x{n}: {calls} calls after a warm-up call on {device}")


def parse_report(text: str) -> tuple[dict[str, str], list[dict[str, str]]]:
  """ncu --csv --page raw output -> (the units row: metric -> unit, one dict per profiled
  kernel). Lines before the header and lines not in CSV form are skipped; the row after the
  header holds the units."""
  lines = text.splitlines()
  start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
  if start is None:
    return {}, []
  # After the header only the report's own rows: the program's output and the tool's lines
  # ('==PROF==') may be mixed into the same file.
  table = [line for line in lines[start:] if line.startswith('"')]
  rows = list(csv.DictReader(io.StringIO("\n".join(table))))
  if rows and rows[0].get("ID", "") == "":
    return rows[0], rows[1:]
  return {}, rows


def _number(value: str) -> float:
  return float(value.replace(",", "")) if value not in ("", "n/a") else float("nan")


def summarize_kernel(row: dict[str, str], units: dict[str, str] | None = None) -> dict:
  """One kernel's counters in fixed units: time in us, clock in MHz, HBM traffic in MB."""
  units = units or {}
  time_ns = _number(row["gpu__time_duration.sum"])
  if units.get("gpu__time_duration.sum") == "usecond":
    time_ns *= 1e3
  elif units.get("gpu__time_duration.sum") == "msecond":
    time_ns *= 1e6
  cycles = _number(row["sm__cycles_elapsed.max"])
  scale = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}
  read = _number(row["dram__bytes_read.sum"]) * scale.get(
      units.get("dram__bytes_read.sum", "byte"), 1e-6)
  write = _number(row["dram__bytes_write.sum"]) * scale.get(
      units.get("dram__bytes_write.sum", "byte"), 1e-6)
  return {"kernel": row.get("Kernel Name", "")[:60], "time_us": time_ns / 1e3, "cycles": cycles,
          "clock_mhz": cycles / time_ns * 1e3, "hbm_read_mb": read, "hbm_write_mb": write,
          "l2_hit_pct": _number(row["lts__t_sector_hit_rate.pct"]),
          "sm_throughput_pct": _number(row["sm__throughput.avg.pct_of_peak_sustained_elapsed"])}


def summarize(paths: list[str]) -> None:
  print(f"{'report':52s} {'time us':>9s} {'cycles':>10s} {'MHz':>6s} {'HBM rd MB':>10s} "
        f"{'HBM wr MB':>10s} {'L2 hit%':>8s} {'SM %':>6s}  kernel")
  for path in paths:
    with open(path) as f:
      units, rows = parse_report(f.read())
    name = path.rsplit("/", 1)[-1]
    if not rows:
      print(f"{name:52s} no kernels profiled")
      continue
    s = summarize_kernel(rows[-1], units)
    print(f"{name:52s} {s['time_us']:9.1f} {s['cycles']:10.0f} {s['clock_mhz']:6.0f} "
          f"{s['hbm_read_mb']:10.1f} {s['hbm_write_mb']:10.1f} {s['l2_hit_pct']:8.1f} "
          f"{s['sm_throughput_pct']:6.1f}  {s['kernel']}")


def time_variants(variants: list[str], m: int, k: int, n: int, calls: int,
                  rounds: int) -> dict[str, list[float]]:
  """Per variant, the time per call (us) of each round; rounds interleave the variants.

  A first, untimed round brings the GPU to the clock it holds under this load (it sits at its
  power cap: the first milliseconds run faster), and each round starts one variant later in the
  list, so that no variant always runs first or always after the same one."""
  import time

  import jax

  x, w, c = operands(m, k, n)
  wt = jax.jit(lambda w: w.T)(w) if any(map(kmajor, variants)) else None  # [N, K] in memory
  args = {v: (x, wt if kmajor(v) else w, c) for v in variants}
  fns = {v: make_call(v) for v in variants}
  for v in variants:  # compile (and XLA's autotuning) outside the timed rounds
    fns[v](*args[v]).block_until_ready()
  times: dict[str, list[float]] = {v: [] for v in variants}
  for r in range(rounds + 1):
    for v in variants[r % len(variants):] + variants[:r % len(variants)]:
      start = time.perf_counter()
      for _ in range(calls):
        out = fns[v](*args[v])
      out.block_until_ready()
      if r > 0:  # round 0 warms up
        times[v].append((time.perf_counter() - start) / calls * 1e6)
  return times


def report_times(times: dict[str, list[float]]) -> list[dict]:
  """Rows of (variant, median us, fastest us, median / the first variant's median)."""
  import statistics

  base = statistics.median(next(iter(times.values())))
  return [{"variant": v, "median_us": statistics.median(t), "min_us": min(t),
           "ratio_to_first": statistics.median(t) / base} for v, t in times.items()]


def parse_variants(text: str) -> list[str]:
  """The comma-separated variant names, each one of VARIANTS."""
  variants = [v for v in text.split(",") if v]
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown:
    raise SystemExit(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
  return variants


def time_main(args, argv: list[str]) -> None:
  variants = parse_variants(args.variants)
  times = time_variants(variants, args.m, args.k, args.n, args.calls, args.rounds)
  rows = report_times(times)
  print(f"time {args.m}x{args.k}x{args.n}, {args.rounds} rounds of {args.calls} calls")
  for r in rows:
    print(f"{r['variant']:40s} median {r['median_us']:9.1f} us  fastest {r['min_us']:9.1f} us  "
          f"x{r['ratio_to_first']:.3f} of {variants[0]}")
  if args.json:
    import json
    import pathlib

    from jaxflux.bench import machine
    result = {**machine.provenance("benchmarks/ncu_gemms.py", argv),
              "shape": {"m": args.m, "k": args.k, "n": args.n}, "calls": args.calls,
              "rounds": args.rounds, "rows": rows, "round_times_us": times}
    path = pathlib.Path(args.json)
    if path.exists():  # one file collects several shapes: a list of results
      old = json.loads(path.read_text())
      result = (old if isinstance(old, list) else [old]) + [result]
    path.write_text(json.dumps(result, indent=1) + "\n")


def table_shapes(op: str, ms: list[int], tp: int, part: str, names: list[str] | None = None,
                 shapes_file: str | None = None) -> list[tuple[str, int, tuple[int, int, int]]]:
  """(shape name, global M, the per-device GEMM (m, k, n)) for each shapes.json shape of `op`
  at each M, as one device of a tensor-parallel degree `tp` runs it (module docstring)."""
  import json

  from jaxflux.bench.rows import Row, find_shapes_file

  if op not in ("ag_gemm", "gemm_rs"):
    raise SystemExit(f"--op must be ag_gemm or gemm_rs; got {op!r}")
  if part not in ("device", "own_rows") or (part == "own_rows" and op != "gemm_rs"):
    raise SystemExit(f"--part {part!r}: device, or own_rows with --op gemm_rs")
  table = json.loads(find_shapes_file(shapes_file).read_text())[op]
  known = [s["name"] for s in table]
  if names and set(names) - set(known):
    raise SystemExit(f"--shapes: unknown {sorted(set(names) - set(known))}; known {known}")
  out = []  # rows: the output's (ag_gemm: gathered; own rows: a rank's), else x's (gemm_rs)
  for s in table:
    if names and s["name"] not in names:
      continue
    for m in ms:
      shapes = Row(op, s["name"], m, int(s["K"]), int(s["N"]), tp, "bfloat16").per_device_shapes
      rows = shapes["x"][0] if op == "gemm_rs" and part == "device" else shapes["out"][0]
      out.append((s["name"], m, (rows, *shapes["w"])))
  return out


def table_main(args, argv: list[str]) -> None:
  import json
  import pathlib

  variants = parse_variants(args.variants)
  ms = [int(m) for m in args.M.split(",") if m]
  names = [n for n in args.shapes.split(",") if n] if args.shapes else None
  shapes = table_shapes(args.op, ms, args.tp, args.part, names, args.shapes_file)
  record = None
  if args.json:
    from jaxflux.bench import machine
    record = {**machine.provenance("benchmarks/ncu_gemms.py", argv), "op": args.op,
              "part": args.part, "tp": args.tp, "calls": args.calls, "rounds": args.rounds,
              "variants": variants, "ratios_to": variants[0], "results": [],
              "rows_planned": len(shapes)}
    pathlib.Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
  print(f"{'shape':14s} {'M':>6s} {'per-device m x k x n':>22s}  " +
        "  ".join(f"{v[:24]:>24s}" for v in variants))
  for name, m, (gm, gk, gn) in shapes:
    times = time_variants(variants, gm, gk, gn, args.calls, args.rounds)
    rows = report_times(times)
    cells = "  ".join(f"{r['median_us']:13.1f} x{r['ratio_to_first']:.3f}".rjust(24) for r in rows)
    print(f"{name:14s} {m:6d} {f'{gm}x{gk}x{gn}':>22s}  {cells}")
    if record is not None:  # rewritten after every row: a run cut short keeps what it measured
      record["results"].append({"shape": name, "M": m, "gemm": {"m": gm, "k": gk, "n": gn},
                                "rows": rows, "round_times_us": times})
      pathlib.Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="command", required=True)
  r = sub.add_parser("run", help="call one variant's GEMM (under ncu)")
  r.add_argument("variant", choices=VARIANTS)
  r.add_argument("m", type=int)
  r.add_argument("k", type=int)
  r.add_argument("n", type=int)
  r.add_argument("--calls", type=int, default=3)
  t = sub.add_parser("time", help="time variants back to back, interleaved rounds (no ncu)")
  t.add_argument("variants", help="comma-separated; ratios are to the first")
  t.add_argument("m", type=int)
  t.add_argument("k", type=int)
  t.add_argument("n", type=int)
  t.add_argument("--calls", type=int, default=50)
  t.add_argument("--rounds", type=int, default=5)
  t.add_argument("--json", help="append the result to this JSON file")
  tb = sub.add_parser("table", help="time variants on every shape of one op (interleaved rounds)")
  tb.add_argument("--op", required=True, help="ag_gemm or gemm_rs")
  tb.add_argument("--M", required=True, help="comma-separated global M (tokens)")
  tb.add_argument("--tp", type=int, default=2)
  tb.add_argument("--part", default="device", help="device, or own_rows (gemm_rs)")
  tb.add_argument("--variants", required=True, help="comma-separated; ratios are to the first")
  tb.add_argument("--shapes", help="comma-separated shape names (default: all of the op)")
  tb.add_argument("--shapes-file", help="default: as python -m jaxflux.bench")
  tb.add_argument("--calls", type=int, default=20)
  tb.add_argument("--rounds", type=int, default=5)
  tb.add_argument("--json", help="write the results to this JSON file")
  s = sub.add_parser("summarize", help="one line per ncu CSV report")
  s.add_argument("reports", nargs="+")
  sub.add_parser("metrics", help="print the metrics to pass to ncu --metrics")
  argv = list(sys.argv[1:] if argv is None else argv)
  args = p.parse_args(argv)
  if args.command == "run":
    run(args.variant, args.m, args.k, args.n, args.calls)
  elif args.command == "time":
    time_main(args, argv)
  elif args.command == "table":
    table_main(args, argv)
  elif args.command == "summarize":
    summarize(args.reports)
  else:
    sys.stdout.write(",".join(METRICS) + "\n")


if __name__ == "__main__":
  main()
