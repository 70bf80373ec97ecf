"""Shared pieces of the ops: dtype facts, shard_map typing (vma) helpers and the reference
matmul helpers of the XLA path and the backward. Imports no op module."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

IMPLS = ("auto", "fused", "xla")
FUSED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# The FP8 formats the ops take (with scales): e4m3 for activations and weights, e5m2 for
# gradients, as in Flax's FP8 recipe. Other 1-byte floats are refused by name.
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
FP8_OUT_DTYPE = jnp.dtype(jnp.bfloat16)  # an FP8 call's default output dtype


def is_fp8(dtype) -> bool:
  return jnp.dtype(dtype) in FP8_DTYPES


def is_narrow_float(dtype) -> bool:
  """A floating dtype of one byte or less per element (any float8/float4 format)."""
  dtype = jnp.dtype(dtype)
  return jnp.issubdtype(dtype, jnp.inexact) and dtype.itemsize == 1


class FusedKernelUnavailableError(RuntimeError):
  """impl="fused" was requested where no fused kernel can run (never a silent fallback)."""


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


def weight_grad(lhs, dout, *, precision, dtype, transpose_w: bool = False):
  """Sum over all leading axes and rows of lhsᵀ·dout: lhs [..., r, K], dout [..., r, N] → [K, N];
  with transpose_w, laid out like a weight given transposed: [N, K]."""
  if transpose_w:
    lhs, dout = dout, lhs
  lead = tuple(range(lhs.ndim - 1))
  # Accumulated in float32 at least (float64 stays float64: the reference path's precision).
  dw = lax.dot_general(lhs, dout, ((lead, lead), ((), ())), precision=precision,
                       preferred_element_type=jnp.promote_types(dtype, jnp.float32))
  return dw.astype(dtype)


def match_vma(ct, primal):
  """`ct` typed exactly like its primal's varying mesh axes: a custom_vjp's cotangent must be.

  Inside shard_map a replicated (unvarying) operand used with varying data is implicitly
  broadcast (pvary); the transpose of that broadcast is a psum, which a custom_vjp must apply
  itself. A cotangent that varies along fewer axes than its primal (a GEMM-only FFI result
  comes back unvarying) is the same on every device of those axes, and is typed so.
  """
  return cast_to_vma(ct, vma(primal))


def cast_to_vma(ct, axes: frozenset):
  """`ct` summed over the mesh axes along which it varies outside `axes`, and marked varying
  along the axes of `axes` it does not vary along (match_vma for a primal known only by its
  vma)."""
  extra = tuple(sorted(vma(ct) - axes))
  if extra:
    ct = lax.psum(ct, extra)
  return mark_varying(ct, axes)


def mark_varying(a, axes):
  """Types `a` as varying along `axes` inside shard_map (FFI results come back unvarying; the
  fused ops' results vary like the XLA path's do). A no-op outside shard_map type checking."""
  missing = tuple(sorted(frozenset(axes) - vma(a)))
  if not missing:
    return a
  if hasattr(lax, "pcast"):  # jax >= 0.8
    return lax.pcast(a, missing, to="varying")
  return lax.pvary(a, missing)  # older jax


def stable_argsort(keys, axes=None):
  """(sorted keys, stable argsort indices) along the last axis of integer `keys`, the indices
  typed varying over `axes` (default: the shard_map axes `keys` varies over). jnp.argsort types
  them by its iota alone, as the same on every device, and a gather by such indices inside
  shard_map then gets wrong gradients."""
  iota = lax.broadcasted_iota(jnp.int32, keys.shape, keys.ndim - 1)
  iota = mark_varying(iota, vma(keys) if axes is None else axes)
  return lax.sort((keys.astype(jnp.int32), iota), dimension=keys.ndim - 1, num_keys=1,
                  is_stable=True)


def vma(a) -> frozenset:
  """Mesh axes along which `a` varies inside shard_map (empty outside, or with check_vma=False)."""
  aval = jax.typeof(a)
  if hasattr(aval, "vma"):  # jax releases that expose it directly
    return frozenset(aval.vma)
  manual = getattr(aval, "manual_axis_type", None)  # jax 0.10: ManualAxisType(varying=...)
  return frozenset(getattr(manual, "varying", ()) or ())
