"""What ran the benchmark: platform, devices, driver, package versions, git revision."""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import shlex
import subprocess
import sys
from typing import Any

import jax

from jaxflux.bench.config import repo_root


def is_gpu() -> bool:
  return jax.default_backend() in ("gpu", "cuda", "rocm")


def _dist_version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def _nvidia_smi() -> list[dict] | None:
  try:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
  except (OSError, subprocess.SubprocessError):
    return None
  if out.returncode != 0:
    return None
  gpus = []
  for line in out.stdout.strip().splitlines():
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 4:
      gpus.append(dict(zip(("name", "driver_version", "memory_total", "max_sm_clock"), parts)))
  return gpus or None


def machine_info() -> dict:
  """What ran the benchmark, without host names."""
  devices = jax.devices()
  info: dict[str, Any] = {
      "platform": jax.default_backend(),
      "device_count": len(devices),
      "device_kinds": sorted({d.device_kind for d in devices}),
      "core_count": getattr(devices[0], "core_count", None),
  }
  try:
    from jax.extend import backend as jax_backend
    info["platform_version"] = jax_backend.get_backend().platform_version
  except Exception:  # noqa: BLE001 - optional detail
    info["platform_version"] = None
  if is_gpu():
    smi = _nvidia_smi()
    info["nvidia_smi"] = smi
    info["driver_version"] = smi[0]["driver_version"] if smi else None
  return info


def versions() -> dict:
  import jaxflux
  v = {name: _dist_version(name) for name in (
      "jax", "jaxlib", "flax", "numpy", "jax-cuda12-plugin", "jax-cuda12-pjrt",
      "jax-cuda13-plugin", "jax-cuda13-pjrt")}
  v = {k: x for k, x in v.items() if x is not None}
  v["python"] = sys.version.split()[0]
  v["jaxflux"] = getattr(jaxflux, "__version__", None) or _dist_version("jaxflux")
  try:
    from jaxflux import _runtime
    v["jaxflux_cuda_built"] = _runtime.cuda_built()
  except Exception:  # noqa: BLE001
    v["jaxflux_cuda_built"] = None
  v["jaxflux_has_cuda"] = jaxflux.has_cuda()
  try:
    rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                         cwd=repo_root(), timeout=10)
    dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                           cwd=repo_root(), timeout=10)
    if rev.returncode == 0:
      v["jaxflux_git"] = rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
  except (OSError, subprocess.SubprocessError):
    pass
  return v


def provenance(program: str, argv: list, stamp: datetime.datetime | None = None) -> dict:
  """The head of every result record: the command that produced it (`program` + argv), the
  environment that changes what is measured (XLA_FLAGS), UTC date, machine, versions."""
  stamp = stamp or datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
  return {
      "command": f"{program} {shlex.join(argv)}",
      "argv": list(argv),
      "env": {k: os.environ[k] for k in ("XLA_FLAGS",) if k in os.environ},
      "date": stamp.isoformat().replace("+00:00", "Z"),
      "machine": machine_info(),
      "versions": versions(),
  }
