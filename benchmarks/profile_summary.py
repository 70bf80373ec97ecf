"""Where the GPU time of a profiled step goes: totals per kernel and per kind of work, from the
trace that `examples/train_tp_transformer.py --profile DIR` (jax.profiler) writes.

    python benchmarks/profile_summary.py DIR [--top 15] [--out summary.json]

Reads the newest `*.trace.json.gz` under DIR. For every GPU of the trace: the span from its
first to its last event, the busy time (the union of its events' intervals: concurrent streams
are not double counted), and per category and per kernel the summed durations (these do double
count overlap, which is the point where communication hides behind GEMMs).
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib

# First match wins; names are kernel names as the profiler records them.
CATEGORIES = (
    ("jaxflux", ("jaxflux", "AgGemm", "WaitReduce", "WaitCopy", "Release", "DeviceClock")),
    ("nccl", ("nccl",)),
    ("gemm", ("gemm", "xmma", "nvjet", "cutlass", "Gemm", "matmul")),
    ("copy", ("Memcpy", "memcpy", "Memset", "memset")),
    ("attention/softmax/norm/other fusions", ("fusion", "reduce", "softmax")),
)


def category(name: str) -> str:
  for label, keys in CATEGORIES:
    if any(k in name for k in keys):
      return label
  return "other"


def newest_trace(directory: str) -> pathlib.Path:
  traces = sorted(pathlib.Path(directory).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
  if not traces:
    raise SystemExit(f"no *.trace.json.gz under {directory} (run the example with --profile)")
  return traces[-1]


def busy_time(intervals: list[tuple[float, float]]) -> float:
  """Length of the union of [start, end) intervals."""
  total, end = 0.0, float("-inf")
  for s, e in sorted(intervals):
    if e <= end:
      continue
    total += e - max(s, end)
    end = e
  return total


def summarize(events: list[dict]) -> dict:
  """{device name: {span_us, busy_us, by_category, by_kernel}} for every /device:GPU process."""
  devices = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"
             and str(e.get("args", {}).get("name", "")).startswith("/device:GPU")}
  per = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in devices and e.get("dur") is not None:
      per[e["pid"]].append(e)
  result = {}
  for pid, evs in sorted(per.items(), key=lambda kv: devices[kv[0]]):
    by_kernel = collections.defaultdict(lambda: [0.0, 0])
    by_category = collections.defaultdict(float)
    for e in evs:
      by_kernel[e["name"]][0] += e["dur"]
      by_kernel[e["name"]][1] += 1
      by_category[category(e["name"])] += e["dur"]
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in evs]
    result[devices[pid]] = {
        "span_us": max(b for _, b in intervals) - min(a for a, _ in intervals),
        "busy_us": busy_time(intervals),
        "by_category": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
        "by_kernel": [{"name": n, "total_us": t, "count": c}
                      for n, (t, c) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])],
    }
  return result


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("directory")
  p.add_argument("--top", type=int, default=15)
  p.add_argument("--out", default=None, help="also write the summary as JSON here")
  args = p.parse_args(argv)
  path = newest_trace(args.directory)
  with gzip.open(path) as f:
    summary = summarize(json.load(f)["traceEvents"])
  print(f"{path}")
  if not summary:
    print("no GPU events in this trace (a CPU run?)")
  for device, s in summary.items():
    print(f"{device}: span {s['span_us'] / 1e3:.3f} ms, busy {s['busy_us'] / 1e3:.3f} ms")
    for label, us in s["by_category"].items():
      print(f"  {label:40s} {us / 1e3:9.3f} ms")
    for k in s["by_kernel"][:args.top]:
      print(f"    {k['total_us'] / 1e3:9.3f} ms  x{k['count']:<4d} {k['name'][:90]}")
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps({"trace": str(path), "devices": summary},
                                                 indent=1) + "\n")
  return summary


if __name__ == "__main__":
  main()
