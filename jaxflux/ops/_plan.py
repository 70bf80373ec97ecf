"""One op call, validated once into a `Plan`: the argument checks, the FP8 scales normalized to
rows and columns, the output dtype, the implementation resolved (_dispatch) and, for the fused
kernel, its configuration chosen from this GPU's tables (_config). The op then
runs the plan: the custom_vjp (_differentiable) or the forward-only FP8 call (_fp8), whose
forward is the fused call (_fused, tp=1 included) or the XLA reference.

Every check runs at trace time and raises ValueError/TypeError naming the argument, the shapes
seen and the fix, so mistakes surface where the user wrote them, not inside XLA.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad, partial_eval as pe

from jaxflux.ops import _common, _config, _dispatch

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
_F32 = jnp.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Plan:
  """What an op call settled before running; hashable, as a custom_vjp's nondiff argument."""
  op: str
  axis_name: str
  tp: int
  impl: str             # as asked ("auto" | "fused" | "xla"); the backward's partner op takes it
  kernel: str           # "fused" | "xla", resolved once
  out_dtype: np.dtype   # the result's dtype
  precision: Any        # lax.Precision for the XLA path
  transpose_w: bool     # w given as [N, K]
  return_gathered: bool = False
  fp8: bool = False
  config: Any = None    # the fused kernel's configuration (tuning.Tuned, _config); None: XLA


def plan(op: str, x, w, axis_name, *, impl: str, preferred_element_type, precision,
         transpose_w, return_gathered=False, x_scale=None, w_scale=None) -> tuple[Plan, tuple]:
  """(plan, scales) for a call of `op` on per-device x and w inside shard_map. scales is (x's
  float32 row scales [..., rows, 1], w's float32 column scales [1, N]) for FP8 operands, else
  ()."""
  refuse_forward_mode(op, x, w, x_scale, w_scale)
  check_impl(op, impl)
  transpose_w = static_bool(op, "transpose_w", transpose_w)
  return_gathered = bool(return_gathered)
  check_operands(op, x, w, transpose_w=transpose_w)
  tp = axis_size(op, axis_name)
  if op == "matmul_reduce_scatter" and x.shape[-2] % tp:
    raise ValueError(
        f"{op}: the token axis of x (axis -2, size {x.shape[-2]}, x.shape={x.shape}) must divide "
        f"by the size of mesh axis {axis_name!r} (tp={tp}) to be scattered. Pad the tokens to a "
        f"multiple of {tp} or use a tp that divides {x.shape[-2]}.")
  fp8 = fp8_operands(op, x, w, x_scale, w_scale)
  scales = _fp8_scales(op, x, w, x_scale, w_scale, transpose_w) if fp8 else ()
  out_dtype = _out_dtype(op, x, w, preferred_element_type, fp8)
  kernel = _dispatch.resolve(op, impl, x, w, out_dtype=out_dtype, tp=tp, axis_name=axis_name,
                             transpose_w=transpose_w, fp8=fp8)
  return Plan(op, axis_name, tp, impl, kernel, out_dtype, precision, transpose_w,
              return_gathered, fp8, _kernel_config(kernel, op, x, w, tp, transpose_w,
                                                   out_dtype)), scales


def partner(forward: Plan, op: str, x, w, *, out_dtype, transpose_w: bool,
            return_gathered: bool = False) -> Plan:
  """The plan of the op a backward runs (checked operands of its own making): the forward's
  impl and precision, the implementation resolved anew for the backward's shapes."""
  kernel = _dispatch.resolve(op, forward.impl, x, w, out_dtype=jnp.dtype(out_dtype),
                             tp=forward.tp, axis_name=forward.axis_name, transpose_w=transpose_w,
                             fp8=False)
  return Plan(op, forward.axis_name, forward.tp, forward.impl, kernel, jnp.dtype(out_dtype),
              forward.precision, transpose_w, return_gathered, False,
              _kernel_config(kernel, op, x, w, forward.tp, transpose_w, out_dtype))


def _kernel_config(kernel: str, op: str, x, w, tp: int, transpose_w: bool, out_dtype):
  """The fused kernel's configuration, chosen once here; None for the XLA path."""
  if kernel != "fused":
    return None
  return _config.choose(op, x, w, tp=tp, transpose_w=transpose_w, out_dtype=out_dtype)


# --- checks ----------------------------------------------------------------------------------

def refuse_forward_mode(op: str, *operands) -> None:
  """Raises a TypeError naming `op` when an operand carries a forward-mode tangent (jax.jvp,
  jax.jacfwd, and jax.hessian's outer jacfwd, whose tangents reach a custom_vjp's fwd rule). A
  custom_vjp has reverse mode only. Under jit JAX says so itself for a plain jvp, but under an
  eager shard_map its error path fails first, with an unrelated `unhashable type` TypeError,
  and forward-over-reverse fails deeper, in the backward's partner op, without naming it."""
  # Reverse mode without direct linearization (jax_use_direct_linearize=False) also runs
  # through jvp tracers, whose tangents are then unknown values of a partial evaluation.
  if any(isinstance(o, ad.JVPTracer) and not isinstance(o.tangent, pe.JaxprTracer)
         for o in operands):
    raise TypeError(
        f"jaxflux.{op}: can't apply forward-mode autodiff (jvp) to it: like any "
        "jax.custom_vjp it is differentiable in reverse mode only. Use jax.grad, jax.vjp or "
        "jax.jacrev instead of jax.jvp or jax.jacfwd (for second derivatives, "
        "jax.jacrev(jax.jacrev(f)) instead of jax.hessian(f)).")


def check_impl(op: str, impl: str) -> None:
  if impl not in _common.IMPLS:
    raise ValueError(f"{op}: impl={impl!r} is not one of {_common.IMPLS}. Use 'auto' to let "
                     "jaxflux pick, 'fused' to require the fused GPU kernel, or 'xla' for the "
                     "pure-JAX reference.")


def static_bool(op: str, name: str, value) -> bool:
  """A static flag (it picks the traced program): a Python bool, not an array."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{op}: {name} must be a Python bool (a static choice of layout or outputs); "
                    f"got {value!r} of type {type(value).__name__}. Pass True or False.")
  return bool(value)


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


def _out_dtype(op: str, x, w, preferred_element_type, fp8: bool):
  """preferred_element_type, by default the promoted input dtype (bfloat16 for FP8)."""
  if preferred_element_type is not None:
    dtype = jnp.dtype(preferred_element_type)
    if fp8 and not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(f"{op}: preferred_element_type={dtype} is not a floating dtype; an FP8 "
                      "call writes bfloat16 by default (pass jnp.bfloat16 or jnp.float32).")
    return dtype
  return _common.FP8_OUT_DTYPE if fp8 else jnp.result_type(x.dtype, w.dtype)


# --- FP8 operands ----------------------------------------------------------------------------

def fp8_operands(op: str, x, w, x_scale, w_scale) -> bool:
  """True when x and w are FP8 (then the scales are checked by `_fp8_scales`); False for a call
  without FP8 and without scales. Raises TypeError for a 1-byte float other than the two FP8
  formats, for one FP8 operand without the other, and for a scale without FP8 operands."""
  for name, a in (("x", x), ("w", w)):
    if _common.is_narrow_float(a.dtype) and not _common.is_fp8(a.dtype):
      raise TypeError(
          f"{op}: {name}.dtype={a.dtype} is not an FP8 format jaxflux takes; the ops take "
          f"float8_e4m3fn and float8_e5m2 (with x_scale and w_scale). Quantize {name} to one of "
          "them.")
  x_fp8, w_fp8 = _common.is_fp8(x.dtype), _common.is_fp8(w.dtype)
  if x_fp8 != w_fp8:
    fp8, other = ("x", "w") if x_fp8 else ("w", "x")
    raise TypeError(
        f"{op}: x.dtype={x.dtype} and w.dtype={w.dtype}: {fp8} is FP8 and {other} is not. "
        "Both operands are FP8 (each float8_e4m3fn or float8_e5m2, with x_scale and w_scale) or "
        f"neither: quantize {other} to FP8 as well, or pass {fp8} in a wider dtype.")
  if not x_fp8:
    for name, scale in (("x_scale", x_scale), ("w_scale", w_scale)):
      if scale is not None:
        raise TypeError(
            f"{op}: {name} was given, but x.dtype={x.dtype} and w.dtype={w.dtype} are not FP8; "
            f"scales apply to float8 operands only. Drop {name}, or pass x and w quantized to "
            "float8_e4m3fn / float8_e5m2.")
  return x_fp8


def _fp8_scales(op: str, x, w, x_scale, w_scale, transpose_w: bool) -> tuple:
  """(x_scale_rows float32 [..., rows, 1], w_scale_cols float32 [1, N]) from per-tensor or
  row-wise scales. A per-tensor x_scale is broadcast over x's rows, so that all_gather_matmul
  gathers it with x and each rank's own scale stays with its shard."""
  n = w.shape[0] if transpose_w else w.shape[1]
  rows = fp8_scale(op, "x_scale", "x", x, x_scale, tuple(x.shape[:-1]) + (1,),
                   "x.shape[:-1] + (1,), one per row of x")
  cols = fp8_scale(op, "w_scale", "w", w, w_scale, (1, n),
                   f"(1, N), one per output column (N = w.shape[{0 if transpose_w else 1}])")
  return rows, cols


def fp8_scale(op: str, name: str, operand: str, a, scale, per_row: tuple, per_row_what: str):
  accepted = f"() or (1,) (one scale for {operand}) or {per_row} = {per_row_what}"
  if scale is None:
    raise TypeError(
        f"{op}: {operand} is FP8 ({a.dtype}) and needs {name}, its dequantization scale "
        f"({operand} as float32 = {operand}.astype(float32) * {name}): a float32 array of shape "
        f"{accepted}.")
  dtype = getattr(scale, "dtype", None)
  if dtype is None or not hasattr(scale, "shape"):
    raise TypeError(f"{op}: {name} must be a float32 array; got {type(scale).__name__}. Pass "
                    f"jnp.asarray({name}, jnp.float32).")
  if jnp.dtype(dtype) != _F32:
    raise TypeError(f"{op}: {name}.dtype={dtype}; scales must be float32. Pass "
                    f"{name}.astype(jnp.float32).")
  shape = tuple(scale.shape)
  if shape in ((), (1,)):
    return jnp.broadcast_to(jnp.reshape(scale, ()), per_row)
  if shape == per_row:
    return scale
  raise ValueError(f"{op}: {name} has shape {shape}, which is neither accepted shape: {accepted} "
                   f"({operand}.shape={a.shape}).")
