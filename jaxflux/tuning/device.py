"""Which GPU the kernel choices are for.

H100 SXM and H200 share sm90, 132 SMs and 50 MB of L2 and differ in memory (HBM3 at 3.35 TB/s
against HBM3e at 4.8 TB/s), so neither the architecture nor the SM count tells their best
kernels apart. A device is keyed by what JAX reports as its kind (the CUDA device name, e.g.
"NVIDIA H100 80GB HBM3"), as vLLM keys its kernel configs, plus its compute capability and SMs.
"""
from __future__ import annotations

import dataclasses
import re

from jaxflux import _runtime

# The devices jaxflux ships a measured table for: device kind -> table name
# (jaxflux/tuning/tables/<name>.json).
SHIPPED_TABLES = {
    "NVIDIA H100 80GB HBM3": "h100_sxm",
    "NVIDIA H200": "h200",
}


@dataclasses.dataclass(frozen=True)
class Device:
  kind: str                 # JAX's device_kind: the CUDA device name
  compute_capability: str   # "9.0"
  sms: int                  # streaming multiprocessors

  @property
  def slug(self) -> str:
    """The kind as a file name: "nvidia_h100_80gb_hbm3"."""
    return re.sub(r"[^a-z0-9]+", "_", self.kind.lower()).strip("_")

  @property
  def shipped_table(self) -> str | None:
    """The name of jaxflux's measured table for this kind, or None."""
    return SHIPPED_TABLES.get(self.kind)

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def current() -> Device | None:
  """This process's first GPU (lowest CUDA ordinal), or None without a CUDA build and GPU."""
  if not _runtime.has_cuda():
    return None
  first = min(_runtime.local_gpus(), key=lambda d: getattr(d, "local_hardware_id", 0) or 0)
  return Device(kind=str(getattr(first, "device_kind", "")),
                compute_capability=str(getattr(first, "compute_capability", "")),
                sms=_runtime.sm_count())
