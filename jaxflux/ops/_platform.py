"""Why a fused kernel can't run here: the build and GPUs, the mesh (other axes, hosts) and the
operands. Each reason is a sentence for an error message, or None."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflux import _runtime, tuning
from jaxflux.ops import _common, _mesh


def fused_dtype_error(op: str, x, w) -> str | None:
  """The error impl="fused" raises for x/w dtypes no fused kernel takes, or None."""
  for name, a in (("x", x), ("w", w)):
    if a.dtype not in _common.FUSED_DTYPES:
      return (f"{op}(impl='fused'): {name}.dtype={a.dtype} is not supported by the fused kernel, "
              "which takes bfloat16 or float16 inputs (fp32 accumulation). Cast the inputs, or "
              "use impl='auto'/'xla'.")
  if x.dtype != w.dtype:
    return (f"{op}(impl='fused'): x.dtype={x.dtype} and w.dtype={w.dtype} differ; the fused "
            "kernel needs one input dtype. Cast one of them.")
  return None


def platform_reason(axis_name: str | None = None) -> str | None:
  """Why no fused GPU kernel can run in this process (for a communicating op: over the mesh
  axis `axis_name`), or None."""
  if not _runtime.cuda_built():
    return ("this jaxflux build has no CUDA kernels (installed where nvcc or a Hopper GPU was "
            "missing, or with JAXFLUX_CUDA=OFF); reinstall with the CUDA toolkit and "
            "JAXFLUX_CUDA=ON.")
  if not _runtime.has_cuda():
    return "no CUDA GPU is visible to JAX (jax.local_devices(backend='gpu') is empty)."
  others = sorted(_runtime.gpu_compute_capabilities() - {HOPPER_COMPUTE_CAPABILITY})
  if others:
    return (f"the fused kernels are built for Hopper GPUs (compute capability "
            f"{HOPPER_COMPUTE_CAPABILITY}, sm_90a); this process's GPUs are "
            f"{', '.join(others)}.")
  if axis_name is not None and (reason := non_manual_axis_reason(axis_name)) is not None:
    return reason
  if _runtime.multi_process():
    reason = multi_process_reason(len(_runtime.local_gpus()), _runtime.host_slots, axis_name)
    if reason is None and axis_name is not None:
      reason = tuning_agreement_reason(_runtime.host_slots().host_of_process,
                                       _runtime.published)
    return reason
  return None


HOPPER_COMPUTE_CAPABILITY = "9.0"  # the kernels' one target (cmake/cuda.cmake: sm_90a)


def non_manual_axis_reason(axis_name: str) -> str | None:
  """Why a communicating fused op over `axis_name` can't run in the current shard_map: another
  mesh axis of size > 1 is not manual there (an Auto axis GSPMD partitions), so the op can't
  tell its device groups apart. None when every other axis is manual, or of size 1."""
  for name, size, manual in _mesh.abstract_axes():
    if name != axis_name and not manual and size > 1:
      return (f"mesh axis {name!r} (size {size}) is not manual here, so the fused op cannot "
              "tell its device groups apart. Run it in a shard_map over every mesh axis of "
              "size > 1 (for jaxflux's layers: make the other axes Explicit), or use "
              "impl='xla'.")
  return None


def multi_process_reason(local_gpus: int, host_slots, axis_name: str | None = None,
                         mesh=None) -> str | None:
  """Under jax.distributed: why the fused kernels can't run across these processes (over mesh
  axis `axis_name`; None for a local op), or None. `host_slots()` agrees the host slots with
  the other processes (a key-value exchange), so it is only called once the cheap checks pass.
  `mesh`: the concrete mesh (default: the one of jax.set_mesh, if any)."""
  if local_gpus != 1:
    return (f"under jax.distributed the fused kernels need one GPU per process; this process "
            f"drives {local_gpus}. Start one process per GPU (examples/launch_multiprocess.py), "
            "or one process for all GPUs of a host.")
  if axis_name is None:
    return None
  slots = host_slots()
  num_hosts = len(set(slots.host_of_process.values()))
  if num_hosts == 1:
    return None
  if mesh is None:
    mesh = _mesh.concrete_mesh()
  if mesh is None or axis_name not in mesh.axis_names:
    return (f"this jax.distributed job spans {num_hosts} hosts, and the fused kernels need "
            f"every group along mesh axis {axis_name!r} on one host's NVLink; jaxflux checks "
            "that at trace time from the concrete mesh, which shard_map(mesh=...) alone does "
            "not show. Run the jitted function under `with jax.set_mesh(mesh):`.")
  return axis_hosts_reason(mesh, axis_name, lambda d: slots.host_of_process[d.process_index])


def tuning_agreement_reason(host_of_process: dict, published) -> str | None:
  """Why the processes of this host would choose different kernels for one fused call (their
  kernel tables differ), or None. published(name, value) -> every process's value."""
  me = jax.process_index()
  digests = published("tuning_tables", tuning.active_tables().digest)
  others = sorted(pid for pid, digest in digests.items()
                  if host_of_process[pid] == host_of_process[me] and digest != digests[me])
  if not others:
    return None
  return (f"the processes of this host read different kernel tables (process {me}: "
          f"{digests[me]}; processes {others} differ), and every rank of a fused op must "
          "choose the same kernels. Give every process the same tuning dir "
          "(JAXFLUX_TUNING_DIR) and GPU kind; `python -m jaxflux.tune --show` in each says "
          "which tables it reads.")


def axis_hosts_reason(mesh, axis_name: str, host_of_device) -> str | None:
  """Why the groups along `axis_name` of a concrete mesh don't each sit on one host, or None.
  `host_of_device(device) -> host index`."""
  by_id = {d.id: d for d in mesh.devices.flat}
  hosts_of_group: dict[int, dict[int, list[int]]] = {}
  for device_id, (_, group) in _mesh.expected_rank_info(mesh, axis_name).items():
    host = host_of_device(by_id[device_id])
    hosts_of_group.setdefault(group, {}).setdefault(host, []).append(device_id)
  for group, hosts in sorted(hosts_of_group.items()):
    if len(hosts) > 1:
      where = "; ".join(f"host {h}: devices {sorted(ids)}" for h, ids in sorted(hosts.items()))
      return (f"mesh axis {axis_name!r} (size {mesh.shape[axis_name]}) spans {len(hosts)} "
              f"hosts in group {group} ({where}); the fused kernels need each group along "
              f"{axis_name!r} on one host's NVLink. Order the mesh's devices so that the "
              f"{axis_name!r} axis runs over GPUs of one host (e.g. a ('dp', {axis_name!r}) "
              "mesh with one row per host), or use impl='xla'.")
  return None


def fused_reason(x, w, out_dtype, tp: int, group_axis: str | None) -> str | None:
  """Why no fused kernel runs these per-device operands (dtypes checked) here, or None.
  group_axis: the mesh axis a communicating call runs over (None at tp=1)."""
  return platform_reason(group_axis) or fused_operand_reason(x, w, out_dtype, tp)


def fused_fp8_reason(x, w, out_dtype, tp: int, group_axis: str | None,
                     transpose_w: bool) -> str | None:
  """Why no fused FP8 kernel runs these per-device operands here, or None."""
  return (fused_fp8_dtype_reason(x, w) or platform_reason(group_axis)
          or fused_fp8_operand_reason(x, w, out_dtype, tp, transpose_w))


def fused_operand_reason(x, w, out_dtype, tp: int) -> str | None:
  """Why no fused kernel takes these per-device operands at this group size writing
  `out_dtype`, or None (the kernels share the CUTLASS GEMM: 16-byte rows for TMA, output in the
  input dtype)."""
  if (reason := group_reason(tp)) is not None:
    return reason
  k, n = w.shape
  if k % 8 or n % 8:
    return (f"this device's w shard is [K, N] = [{k}, {n}]; the kernel needs K and N multiples "
            "of 8 (16-byte rows for its TMA loads). Pad the weight.")
  if (reason := _empty_reason(x, w)) is not None:
    return reason
  if jnp.dtype(out_dtype) != x.dtype:
    return (f"the kernel writes its output in the input dtype ({x.dtype}); "
            f"preferred_element_type={jnp.dtype(out_dtype)} is not supported by it yet.")
  return None


# The (x, w) dtype pairs the fused FP8 kernels take: e4m3 activations times e4m3 weights (the
# forward), e5m2 gradients times e4m3 weights (the backward's dX).
FUSED_FP8_PAIRS = ((_common.FP8_DTYPES[0], _common.FP8_DTYPES[0]),
                   (_common.FP8_DTYPES[1], _common.FP8_DTYPES[0]))


def fused_fp8_dtype_reason(x, w) -> str | None:
  """Why no fused FP8 kernel takes this (x.dtype, w.dtype) pair, or None."""
  if (jnp.dtype(x.dtype), jnp.dtype(w.dtype)) in FUSED_FP8_PAIRS:
    return None
  pairs = " and ".join(f"(x {a.name}, w {b.name})" for a, b in FUSED_FP8_PAIRS)
  return (f"the fused FP8 kernels take {pairs}; got x.dtype={x.dtype}, w.dtype={w.dtype}. "
          "Quantize the weight to float8_e4m3fn, or use impl='xla'.")


def fused_fp8_operand_reason(x, w, out_dtype, tp: int, transpose_w: bool) -> str | None:
  """Why no fused FP8 kernel takes these per-device operands at this group size, or None. `w`
  is the weight as given ([N, K] with transpose_w)."""
  if not transpose_w:
    return ("the FP8 kernels read the weight K-major: pass the weight's transpose, w as [N, K] "
            f"(here [{w.shape[1]}, {w.shape[0]}]), with transpose_w=True, and let the quantizing "
            "pass write it in that layout (transposing an FP8 weight per call costs a pass over "
            "it).")
  if (reason := group_reason(tp)) is not None:
    return reason
  n, k = w.shape
  if k % 16 or n % 16:
    return (f"this device's w shard is [N, K] = [{n}, {k}]; the FP8 kernels need K and N "
            "multiples of 16 (16-byte rows of 1-byte elements for their TMA loads). Pad the "
            "weight.")
  if (reason := _empty_reason(x, w)) is not None:
    return reason
  if jnp.dtype(out_dtype) != _common.FP8_OUT_DTYPE:
    return (f"the FP8 kernels write bfloat16; preferred_element_type={jnp.dtype(out_dtype)} is "
            "not supported by them. Pass preferred_element_type=jnp.bfloat16 (the FP8 default), "
            "or use impl='xla'.")
  return None


def group_reason(tp: int) -> str | None:
  """Why the fused kernels can't run a group of `tp` ranks (the native runtime's cap), or None."""
  cap = _runtime.max_ranks()
  if cap is not None and tp > cap:
    return (f"the tensor-parallel axis has size {tp}; the fused kernels support groups of up to "
            f"{cap} GPUs (one NVLink domain).")
  return None


def _empty_reason(x, w) -> str | None:
  if x.size == 0 or w.size == 0:
    return f"empty operands (x.shape={x.shape}, w.shape={w.shape}) have nothing to fuse."
  return None
