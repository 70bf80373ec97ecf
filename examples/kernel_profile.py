"""Where a step's GPU time goes, from JAX's profiler: the GEMM kernels, the other kernels and
copies, and the time the GPU sits idle, per step. generate.py --profile uses it to tell a
decode step's per-call cost (launches, host work between calls) from its kernels' time.

    breakdown = kernel_profile.profile(lambda: step(...), steps=8)

The profiler's device planes ("/device:GPU:N") hold one line per stream with one event per
kernel or copy; other lines of those planes are derived views of the same time (XLA ops and
modules, steps) and are left out. A GEMM is any kernel whose name says so: cuBLAS's (nvjet,
*gemm*, xmma) and CUTLASS's, which jaxflux's kernels are.
"""
from __future__ import annotations

import glob
import os
import re
import tempfile
from typing import Callable

import jax

GEMM_KERNEL = re.compile(r"gemm|nvjet|xmma|cutlass|cublas", re.IGNORECASE)
# Lines of a device plane that re-present its streams' time rather than add to it.
DERIVED_LINES = ("XLA Modules", "XLA Ops", "XLA TraceMe", "Steps", "Framework Ops",
                 "Framework Name Scope", "Source code", "Launch Stats", "TensorFlow Ops",
                 "TensorFlow Name Scope")
TOP_KERNELS = 8


def profile(step: Callable[[], object], steps: int) -> dict | None:
  """Runs step() `steps` times under jax.profiler, each call waited for as a timed decode step
  is, and returns `breakdown` of the trace (None where no GPU ran a kernel, e.g. on CPU)."""
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder):
      for _ in range(steps):
        jax.block_until_ready(step())
    files = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
    if len(files) != 1:
      raise RuntimeError(f"expected one profile (*.xplane.pb) under {folder}, found {files}")
    return breakdown(jax.profiler.ProfileData.from_file(files[0]), steps)


def breakdown(data, steps: int) -> dict | None:
  """Per step, averaged over the GPUs that ran kernels: the GEMM kernels' time and count, the
  other kernels' and copies', the time any stream was busy, and the kernels that took longest.
  Times in ms. None when no GPU plane has kernels."""
  per_gpu = [_plane_totals(p) for p in data.planes if p.name.startswith("/device:GPU:")]
  per_gpu = [t for t in per_gpu if t["events"]]
  if not per_gpu:
    return None
  mean = lambda key: sum(t[key] for t in per_gpu) / len(per_gpu) / steps
  kernels: dict[str, list] = {}
  for t in per_gpu:
    for name, (ns, count) in t["kernels"].items():
      total = kernels.setdefault(name, [0, 0])
      total[0] += ns
      total[1] += count
  top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
  scale = len(per_gpu) * steps
  return dict(
      steps=steps, gpus=len(per_gpu),
      gemm_ms=mean("gemm_ns") / 1e6, gemm_calls=mean("gemm_n"),
      other_ms=mean("other_ns") / 1e6, other_calls=mean("other_n"),
      busy_ms=mean("busy_ns") / 1e6,
      top_kernels=[[name, ns / scale / 1e6, count / scale] for name, (ns, count) in top],
      lines=sorted({line for t in per_gpu for line in t["lines"]}))


def _plane_totals(plane) -> dict:
  totals = dict(gemm_ns=0.0, gemm_n=0, other_ns=0.0, other_n=0, events=0, kernels={}, lines=[])
  spans = []
  for line in plane.lines:
    if line.name in DERIVED_LINES:
      continue
    totals["lines"].append(line.name)
    for event in line.events:
      kind = "gemm" if GEMM_KERNEL.search(event.name) else "other"
      totals[f"{kind}_ns"] += event.duration_ns
      totals[f"{kind}_n"] += 1
      totals["events"] += 1
      ns, count = totals["kernels"].get(event.name, (0.0, 0))
      totals["kernels"][event.name] = (ns + event.duration_ns, count + 1)
      spans.append((event.start_ns, event.start_ns + event.duration_ns))
  totals["busy_ns"] = _union_length(spans)
  return totals


def _union_length(spans) -> float:
  """The length of the union of [start, end) spans (kernels of several streams overlap)."""
  total, reach = 0.0, float("-inf")
  for start, end in sorted(spans):
    if end > reach:
      total += end - max(start, reach)
      reach = end
  return total
