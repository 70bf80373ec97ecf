"""The command line of python -m jaxflux.tune (see jaxflux/tune/__init__.py)."""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys
import time

from jaxflux import tuning
from jaxflux.bench import cli as bench_cli
from jaxflux.tune import pick
from jaxflux.tuning import device as _device
from jaxflux.tuning import tables


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog="python -m jaxflux.tune",
      description="Times the fused ops' GEMM candidates against cuBLAS on this GPU and writes "
                  "the device table jaxflux then uses on this kind of GPU.")
  p.add_argument("--shapes-file", default=None,
                 help="shapes JSON as benchmarks/shapes.json (default: that file)")
  p.add_argument("--shapes", default=None, help="comma-separated shape names of the file")
  p.add_argument("--M", default=None, help="comma-separated token counts (default: the file's)")
  p.add_argument("--of", default="ag_gemm,gemm_rs",
                 help="which GEMMs: ag_gemm (AllGather+GEMM's), gemm_rs (GEMM+RS's own rows)")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
  p.add_argument("--iters", type=int, default=20, help="calls per timed run (default 20)")
  p.add_argument("--warmup", type=int, default=20, help="untimed calls first (default 20)")
  p.add_argument("--repeats", type=int, default=3, help="interleaved timed runs (default 3)")
  p.add_argument("--min-gain", type=float, default=pick.MIN_GAIN,
                 help="an exact shape gets its own entry where its fastest candidate beats its "
                      "class's choice by more than this fraction (default 0.01)")
  p.add_argument("--from", dest="sweeps", nargs="+", default=None, metavar="SWEEP.json",
                 help="build the table from recorded sweeps (python -m jaxflux.bench --op gemm "
                      "--candidates) instead of measuring")
  p.add_argument("--out", default=None,
                 help="write the table here (default: the tuning dir's file for the device, "
                      "where jaxflux reads it)")
  p.add_argument("--show", action="store_true",
                 help="print which tables this process uses and why, then exit")
  return p.parse_args(argv)


def _device_of(results: list[dict]) -> _device.Device:
  """The GPU recorded sweeps ran on (one kind for all of them)."""
  found = set()
  for r in results:
    machine = r.get("machine", {})
    kinds = machine.get("device_kinds") or []
    if machine.get("platform") != "gpu" or len(set(kinds)) != 1:
      raise SystemExit(f"python -m jaxflux.tune --from: a sweep's machine record names "
                       f"{kinds or 'no GPU'}; a table is for one kind of GPU.")
    # The sweep runs the sm90a kernels, so its GPU is compute capability 9.0.
    found.add(_device.Device(kinds[0], str(machine.get("compute_capability", "9.0")),
                             int(machine.get("core_count", 0))))
  if len(found) != 1:
    raise SystemExit(f"python -m jaxflux.tune --from: the sweeps ran on different GPUs "
                     f"({sorted(d.kind for d in found)}); a table is for one kind of GPU.")
  return found.pop()


def _progress_bar(started: float):
  def show(done: int, total: int, what: str) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                     f"{time.monotonic() - started:5.0f} s  {what[:60]:<60}")
    sys.stderr.flush()
  return show


def _measure(args, device: _device.Device, sweep_path: pathlib.Path) -> dict:
  argv = ["--op", "gemm", "--candidates", "--of", args.of, "--dtype", args.dtype,
          "--timing", "device", "--iters", str(args.iters), "--warmup", str(args.warmup),
          "--repeats", str(args.repeats), "--out", str(sweep_path)]
  for flag, value in (("--shapes-file", args.shapes_file), ("--shapes", args.shapes),
                      ("--M", args.M)):
    if value:
      argv += [flag, value]
  started = time.monotonic()
  result = bench_cli.run(argv, log=lambda *a, **k: None, progress=_progress_bar(started))
  sys.stderr.write(f"\rmeasured {len(result['rows'])} rows on {device.kind} in "
                   f"{time.monotonic() - started:.0f} s{' ' * 50}\n")
  return result


def _report(rows, classes, shapes, before: dict) -> list[str]:
  lines = [f"{'op':<22} {'row':<24} {'class':<30} {'before':>7} {'after':>7}  choice after",
           "(time / cuBLAS's; > 1: slower)"]
  after_all: dict[str, list] = {}
  before_all: dict[str, list] = {}
  for r in rows:
    key = pick.chosen_key(r, classes, shapes)
    was = r.ratios.get(before[r.label, r.op])
    now = r.ratios[key]
    after_all.setdefault(r.op, []).append(now)
    if was is not None:
      before_all.setdefault(r.op, []).append(was)
    shown = "-" if was is None else f"{was:.3f}"
    lines.append(f"{r.op:<22} {r.label:<24} {r.shape_class:<30} {shown:>7} {now:>7.3f}  "
                 f"{pick.candidate_name(key)}")
  for op, values in after_all.items():
    was = before_all.get(op, [])
    was_text = f"{statistics.fmean(was):.3f} (worst {max(was):.3f})" if was else "-"
    lines.append(f"{op}: mean before {was_text}, after {statistics.fmean(values):.3f} "
                 f"(worst {max(values):.3f}) over {len(values)} rows")
  return lines


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  if args.show:
    print(tuning.describe())
    return 0
  local = _device.current()
  if args.sweeps:
    docs = [json.loads(pathlib.Path(f).read_text()) for f in args.sweeps]
    # A bench result, or a result file of benchmarks/results/ that keeps several as "runs".
    results = [r for doc in docs for r in doc.get("runs", [doc])]
    measured_on = _device_of(results)
    sweep_names = [pathlib.Path(f).name for f in args.sweeps]
  else:
    if local is None:
      raise SystemExit("python -m jaxflux.tune measures this machine's GPU, and JAX sees none "
                       "here (or jaxflux was built without CUDA). Run it on the GPU the table is "
                       "for, or pass --from SWEEP.json.")
    measured_on = local
  target = pathlib.Path(args.out) if args.out else tables.user_path(measured_on)
  if not args.out and (local is None or local.kind != measured_on.kind):
    raise SystemExit(f"python -m jaxflux.tune: refusing to write a table measured on "
                     f"{measured_on.kind!r} into the tuning dir of "
                     f"{'a machine without a GPU' if local is None else repr(local.kind)}: "
                     "jaxflux would use it on the wrong GPU. Pass --out PATH to write it "
                     "elsewhere.")
  target.parent.mkdir(parents=True, exist_ok=True)
  if not args.sweeps:
    sweep_path = target.with_suffix(".sweep.json")
    results = [_measure(args, measured_on, sweep_path)]
    sweep_names = [sweep_path.name]

  rows = [r for result in results for r in pick.swept_rows(result, measured_on.sms)]
  if not rows:
    raise SystemExit("python -m jaxflux.tune: the sweep timed no candidate; nothing to pick.")
  before = {(r.label, r.op): pick.current_key(r, measured_on) for r in rows}
  classes, shapes = pick.pick(rows, args.min_gain)
  first = results[0]
  measured = {"command": "python -m jaxflux.tune " + " ".join(sys.argv[1:] if argv is None
                                                              else argv),
              "date": datetime.datetime.now(datetime.timezone.utc).replace(
                  microsecond=0).isoformat(),
              "sweeps": sweep_names, "sweep_dates": [r.get("date") for r in results],
              "versions": first.get("versions", {}),
              "reference": "XLA's dot (cuBLAS); own rows: XLA's dot + C",
              "min_gain": args.min_gain}
  target.write_text(tables.to_json(measured_on, measured, classes, shapes))
  tables.reload()
  print("\n".join(_report(rows, classes, shapes, before)))
  print(f"wrote {target} ({len(classes)} class and {len(shapes)} shape entries for "
        f"{measured_on.kind})")
  return 0
