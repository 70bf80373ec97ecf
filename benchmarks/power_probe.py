"""SM clock and power draw while each variant of one benchmark row runs back to back (GPU
machine): is a fused op's time over its GEMM alone the GPUs slowing their clocks (power: the
copy engines and NVLink draw too) or the GEMM itself being slower at the same clock?

    python benchmarks/power_probe.py --op ag_gemm --shape llama70b-fc1 --M 8192 \
        [--variants gemm,gemm_only,jaxflux] [--seconds 3] [--out probe.json]

Each variant runs for --seconds of queued calls (the benchmark's variants and inputs,
`jaxflux.bench`), while `nvidia-smi` samples every GPU every 20 ms. Per variant and GPU it prints
the ms per call (wall clock over the phase), the median SM clock, the mean power, the energy
per call (mean power x time per call), the SM cycles per call (time x median clock) and the
clock event (throttle) reasons seen, from the
samples inside the phase less its first 0.3 s.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import tempfile
import time

FIELDS = ("timestamp", "index", "clocks.sm", "power.draw", "clocks_event_reasons.active")
# The reasons field's name before NVIDIA's drivers renamed it (same bit mask).
OLD_REASONS_FIELD = "clocks_throttle_reasons.active"
SKIP_S = 0.3  # the start of a phase: clocks still moving from the previous one


def parse_samples(text: str) -> list[dict]:
  """nvidia-smi --format=csv,noheader,nounits lines of FIELDS -> dicts with epoch seconds."""
  samples = []
  for line in text.splitlines():
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS):
      continue
    try:
      stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
      samples.append({"t": stamp, "gpu": int(parts[1]), "sm_mhz": float(parts[2]),
                      "power_w": float(parts[3]), "reasons": parts[4]})
    except ValueError:
      continue  # a header, or "[N/A]"
  return samples


def summarize(samples: list[dict], phases: dict[str, tuple[float, float]]) -> dict:
  """Per phase (name -> (start, end) epoch seconds) and GPU: sample count, median SM clock,
  mean power, the distinct clock event reasons (a bit mask, hex) seen."""
  out: dict[str, dict] = {}
  for name, (start, end) in phases.items():
    per_gpu: dict[int, list[dict]] = {}
    for s in samples:
      if start + SKIP_S <= s["t"] <= end:
        per_gpu.setdefault(s["gpu"], []).append(s)
    out[name] = {
        str(gpu): {"samples": len(ss),
                   "sm_mhz_median": statistics.median(s["sm_mhz"] for s in ss),
                   "power_w_mean": round(statistics.fmean(s["power_w"] for s in ss), 1),
                   "reasons": sorted({s["reasons"] for s in ss})}
        for gpu, ss in sorted(per_gpu.items())}
  return out


def energy_per_call(phases: dict, ms: dict[str, float]) -> dict[str, dict[str, float]]:
  """Per phase and GPU: mJ per call, the mean power times the time per call. At the power
  cap, the same math done with less energy is done faster."""
  return {name: {gpu: round(s["power_w_mean"] * ms[name], 3) for gpu, s in per_gpu.items()}
          for name, per_gpu in phases.items()}


def cycles_per_call(phases: dict, ms: dict[str, float]) -> dict[str, dict[str, float]]:
  """Per phase and GPU: millions of SM cycles per call, the time per call times the median
  clock. Two variants that differ in time but not in cycles differ only by their clocks."""
  return {name: {gpu: round(s["sm_mhz_median"] * ms[name] / 1e3, 4) for gpu, s in per_gpu.items()}
          for name, per_gpu in phases.items()}


def run_phases(op: str, shape: str, m: int, variants: list[str], seconds: float):
  """Runs every variant for `seconds` of back-to-back calls; returns ({name: (start, end)},
  {name: ms per call})."""
  import jax

  from jaxflux.bench.cli import parse_args
  from jaxflux.bench.inputs import make_inputs, make_mesh
  from jaxflux.bench.rows import build_rows, find_shapes_file
  from jaxflux.bench.timing import _Timed, chain_kind
  from jaxflux.bench.variants import make_variant

  args = parse_args(["--op", op, "--shapes", shape, "--M", str(m), "--timing", "dispatch",
                     "--iters", "20"])
  mesh = make_mesh(len(jax.devices()))
  shapes = json.loads(find_shapes_file(None).read_text())
  (row,) = build_rows(args, shapes, mesh.devices.size)
  inputs = make_inputs(row, mesh, 2, args.seed)
  phases, ms = {}, {}
  for name in variants:
    timed = _Timed(make_variant(name, row), mesh, inputs, args.iters, "dispatch",
                   chain_kind(args))
    timed.run().block_until_ready()  # compile, warm up
    time.sleep(0.5)  # an idle gap between phases in the samples
    start, calls, previous = time.time(), 0, None
    while time.time() - start < seconds:
      y = timed.run()  # queued; one run stays queued behind the one being waited for, so the
      calls += timed.calls  # GPUs never idle and the host never queues far ahead
      if previous is not None:
        previous.block_until_ready()
      previous = y
    previous.block_until_ready()
    end = time.time()
    phases[name], ms[name] = (start, end), (end - start) * 1e3 / calls
  return phases, ms


def sample_while(command: list[str], work):
  """Runs the sampler `command` while work() runs; returns (work's result, the sampler's output).

  The output goes to a file, not a pipe: nobody reads a pipe until the end, and once its 64 KiB
  buffer is full the sampler blocks (session 9: every phase after the first had no samples).
  """
  with tempfile.TemporaryFile("w+") as log:
    sampler = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
      result = work()
    finally:
      sampler.terminate()
      sampler.wait(timeout=10)
    log.seek(0)
    return result, log.read()


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--op", choices=("ag_gemm", "gemm_rs"), required=True)
  p.add_argument("--shape", required=True, help="a name in shapes.json, e.g. llama70b-fc1")
  p.add_argument("--M", type=int, required=True)
  p.add_argument("--variants", default="gemm,gemm_only,jaxflux")
  p.add_argument("--seconds", type=float, default=3.0)
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  fields = list(FIELDS)
  probe = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True)
  if probe.returncode != 0:  # an older driver: the reasons field's old name
    fields[-1] = OLD_REASONS_FIELD
  command = ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
             "-lms", "20"]
  (phases, ms), text = sample_while(
      command, lambda: run_phases(args.op, args.shape, args.M, args.variants.split(","),
                                  args.seconds))
  samples = parse_samples(text)
  if not samples:
    raise SystemExit("nvidia-smi gave no samples:\n" + text[:2000])
  result = {"op": args.op, "shape": args.shape, "M": args.M, "ms_per_call": ms,
            "phases": summarize(samples, phases)}
  result["mj_per_call"] = energy_per_call(result["phases"], ms)
  result["mcycles_per_call"] = cycles_per_call(result["phases"], ms)
  for name, per_gpu in result["phases"].items():
    for gpu, s in per_gpu.items():
      print(f"{args.op} {args.shape} M={args.M} {name:10s} GPU{gpu}: {ms[name]:.3f} ms/call, "
            f"SM {s['sm_mhz_median']:.0f} MHz, {s['power_w_mean']:.0f} W, "
            f"{result['mj_per_call'][name][gpu]:.0f} mJ/call, "
            f"{result['mcycles_per_call'][name][gpu]:.3f} Mcycles/call, reasons "
            f"{','.join(s['reasons'])} ({s['samples']} samples)")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
