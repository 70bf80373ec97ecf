"""Native runtime: loads the extension, registers FFI targets, owns global settings.

Without the CUDA build (or without a GPU) everything here degrades to "no fused kernels", and
the ops run their pure-JAX reference path.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import threading

import jax

try:  # The extension is always built by the package build, but source checkouts may lack it.
  from jaxflux import _jaxflux as _ext
except ImportError:  # pragma: no cover - exercised only on source checkouts
  _ext = None


@dataclasses.dataclass
class _Settings:
  timeout_s: float = 30.0
  workspace_bytes: int | None = None
  sync_errors: bool = False
  # "state": ranks cached per executable instance (XLA FFI state); "site": cached per traced call
  # site and device, checked on device every call. See docs/runtime.md.
  rank_cache: str = os.environ.get("JAXFLUX_RANK_CACHE", "state")


_settings = _Settings()


def cuda_built() -> bool:
  """True when the installed extension contains the CUDA kernels."""
  return bool(_ext is not None and getattr(_ext, "cuda_built", False))


@functools.cache
def _gpu_devices() -> tuple:
  try:
    # Local only: under jax.distributed, jax.devices() also lists other processes' GPUs.
    return tuple(jax.local_devices(backend="gpu"))
  except RuntimeError:
    return ()


def has_cuda() -> bool:
  """True when fused kernels can run here: a CUDA build of jaxflux and at least one CUDA GPU."""
  return cuda_built() and len(_gpu_devices()) > 0


def configure(*, timeout_s: float | None = None, workspace_bytes: int | None = None,
              sync_errors: bool | None = None) -> None:
  """Sets global runtime options.

  Args:
    timeout_s: how long a GPU spin-wait on a peer may last before the op fails with an error
      naming the op, rank and peer (default 30 s).
    workspace_bytes: minimum size of the per-device symmetric workspace to reserve up front
      (default: sized from the shapes of the traced programs).
    sync_errors: debug setting: every fused call synchronizes its stream after launch, so that a
      timeout fails the call that timed out instead of the next one (slow).
  """
  if timeout_s is not None:
    if not timeout_s > 0:
      raise ValueError(f"configure(timeout_s={timeout_s!r}): must be a positive number of seconds")
    _settings.timeout_s = float(timeout_s)
  if workspace_bytes is not None:
    if int(workspace_bytes) < 0:
      raise ValueError(f"configure(workspace_bytes={workspace_bytes!r}): must be >= 0")
    _settings.workspace_bytes = int(workspace_bytes)
  if sync_errors is not None:
    _settings.sync_errors = bool(sync_errors)
  _push_settings()


def _push_settings() -> None:
  if cuda_built():
    _ext.set_timeout_ns(int(_settings.timeout_s * 1e9))
    _ext.set_sync_errors(_settings.sync_errors)


# --------------------------------------------------------------------------------------------
# FFI targets and the symmetric workspace (CUDA builds only).

_lock = threading.Lock()
_site_ids = itertools.count(1)


def new_site_id() -> int:
  """A process-unique id for one traced fused call (keys its rank discovery)."""
  return next(_site_ids)


@functools.cache
def register_targets() -> frozenset:
  """Registers the FFI state types and targets with XLA once; returns the usable target names.

  The stateful target needs `jax.ffi.register_ffi_type`; where it is missing or refused, only the
  site-cached target is registered (docs/runtime.md).
  """
  if not has_cuda():
    return frozenset()
  _push_settings()
  names = set()
  stateful_ok = True
  for name, registration in _ext.type_registrations().items():
    try:
      jax.ffi.register_ffi_type(name, registration, platform="CUDA")
    except Exception:  # noqa: BLE001 - older/newer jaxlib without state types: use the fallback
      stateful_ok = False
  for name, target in _ext.registrations().items():
    if isinstance(target, dict) and not stateful_ok:
      continue
    jax.ffi.register_ffi_target(name, target, platform="CUDA", api_version=1)
    names.add(name)
  return frozenset(names)


def target_name(op: str) -> str:
  """The FFI target of `op` for the configured rank cache ("state" or "site")."""
  names = register_targets()
  stateful = f"jaxflux_{op}"
  site = f"jaxflux_{op}_site_cached"
  if _settings.rank_cache == "state" and stateful in names:
    return stateful
  if site in names:
    return site
  raise RuntimeError(f"jaxflux: no FFI target for {op}: the extension was built without CUDA "
                     "or no GPU is visible (jaxflux.has_cuda() is False).")


def ensure_workspace(nbytes: int) -> int:
  """Makes every local GPU hold >= nbytes of symmetric workspace; returns its generation.

  Called at trace time, before the program runs. Growth allocates new arenas and keeps the old
  ones alive, since programs queued earlier may still use them.
  """
  ordinals = sorted(d.local_hardware_id for d in _gpu_devices())
  with _lock:
    return int(_ext.ensure_workspace(ordinals, int(nbytes), int(_settings.workspace_bytes or 0)))


def check_errors() -> None:
  """Raises RuntimeError with the first error a jaxflux kernel recorded (e.g. a timeout).

  Kernels never trap (that would kill the CUDA context XLA shares); they record what went wrong
  and exit, and the next fused call, or this function, reports it. Call it after
  `block_until_ready()` when you want a timeout of the last call surfaced at once.
  """
  if not cuda_built():
    return
  message = _ext.take_device_error()
  if message is not None:
    raise RuntimeError(message)
