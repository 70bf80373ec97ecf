"""Shared pieces of the two tensor-parallel ops: argument checks, impl choice, VJP helpers.

Every check runs at trace time and raises ValueError/TypeError naming the argument, the shapes
seen and the fix, so mistakes surface where the user wrote them, not inside XLA.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxflux import _runtime

IMPLS = ("auto", "fused", "xla")
FUSED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class FusedKernelUnavailableError(RuntimeError):
  """impl="fused" was requested where no fused kernel can run (never a silent fallback)."""


def check_impl(op: str, impl: str) -> None:
  if impl not in IMPLS:
    raise ValueError(f"{op}: impl={impl!r} is not one of {IMPLS}. Use 'auto' to let jaxflux pick, "
                     "'fused' to require the fused GPU kernel, or 'xla' for the pure-JAX reference.")


def check_operands(op: str, x, w) -> None:
  """Rank, contraction size and dtype kind of x [..., rows, K] and w [K, N]."""
  if jnp.ndim(x) < 2:
    raise ValueError(f"{op}: x must have rank >= 2 ([..., tokens, K]); got shape {jnp.shape(x)}. "
                     "Add a token axis, e.g. x[None, :].")
  if jnp.ndim(w) != 2:
    raise ValueError(f"{op}: w must have rank 2 ([K, N]); got shape {jnp.shape(w)}. Reshape the "
                     "weight to [in_features, out_features].")
  if x.shape[-1] != w.shape[0]:
    raise ValueError(f"{op}: contraction sizes differ: x has K={x.shape[-1]} (x.shape={x.shape}) "
                     f"but w has K={w.shape[0]} (w.shape={w.shape}). Pass w as [K, N] (transpose "
                     "it if it is stored [N, K]).")
  for name, a in (("x", x), ("w", w)):
    if not jnp.issubdtype(a.dtype, jnp.inexact):
      raise TypeError(f"{op}: {name} must be a floating-point array; got dtype {a.dtype}. "
                      f"Cast it, e.g. {name}.astype(jnp.bfloat16).")


def axis_size(op: str, axis_name) -> int:
  """Size of the named mesh axis, with a helpful error when it is not bound."""
  if not isinstance(axis_name, str):
    raise TypeError(f"{op}: axis_name must be a single mesh axis name (str); got {axis_name!r}.")
  try:
    return lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"{op}: unknown axis_name={axis_name!r}: it is not a manual axis here. Call {op} inside "
        f"jax.shard_map over a mesh that has an axis named {axis_name!r} (or pass the name of "
        "your tensor-parallel axis).") from e


def resolve_impl(op: str, impl: str, x, w, fused_supported, auto_prefers_fused=None) -> str:
  """Picks "fused" or "xla". `fused_supported(x, w) -> str | None` says why fused can't run;
  `auto_prefers_fused(x, w) -> bool` is the measured policy of impl="auto" (default: fused
  wherever it can run)."""
  check_impl(op, impl)
  if impl == "xla":
    return "xla"
  if impl == "fused":
    dtype_error = _fused_dtype_error(op, x, w)
    if dtype_error is not None:
      raise TypeError(dtype_error)
    reason = fused_supported(x, w)
    if reason is not None:
      raise FusedKernelUnavailableError(f"{op}(impl='fused'): {reason} Use impl='auto' to fall "
                                        "back to XLA where the fused kernel cannot run.")
    return "fused"
  # auto: fused only where a kernel exists and measurements say it wins.
  if _fused_dtype_error(op, x, w) is not None or fused_supported(x, w) is not None:
    return "xla"
  if auto_prefers_fused is not None and not auto_prefers_fused(x, w):
    return "xla"
  return "fused"


def resolve_on_axis(op: str, impl: str, x, w, preferred_element_type, axis_name,
                    auto_prefers_fused, transpose_w: bool = False) -> str:
  """resolve_impl for a fused op inside shard_map: both fused kernels run where
  `fused_unsupported_reason` finds nothing; `auto_prefers_fused(x, w, tp)` is the op's own
  measured policy. With transpose_w, w is given as [N, K] and the rules see the [K, N] it
  stands for."""
  tp = lax.axis_size(axis_name)
  w = weight_for_checks(w, transpose_w)
  return resolve_impl(
      op, impl, x, w,
      lambda x, w: fused_unsupported_reason(x, w, preferred_element_type, tp, axis_name),
      auto_prefers_fused=lambda x, w: auto_prefers_fused(x, w, tp))


def fused_unsupported_reason(x, w, preferred_element_type, tp: int,
                             axis_name: str) -> str | None:
  """Why neither fused kernel can run on these per-device operands over `axis_name` here (the
  platform, then the operands), or None."""
  reason = platform_reason(axis_name)
  if reason is not None:
    return reason
  return fused_operand_reason(x, w, preferred_element_type, tp)


def _fused_dtype_error(op: str, x, w) -> str | None:
  """The error impl="fused" raises for x/w dtypes no fused kernel takes, or None."""
  for name, a in (("x", x), ("w", w)):
    if a.dtype not in FUSED_DTYPES:
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
    return ("this jaxflux build has no CUDA kernels (installed without nvcc, or with "
            "JAXFLUX_CUDA=OFF); reinstall on a machine with the CUDA toolkit.")
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
    return multi_process_reason(len(_runtime.local_gpus()), _runtime.host_slots, axis_name)
  return None


HOPPER_COMPUTE_CAPABILITY = "9.0"  # the kernels' one target (cmake/cuda.cmake: sm_90a)


def non_manual_axis_reason(axis_name: str) -> str | None:
  """Why a communicating fused op over `axis_name` can't run in the current shard_map: another
  mesh axis of size > 1 is not manual there (an Auto axis GSPMD partitions), so the op can't
  tell its device groups apart. None when every other axis is manual, or of size 1."""
  mesh = jax.sharding.get_abstract_mesh()
  names = tuple(getattr(mesh, "axis_names", ()) or ())
  manual = set(getattr(mesh, "manual_axes", names) or ())
  for name, size in zip(names, getattr(mesh, "axis_sizes", ()) or ()):
    if name != axis_name and name not in manual and size > 1:
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
    from jaxflux.ops import all_gather  # noqa: PLC0415 (all_gather imports this module)
    mesh = all_gather.concrete_mesh()
  if mesh is None or axis_name not in mesh.axis_names:
    return (f"this jax.distributed job spans {num_hosts} hosts, and the fused kernels need "
            f"every group along mesh axis {axis_name!r} on one host's NVLink; jaxflux checks "
            "that at trace time from the concrete mesh, which shard_map(mesh=...) alone does "
            "not show. Run the jitted function under `with jax.set_mesh(mesh):`.")
  return axis_hosts_reason(mesh, axis_name, lambda d: slots.host_of_process[d.process_index])


def axis_hosts_reason(mesh, axis_name: str, host_of_device) -> str | None:
  """Why the groups along `axis_name` of a concrete mesh don't each sit on one host, or None.
  `host_of_device(device) -> host index`."""
  from jaxflux.ops import all_gather  # noqa: PLC0415 (all_gather imports this module)
  by_id = {d.id: d for d in mesh.devices.flat}
  hosts_of_group: dict[int, dict[int, list[int]]] = {}
  for device_id, (_, group) in all_gather.expected_rank_info(mesh, axis_name).items():
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


MAX_FUSED_TP = 8  # one NVLink domain: the ranks' workspaces are peer-mapped in one process


def fused_operand_reason(x, w, preferred_element_type, tp: int) -> str | None:
  """Why neither fused kernel takes these per-device operands at this group size, or None (both
  kernels share the CUTLASS GEMM: 16-byte rows for TMA, output in the input dtype)."""
  if tp > MAX_FUSED_TP:
    return (f"the tensor-parallel axis has size {tp}; the fused kernels support groups of up to "
            f"{MAX_FUSED_TP} GPUs (one NVLink domain).")
  k, n = w.shape
  if k % 8 or n % 8:
    return (f"this device's w shard is [K, N] = [{k}, {n}]; the kernel needs K and N multiples "
            "of 8 (16-byte rows for its TMA loads). Pad the weight.")
  if x.size == 0 or w.size == 0:
    return f"empty operands (x.shape={x.shape}, w.shape={w.shape}) have nothing to fuse."
  out = result_dtype(x, w, preferred_element_type)
  if out != x.dtype:
    return (f"the kernel writes its output in the input dtype ({x.dtype}); "
            f"preferred_element_type={out} is not supported by it yet.")
  return None


def result_dtype(x, w, preferred_element_type):
  if preferred_element_type is None:
    return jnp.result_type(x.dtype, w.dtype)
  return jnp.dtype(preferred_element_type)


def matmul(x, w, *, precision, preferred_element_type, transpose_w=False):
  """x [..., r, K] @ w [K, N] with lax.dot_general semantics (what flax.linen.Dense computes);
  with transpose_w, w is [N, K] and the product x @ wᵀ (contracted in place, no transpose)."""
  return lax.dot_general(x, w, (((x.ndim - 1,), (1 if transpose_w else 0,)), ((), ())),
                         precision=precision, preferred_element_type=preferred_element_type)


def weight_for_checks(w, transpose_w: bool):
  """The weight an op multiplies by, for the checks that read its shape and dtype: w itself,
  or, when w is given transposed, an abstract [K, N] standing for wᵀ."""
  return jax.ShapeDtypeStruct(w.shape[::-1], w.dtype) if transpose_w else w


def weight_grad(lhs, dout, *, precision, dtype):
  """Sum over all leading axes and rows of lhsᵀ·dout: lhs [..., r, K], dout [..., r, N] → [K, N]."""
  lead = tuple(range(lhs.ndim - 1))
  # Accumulated in float32 at least (float64 stays float64: the reference path's precision).
  dw = lax.dot_general(lhs, dout, ((lead, lead), ((), ())), precision=precision,
                       preferred_element_type=jnp.promote_types(dtype, jnp.float32))
  return dw.astype(dtype)


def match_vma(ct, primal):
  """Sums a cotangent over mesh axes along which its primal was not varying.

  Inside shard_map a replicated (unvarying) operand used with varying data is implicitly
  broadcast (pvary); the transpose of that broadcast is a psum, which a custom_vjp must apply
  itself so the cotangent has the primal's type.
  """
  extra = tuple(sorted(vma(ct) - vma(primal)))
  return lax.psum(ct, extra) if extra else ct


def mark_varying(a, axes):
  """Types `a` as varying along `axes` inside shard_map (FFI results come back unvarying; the
  fused ops' results vary like the XLA path's do). A no-op outside shard_map type checking."""
  missing = tuple(sorted(frozenset(axes) - vma(a)))
  if not missing:
    return a
  if hasattr(lax, "pcast"):  # jax >= 0.8
    return lax.pcast(a, missing, to="varying")
  return lax.pvary(a, missing)  # older jax


def vma(a) -> frozenset:
  """Mesh axes along which `a` varies inside shard_map (empty outside, or with check_vma=False)."""
  aval = jax.typeof(a)
  if hasattr(aval, "vma"):  # jax releases that expose it directly
    return frozenset(aval.vma)
  manual = getattr(aval, "manual_axis_type", None)  # jax 0.10: ManualAxisType(varying=...)
  return frozenset(getattr(manual, "varying", ()) or ())


def static_dtype(dtype):
  """Hashable form of preferred_element_type for nondiff args."""
  return None if dtype is None else np.dtype(dtype)
