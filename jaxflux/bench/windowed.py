"""The xla_windowed variant: a child process with XLA's windowed-einsum flags times it, the
parent merges its rows."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax

from jaxflux.bench.config import CHILD_MARKER, WINDOWED_FLAGS, repo_root
from jaxflux.bench.inputs import make_mesh
from jaxflux.bench.machine import is_gpu
from jaxflux.bench.measure import bench_row
from jaxflux.bench.rows import build_rows, find_shapes_file
from jaxflux.bench.summary import overlap, ratio


def platforms_exclude_gpu(args) -> str | None:
  """A reason when JAX is configured for platforms without a GPU (checked without starting
  the backends, so the child can run before this process claims GPU memory)."""
  platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS") or ""
  has_gpu = any(p in platforms for p in ("cuda", "gpu", "rocm"))
  if platforms and not has_gpu and not args._windowed_anywhere:
    return f"needs a GPU (jax_platforms={platforms!r})"
  return None


def _child_argv(argv: list[str], shapes_path: pathlib.Path | None) -> list[str]:
  """The parent's own arguments, with the variants narrowed and the child flag added (argparse
  keeps the last occurrence of an option)."""
  extra = ["--shapes-file", str(shapes_path)] if shapes_path else []
  return [*argv, *extra, "--variants", "xla,xla_windowed", "--_windowed-child"]


def run_windowed_child(args, argv: list[str], shapes_path, log=print) -> dict:
  """Times xla and xla_windowed in a child process with the windowed-einsum XLA flags.

  Returns {row_key_json: child_row_record} or {"error": reason}. Runs before this process
  starts its GPU backend, so the child may use the memory XLA would otherwise preallocate here.
  """
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + " ".join(WINDOWED_FLAGS)).strip()
  root = str(repo_root())
  env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  cmd = [sys.executable, "-m", "jaxflux.bench", *_child_argv(argv, shapes_path)]
  log(f"[bench] xla_windowed: child process with XLA_FLAGS={env['XLA_FLAGS']!r}", flush=True)
  try:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=args.child_timeout, cwd=os.getcwd())
  except subprocess.TimeoutExpired:
    return {"error": f"child process timed out after {args.child_timeout} s"}
  payload = None
  for line in proc.stdout.splitlines():
    if line.startswith(CHILD_MARKER):
      payload = json.loads(line[len(CHILD_MARKER):])
  if payload is None:
    tail = (proc.stderr or proc.stdout or "")[-1500:]
    return {"error": f"child process (rc={proc.returncode}) printed no result: {tail}"}
  if proc.stderr:
    sys.stderr.write(proc.stderr[-3000:])
  return payload


def merge_windowed(record: dict, child: dict) -> None:
  if "error" in child or "skipped" in child:
    record["ms"]["xla_windowed"] = None
    record["errors"]["xla_windowed"] = child.get("error") or child.get("skipped")
    return
  crow = child["rows"].get(json.dumps(record["key"]))
  if crow is None:
    record["errors"]["xla_windowed"] = "child process returned no row for this shape"
    return
  for field in ("ms", "spread_ms", "samples_ms", "calls_per_run", "compile_and_first_run_s"):
    value = crow[field].get("xla_windowed")
    if value is not None or field in ("ms", "spread_ms"):
      record[field]["xla_windowed"] = value
  if crow["errors"].get("xla_windowed"):
    record["errors"]["xla_windowed"] = crow["errors"]["xla_windowed"]
  else:
    record["errors"].pop("xla_windowed", None)
  if "xla_windowed" in crow.get("rel_err", {}):
    record["rel_err"]["xla_windowed"] = crow["rel_err"]["xla_windowed"]
  t, ref = crow["ms"].get("xla_windowed"), crow["ms"].get("xla")
  record["xla_windowed_detail"] = {
      "flags": list(WINDOWED_FLAGS), "xla_ms_in_child": ref,
      "windowed_loop_in_hlo": crow.get("windowed_loop_in_hlo"),
  }
  record["speedup_vs_xla_all"]["xla_windowed"] = ratio(ref, t)
  if t is not None:
    if "tflops" in record:
      record["tflops"]["xla_windowed"] = record["flops_per_device"] / t / 1e9
    ms = record["ms"]
    record["overlap_efficiency_all"]["xla_windowed"] = overlap(ms.get("gemm"), ms.get("comm"), t)


def run_child(args) -> dict:
  """The --_windowed-child mode: time xla and xla_windowed for the given rows, return JSON."""
  if not is_gpu() and not args._windowed_anywhere:
    return {"skipped": f"needs a GPU (platform is {jax.default_backend()})"}
  shapes_path = None if args.op == "all_gather" and args.sizes_mib else find_shapes_file(
      args.shapes_file)
  shapes = json.loads(shapes_path.read_text()) if shapes_path else {}
  mesh = make_mesh(args.tp or len(jax.devices()))
  out = {"platform": jax.default_backend(), "rows": {}}
  for row in build_rows(args, shapes, mesh.devices.size):
    record = bench_row(row, mesh, ["xla", "xla_windowed"], args, log=lambda *a, **k: None)
    out["rows"][json.dumps(row.key())] = record
  return out
