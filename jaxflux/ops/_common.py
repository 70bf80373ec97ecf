"""Shared pieces of the ops: argument checks, shard_map typing (vma) helpers and the reference
matmul helpers of the XLA path and the backward. Imports no op module.

Every check runs at trace time and raises ValueError/TypeError naming the argument, the shapes
seen and the fix, so mistakes surface where the user wrote them, not inside XLA.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
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


def check_impl(op: str, impl: str) -> None:
  if impl not in IMPLS:
    raise ValueError(f"{op}: impl={impl!r} is not one of {IMPLS}. Use 'auto' to let jaxflux pick, "
                     "'fused' to require the fused GPU kernel, or 'xla' for the pure-JAX reference.")


def check_operands(op: str, x, w, *, transpose_w: bool = False) -> None:
  """Rank, contraction size and dtype kind of x [..., rows, K] and w [K, N] (w [N, K] with
  transpose_w)."""
  if jnp.ndim(x) < 2:
    raise ValueError(f"{op}: x must have rank >= 2 ([..., tokens, K]); got shape {jnp.shape(x)}. "
                     "Add a token axis, e.g. x[None, :].")
  layout = "[N, K]" if transpose_w else "[K, N]"
  if jnp.ndim(w) != 2:
    raise ValueError(f"{op}: w must have rank 2 ({layout}); got shape {jnp.shape(w)}. Reshape the "
                     "weight to " + ("[out_features, in_features] (transpose_w=True)."
                                     if transpose_w else "[in_features, out_features]."))
  w_k = w.shape[1] if transpose_w else w.shape[0]
  if x.shape[-1] != w_k:
    seen = f"w.shape={w.shape}, transpose_w=True" if transpose_w else f"w.shape={w.shape}"
    fix = ("With transpose_w=True w is [N, K]; pass transpose_w=False if it is stored [K, N]."
           if transpose_w else "Pass w as [K, N] (transpose it if it is stored [N, K]).")
    raise ValueError(f"{op}: contraction sizes differ: x has K={x.shape[-1]} (x.shape={x.shape}) "
                     f"but w has K={w_k} ({seen}). {fix}")
  for name, a in (("x", x), ("w", w)):
    if not jnp.issubdtype(a.dtype, jnp.inexact):
      raise TypeError(f"{op}: {name} must be a floating-point array; got dtype {a.dtype}. "
                      f"Cast it, e.g. {name}.astype(jnp.bfloat16).")


def check_static_bool(op: str, name: str, value) -> bool:
  """A static flag (it picks the traced program): a Python bool, not an array."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{op}: {name} must be a Python bool (a static choice of layout or outputs); "
                    f"got {value!r} of type {type(value).__name__}. Pass True or False.")
  return bool(value)


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
  """Sums a cotangent over mesh axes along which its primal was not varying.

  Inside shard_map a replicated (unvarying) operand used with varying data is implicitly
  broadcast (pvary); the transpose of that broadcast is a psum, which a custom_vjp must apply
  itself so the cotangent has the primal's type.
  """
  return sum_to_vma(ct, vma(primal))


def sum_to_vma(ct, axes: frozenset):
  """`ct` summed over the mesh axes along which it varies outside `axes` (match_vma for a
  primal known only by its vma)."""
  extra = tuple(sorted(vma(ct) - axes))
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
