"""Native runtime: loads the extension, registers FFI targets, owns global settings, the
symmetric workspace, multi-process rank discovery and the GPUs' SM counts.

Without the CUDA build (or without a GPU) everything here degrades to "no fused kernels", and
the ops run their pure-JAX reference path.
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import json
import socket
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


_settings = _Settings()


def cuda_built() -> bool:
  """True when the installed extension contains the CUDA kernels."""
  return bool(_ext is not None and getattr(_ext, "cuda_built", False))


def max_ranks() -> int | None:
  """The largest group the fused cross-process ops take (the native runtime's cap: one NVLink
  domain); None without the extension, which has no fused kernels at all."""
  return None if _ext is None else int(_ext.max_ranks)


@functools.cache
def attribute_names() -> dict:
  """The kernels' enum attributes ("ag_tile", "gemm_tile", "own_rows_schedule",
  "grouped_tile"), each a tuple of names in value order: the native module's, from
  xla_ffi/ffi/attribute_names.h. {} without the extension."""
  return {} if _ext is None else {k: tuple(v) for k, v in _ext.attribute_names.items()}


def workspace_class(nbytes: int) -> int:
  """The symmetric workspace's size class for a call that needs `nbytes` per GPU: the smallest
  c with 2^c >= max(nbytes, the configured reserve), at least the runtime's smallest class. A
  pure function of the call's shapes and the settings, so a traced program names the same
  arenas in every process and in every run (the native module's classes, runtime.h)."""
  smallest, largest = _ext.workspace_classes
  need = max(int(nbytes), int(_settings.workspace_bytes or 0), 1)
  c = max(smallest, (need - 1).bit_length())
  if c > largest:
    raise ValueError(f"jaxflux: a fused call needs {need} bytes of symmetric workspace per GPU, "
                     f"more than the runtime's largest arena (2^{largest} bytes); split the "
                     "call along its rows.")
  return c


def group_workspace_bytes(op: str, tp: int, item_bytes: int, scale_bytes: int = 0) -> int:
  """Bytes of symmetric workspace per GPU that a communicating call of `op` (its target's name
  less "jaxflux_") needs in a group of tp: item_bytes is what one rank sends each peer (its
  shard, or one partial), scale_bytes the row scales an FP8 all_gather_matmul shard carries.
  The native module's layout (xla_ffi/ffi/workspace_layout.h), the one its handlers check."""
  return int(_ext.group_workspace_bytes(op, tp, item_bytes, scale_bytes))


def slot_word(host: int, slot: int) -> int:
  """The int32 naming host slot `slot` of host `host` in a rank operand (the native module's
  encoding, xla_ffi/runtime/runtime.h)."""
  return int(_ext.slot_word(host, slot))


@functools.cache
def _gpu_devices() -> tuple:
  try:
    # Local only: under jax.distributed, jax.devices() also lists other processes' GPUs.
    return tuple(jax.local_devices(backend="gpu"))
  except RuntimeError:
    return ()


def local_gpus() -> tuple:
  """This process's GPUs (under jax.distributed, not the other processes')."""
  return _gpu_devices()


def has_cuda() -> bool:
  """True for a CUDA build of jaxflux with at least one CUDA GPU visible. (Whether the fused
  kernels can run on these GPUs, Hopper only, is `ops._platform.platform_reason`'s question.)"""
  return cuda_built() and len(_gpu_devices()) > 0


@functools.cache
def sm_count() -> int:
  """Streaming multiprocessors of this process's first GPU (lowest CUDA ordinal), as the
  kernels' grids see them; 0 without a CUDA build and GPU, or where it can't be read."""
  if not has_cuda():
    return 0
  return int(_ext.sm_count(_first_ordinal()))


def _first_ordinal() -> int:
  return min(d.local_hardware_id for d in _gpu_devices())


def gemm_workspace_bytes(dtype, m: int, n: int, k: int, attrs: dict) -> int:
  """Bytes of the workspace result a jaxflux_gemm call declares: [m, k] x [k, n], operand a of
  `dtype`, with `attrs` (the call's attributes). The same description the handler launches
  from; sized for this process's first GPU (the kernels size it by the SM count)."""
  return int(_ext.gemm_workspace_bytes(jax.numpy.dtype(dtype).name, m, n, k,
                                       device=_first_ordinal(), **attrs))


def grouped_gemm_workspace_bytes(dtype, m: int, n: int, k: int, groups: int, attrs: dict) -> int:
  """Bytes of the workspace result a jaxflux_grouped_gemm call declares (see
  gemm_workspace_bytes): a [m, k], `groups` groups, the output's n, with `attrs`."""
  return int(_ext.grouped_gemm_workspace_bytes(jax.numpy.dtype(dtype).name, m, n, k, groups,
                                               device=_first_ordinal(), **attrs))


def host_executions() -> dict:
  """Times the host ran the execute stage of the tp=1 targets (jaxflux_gemm,
  jaxflux_grouped_gemm) in this process. A call XLA captured into a command buffer would run on
  the host only when recorded, not when its graph is replayed (they are not declared
  compatible: docs/design.md, "Command buffers")."""
  return dict(_ext.host_executions()) if cuda_built() else {}


def gpu_compute_capabilities() -> set[str]:
  """The compute capabilities ("9.0", ...) of this process's GPUs, as JAX reports them (GPUs
  that don't report one are left out)."""
  return {str(cc) for d in _gpu_devices()
          if (cc := getattr(d, "compute_capability", None)) is not None}


def configure(*, timeout_s: float | None = None, workspace_bytes: int | None = None,
              sync_errors: bool | None = None) -> None:
  """Sets global runtime options.

  Args:
    timeout_s: how long a GPU spin-wait on a peer may last before the op fails with an error
      naming the op, rank and peer (default 30 s).
    workspace_bytes: the least symmetric workspace per GPU a fused call uses (default: what
      the call's shapes need). The workspace is one arena per power-of-two size class; with
      the largest need given here every call uses one arena. Set it before tracing: it is
      part of the traced program.
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


@functools.cache
def register_targets() -> frozenset:
  """Registers the FFI state types and targets with XLA once; returns the usable target names.

  The communicating targets keep their ranks in XLA FFI state, which needs
  `jax.ffi.register_ffi_type`; where that is missing or refused they are left out and
  `target_name` says why.
  """
  if not has_cuda():
    return frozenset()
  _push_settings()
  global _state_error
  names = set()
  for name, registration in _ext.type_registrations().items():
    try:
      jax.ffi.register_ffi_type(name, registration, platform="CUDA")
    except Exception as e:  # noqa: BLE001 - jaxlib without FFI state types
      _state_error = f"{type(e).__name__}: {e}"
  for name, target in _ext.registrations().items():
    if isinstance(target, dict) and _state_error is not None:
      continue
    jax.ffi.register_ffi_target(name, target, platform="CUDA", api_version=1)
    names.add(name)
  return frozenset(names)


_state_error: str | None = None


def target_name(op: str) -> str:
  """The FFI target of the communicating op `op`, registered."""
  names = register_targets()
  target = f"jaxflux_{op}"
  if target in names:
    return target
  if not names:
    raise RuntimeError(f"jaxflux: no FFI target for {op}: the extension was built without CUDA "
                       "or no GPU is visible (jaxflux.has_cuda() is False).")
  raise RuntimeError(f"jaxflux: the FFI target {target} keeps its ranks in XLA FFI state, and "
                     f"this jaxlib refused the state type ({_state_error}); install a jax and "
                     "jaxlib with jax.ffi.register_ffi_type.")


def ensure_workspace(nbytes: int) -> int:
  """Makes every local GPU hold the arena of the size class that `nbytes` falls in; returns the
  class (workspace_class), which the traced call names.

  Called at trace time, before the program runs. An arena, once allocated, stays until exit.
  With one process per GPU, a new class's arenas are then exchanged with the host's other
  processes (CUDA IPC).
  """
  ordinals = sorted(d.local_hardware_id for d in _gpu_devices())
  size_class = workspace_class(nbytes)
  with _lock:
    if multi_process():
      _ensure_host_slots()
    _ext.ensure_workspace(ordinals, size_class)
    if multi_process():
      _exchange_workspace(size_class, ordinals)
    return size_class


# --------------------------------------------------------------------------------------------
# One process per GPU (jax.distributed): host slots and the CUDA IPC workspace exchange, through
# the key-value store of JAX's coordination service. Every process traces the same program, so
# every process reaches each exchange; one that does not makes the others fail after timeout_s.

def multi_process() -> bool:
  return jax.process_count() > 1


@dataclasses.dataclass(frozen=True)
class HostSlots:
  host: int                  # index of this process's host among the job's hosts
  slots: dict                # this process's CUDA ordinal -> host slot
  total: int                 # GPUs on this host, all processes together
  host_of_process: dict      # process index -> host index
  first_slot_of_process: dict  # process index -> host slot of its first (lowest-ordinal) GPU
  ranks_per_gpu: int = 1     # the most processes driving one GPU, job-wide (ranks_per_gpu())

  def slot_word(self, device) -> int:
    """The slot word of any GPU of the job (what jaxflux_device_slot writes on it)."""
    p = device.process_index
    # A process's GPUs take its slots in CUDA ordinal order (_ensure_host_slots); with one GPU
    # per process (the supported layout) the order is moot.
    order = lambda d: (d.local_hardware_id is None, d.local_hardware_id or 0, d.id)  # noqa: E731
    peers = sorted((d for d in jax.devices() if d.process_index == p), key=order)
    return slot_word(self.host_of_process[p],
                     self.first_slot_of_process[p] + [d.id for d in peers].index(device.id))


_host_slots: HostSlots | None = None
_exchanged: set = set()


def assign_host_slots(records: dict) -> tuple[dict, dict, dict]:
  """Host slots from every process's (host identity, local GPU count): returns (process -> host
  index, process -> its first slot, host index -> GPUs on it). Hosts are numbered by their lowest
  process index; on a host, processes take consecutive slots in process order."""
  hosts: list = []
  for pid in sorted(records):
    if records[pid][0] not in hosts:
      hosts.append(records[pid][0])
  host_of, first, total = {}, {}, {h: 0 for h in range(len(hosts))}
  for pid in sorted(records):
    host_of[pid] = hosts.index(records[pid][0])
    first[pid] = total[host_of[pid]]
    total[host_of[pid]] += records[pid][1]
  return host_of, first, total


def most_processes_on_one_gpu(records: dict) -> int:
  """The most processes that drive one GPU (host identity, CUDA ordinal), from every process's
  host record (identity, GPU count, ordinals): 1 with one process per GPU."""
  counts = collections.Counter((r[0], o) for r in records.values() for o in r[2])
  return max(counts.values(), default=1)


def ranks_per_gpu() -> int:
  """1, unless processes of this job share a GPU (as the shared-GPU tests run 2-8 ranks on one):
  then the most processes driving one GPU. Every process gets the same answer."""
  if not multi_process():
    return 1
  return host_slots().ranks_per_gpu


def _host_identity() -> str:
  boot_id = ""
  try:  # containers on one machine share the boot id; different machines do not
    with open("/proc/sys/kernel/random/boot_id") as f:
      boot_id = f.read().strip()
  except OSError:
    pass
  return f"{socket.gethostname()}/{boot_id}"


def _kv():
  from jax._src import distributed  # the coordination service client jax.distributed started
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("jaxflux: jax.process_count() > 1 but jax.distributed has no client; "
                       "call jax.distributed.initialize() before using the fused ops.")
  return client


def _kv_get(client, key: str, what: str) -> str:
  try:
    return client.blocking_key_value_get(key, int(_settings.timeout_s * 1000))
  except Exception as e:  # noqa: BLE001 - the client raises its own error types
    raise RuntimeError(
        f"jaxflux: {what} did not arrive within {_settings.timeout_s:g} s (key {key!r}). Every "
        "process must trace the same jaxflux ops in the same order (SPMD); raise the limit with "
        f"jaxflux.configure(timeout_s=...) if a peer is merely slow. ({type(e).__name__}: {e})"
    ) from e


def host_slots() -> HostSlots:
  """This process's host slots, agreed with every other process at the first call."""
  with _lock:
    return _ensure_host_slots()


_published: dict = {}


def published(name: str, value: str) -> dict:
  """Every process's `value` for `name` (process index -> value), this process's published once
  (later calls return what was agreed). Under jax.distributed only."""
  with _lock:
    if name not in _published:
      _published[name] = _every_process(_kv(), name, value, name)
    return _published[name]


def _every_process(client, name: str, value: str, what: str) -> dict:
  """Publishes this process's `value` under jaxflux/<name>/<process> and returns every
  process's (process index -> value), waiting (bounded) for each."""
  client.key_value_set(f"jaxflux/{name}/{jax.process_index()}", value)
  return {pid: _kv_get(client, f"jaxflux/{name}/{pid}", f"process {pid}'s {what}")
          for pid in range(jax.process_count())}


def _ensure_host_slots() -> HostSlots:
  global _host_slots
  if _host_slots is not None:
    return _host_slots
  client, me = _kv(), jax.process_index()
  ordinals = sorted(d.local_hardware_id for d in _gpu_devices())
  mine = json.dumps([_host_identity(), len(ordinals), ordinals])
  records = {pid: tuple(json.loads(text))
             for pid, text in _every_process(client, "hosts", mine, "host record").items()}
  host_of_process, first, totals = assign_host_slots(records)
  host = host_of_process[me]
  if totals[host] > _ext.max_devices():
    raise RuntimeError(f"jaxflux: {totals[host]} GPUs on one host; the runtime supports "
                       f"{_ext.max_devices()}.")
  slots = {o: first[me] + i for i, o in enumerate(ordinals)}
  for ordinal, slot in slots.items():
    _ext.set_slot(ordinal, slot)
  _ext.set_host_index(host)
  _host_slots = HostSlots(host, slots, totals[host], host_of_process, first,
                          most_processes_on_one_gpu(records))
  return _host_slots


def _exchange_workspace(size_class: int, ordinals: list) -> None:
  """Publishes this process's arena of `size_class` (and flag arrays) and maps every other GPU
  of the host (CUDA IPC). Once per class."""
  if size_class in _exchanged:
    return
  hs, client = _host_slots, _kv()
  key = lambda slot: f"jaxflux/ws/{size_class}/{hs.host}/{slot}"  # noqa: E731
  for ordinal in ordinals:
    client.key_value_set(key(hs.slots[ordinal]), _ext.export_device(size_class, ordinal).hex())
  if not _exchanged:
    atexit.register(_ext.close_imported_peers)
  mine = set(hs.slots.values())
  for slot in range(hs.total):
    if slot not in mine:
      handles = _kv_get(client, key(slot), f"the workspace (size class {size_class}) of host "
                                           f"slot {slot}")
      _ext.import_peer(size_class, slot, bytes.fromhex(handles), ordinals[0])
  _exchanged.add(size_class)


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
