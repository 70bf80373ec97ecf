"""Flax's FP8 recipe through the fused tensor-parallel ops, for
`jaxflux.Dense(..., tensor_parallel=..., dot_general_cls=nn.Fp8DirectDotGeneralOp)`.

The recipe is `flax.linen.fp8_ops.fp8_scaled_dot_general` (delayed scaling: each tensor is
quantized with a scale computed from the amax history of earlier steps, and this step's amax is
pushed into the history). `nn.Fp8DotGeneralOp` is the same math written as quantize-dequantize,
so one recipe serves both classes. The bookkeeping calls Flax's own public functions
(`update_fp8_meta`, `quantize`), so the six `_overwrite_with_gradient` variables update exactly
as under `flax.linen.Dense`; only the matmuls change: they run through
`jaxflux.all_gather_matmul` / `jaxflux.matmul_reduce_scatter` / `jaxflux.matmul_all_reduce`
with FP8 operands and scales.

Per device, inside the layer's shard_map (`_tensor_parallel.py`), one `jax.custom_vjp`:

  forward   s_x = scale from hist_x; q_x = e4m3(x / s_x)       (likewise s_k, q_k)
            column: y, x_full = all_gather_matmul(q_x, q_kᵀ, return_gathered=True)
            row:    y = matmul_reduce_scatter(q_x, q_kᵀ)
  backward  s_g from hist_g; q_g = e5m2(dy / s_g)
            column: dx = matmul_reduce_scatter(q_g, q_k);  dw = x_fullᵀ·q_g (local XLA dot)
            row:    dx, g_full = all_gather_matmul(q_g, q_k, return_gathered=True);
                    dw = q_xᵀ·g_full
  "gradients" of the six variables: their new values (as Flax's custom_vjps return them).

Every op call passes the weight with `transpose_w=True` (K-major, the layout FP8 GEMMs read):
the forward q_kᵀ [n, K] and the backward q_k [K, n] both come out of the one quantizing pass.
Without sequence parallelism (tokens replicated) a row layer's forward is
`matmul_all_reduce(q_x, q_kᵀ)`; the rest runs local XLA FP8 dots: a column layer's forward
needs no communication, a row layer's dX neither (dY arrives whole on every device), and a
column layer's partial dX is summed by a `lax.psum`, as the bfloat16 layer's backward does.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops
from jax import lax

from jaxflux import ops
from jaxflux.ops import _common

# The variables of Flax's Fp8DotGeneralBase (collection `_overwrite_with_gradient`), in the
# order the recipe takes them.
META_NAMES = ("input_scale", "kernel_scale", "output_grad_scale",
              "input_amax_history", "kernel_amax_history", "output_grad_amax_history")
SUPPORTED_CLASSES = (fp8_ops.Fp8DirectDotGeneralOp, fp8_ops.Fp8DotGeneralOp)
# Flax's recipe: e4m3 forward (inputs, kernel), e5m2 for the output gradient.
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)


def check_dot_general_cls(layer: str, mode: str, cls) -> None:
  """`cls` must be one of Flax's two FP8 dot_general classes (or a subclass keeping their
  e4m3fn / e5m2 formats): the only dot_general_cls a tensor-parallel layer can run."""
  head = f"{layer}(tensor_parallel={mode!r}, dot_general_cls={getattr(cls, '__name__', cls)!r})"
  fix = ("Pass dot_general_cls=nn.Fp8DirectDotGeneralOp (or nn.Fp8DotGeneralOp), or leave it "
         "None for the plain fused matmul, or use tensor_parallel=None to run any class "
         "through flax.linen.Dense's code.")
  if not isinstance(cls, type) or not issubclass(cls, SUPPORTED_CLASSES):
    raise ValueError(
      f"{head}: the only dot_general_cls a tensor-parallel layer runs is Flax's FP8 recipe "
      "(nn.Fp8DirectDotGeneralOp, nn.Fp8DotGeneralOp and their subclasses), through "
      f"jaxflux's fused FP8 matmuls. {fix}")
  formats = (jnp.dtype(cls.e4m3_dtype), jnp.dtype(cls.e5m2_dtype))
  if formats != (E4M3, E5M2):
    raise ValueError(
      f"{head}: its FP8 formats are e4m3_dtype={formats[0]}, e5m2_dtype={formats[1]}; the "
      f"fused FP8 matmuls take {E4M3} and {E5M2} (the formats of "
      f"nn.Fp8DirectDotGeneralOp). {fix}")


@dataclasses.dataclass(frozen=True)
class _Config:
  """What the custom_vjp needs besides arrays (hashable: its nondiff argument)."""
  mode: str
  sequence_parallel: bool
  axis_name: str
  impl: str
  # Mesh axes along which x and the kernel vary: the backward sums their cotangents over any
  # other axis that the computation made them vary along (the transpose of a broadcast).
  x_vma: frozenset
  kernel_vma: frozenset


def fp8_matmul(x: jax.Array, kernel: jax.Array, meta: tuple, *, mode: str,
               sequence_parallel: bool, axis_name: str, impl: str) -> jax.Array:
  """Per device (inside the layer's shard_map): `x @ kernel` by Flax's FP8 recipe.

  Args:
    x: the layer's local input (column: [..., m, K] token shard, or [..., T, K] without
      sequence parallelism; row: [..., M, k] feature shard).
    kernel: the local kernel [K, n] (column) or [k, N] (row), in the compute dtype.
    meta: the six variables' values, in META_NAMES order (replicated).

  Returns:
    y in the kernel's dtype (Flax's FP8 ops compute in it), laid out as the op of `mode`.
  """
  # Flax's FP8 ops cast the input to the kernel's dtype and compute in it.
  x = x.astype(kernel.dtype)
  config = _Config(mode, sequence_parallel, axis_name, impl, _common.vma(x),
                   _common.vma(kernel))
  return _fp8_matmul(config, x, kernel, *meta)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_matmul(config, x, kernel, s_x, s_k, s_g, h_x, h_k, h_g):
  del s_g, h_g  # the output gradient's, read by the backward only
  return _forward(config, x, kernel, s_x, s_k, h_x, h_k, want_residuals=False)[0]


def _fp8_fwd(config, x, kernel, s_x, s_k, s_g, h_x, h_k, h_g):
  y, saved, new_meta = _forward(config, x, kernel, s_x, s_k, h_x, h_k, want_residuals=True)
  return y, (saved, s_g, h_g, new_meta)


def _fp8_bwd(config, residuals, dy):
  (x_saved, q_k, x_scale, k_scale), s_g, h_g, (s_x, s_k, h_x, h_k) = residuals
  comp = dy.dtype
  s_g, h_g = _update_meta(dy, E5M2, s_g, h_g)
  q_g = fp8_ops.quantize(dy, E5M2, s_g, comp)
  g_scale = _dequantize_scale(s_g, comp)
  fp8 = dict(transpose_w=True, impl=config.impl, preferred_element_type=comp)
  if config.mode == "column" and config.sequence_parallel:
    # dX = reduce_scatter(q_g · q_kᵀ): q_k [K, n] is the weight [N, k] of that op, K-major.
    dx = ops.matmul_reduce_scatter(q_g, q_k, config.axis_name, x_scale=g_scale,
                                   w_scale=k_scale, **fp8)
    g_rows = q_g  # x_saved is the gathered x_full: its rows are q_g's
  elif config.mode == "row" and config.sequence_parallel:
    # dX = all_gather(q_g) · q_kᵀ: q_k [k, N] is the weight [n, K] of that op, K-major.
    dx, g_rows = ops.all_gather_matmul(q_g, q_k, config.axis_name, return_gathered=True,
                                       x_scale=g_scale, w_scale=k_scale, **fp8)
  else:
    # Without sequence parallelism: a row layer's dX is local (dY is whole on every device); a
    # column layer's is a partial sum, summed over the axis by the cast_to_vma below.
    dx = _scaled_dot(q_g, q_k, g_scale * k_scale, contract=(q_g.ndim - 1, 1), dtype=comp)
    g_rows = q_g
  # dW: a local FP8 dot of the saved (gathered) input and the gradient's rows, in float32.
  dw = (_common.weight_grad(x_saved, g_rows, precision=None, dtype=jnp.float32)
        * (x_scale * g_scale)).astype(comp)
  # Typed like x and the kernel: summed over the axes the computation broadcast them along (a
  # replicated operand's implicit pvary), marked varying where the ops' results were not.
  dx = _common.cast_to_vma(dx, config.x_vma)
  dw = _common.cast_to_vma(dw, config.kernel_vma)
  return dx, dw, s_x, s_k, s_g, h_x, h_k, h_g


_fp8_matmul.defvjp(_fp8_fwd, _fp8_bwd)


def _forward(config, x, kernel, s_x, s_k, h_x, h_k, *, want_residuals):
  """(y, residuals for the backward, the four new forward variables)."""
  comp = kernel.dtype
  s_x, h_x = _update_meta(x, E4M3, s_x, h_x)
  s_k, h_k = _update_meta(kernel, E4M3, s_k, h_k)
  q_x = fp8_ops.quantize(x, E4M3, s_x, comp)
  # One quantizing pass, both layouts: [K, n] for the backward, its transpose [n, K] (K-major,
  # with transpose_w) for the forward.
  q_k = fp8_ops.quantize(kernel, E4M3, s_k, comp)
  q_kt = q_k.T
  x_scale, k_scale = _dequantize_scale(s_x, comp), _dequantize_scale(s_k, comp)
  fp8 = dict(x_scale=x_scale, w_scale=k_scale, transpose_w=True, impl=config.impl,
             preferred_element_type=comp)
  x_saved = q_x
  if config.mode == "column" and config.sequence_parallel:
    if want_residuals:  # dW needs the gathered input, in FP8: the forward's own gather.
      y, x_saved = ops.all_gather_matmul(q_x, q_kt, config.axis_name, return_gathered=True,
                                         **fp8)
    else:
      y = ops.all_gather_matmul(q_x, q_kt, config.axis_name, **fp8)
  elif config.mode == "row" and config.sequence_parallel:
    y = ops.matmul_reduce_scatter(q_x, q_kt, config.axis_name, **fp8)
  elif config.mode == "row":  # each device holds a partial sum over its input features
    y = ops.matmul_all_reduce(q_x, q_kt, config.axis_name, **fp8)
  else:
    y = _scaled_dot(q_x, q_k, x_scale * k_scale, contract=(q_x.ndim - 1, 0), dtype=comp)
  return y, (x_saved, q_k, x_scale, k_scale), (s_x, s_k, h_x, h_k)


def _update_meta(a, fp8_dtype, scale, history):
  """Flax's `update_fp8_meta` with the amax of the whole (global) tensor.

  Flax takes `jnp.max(jnp.abs(a))` of the array it is given; here `a` is one device's shard,
  so the recipe takes the shard's amax, then `lax.pmax` over every manual mesh axis along which
  `a` varies (axes left automatic are still whole inside the shard_map, so jnp.max covers them),
  and hands Flax that global amax: its own max(abs(.)) of it changes nothing. The result is
  the same on every device (unvarying), as the variables' new values must be.
  """
  amax = jnp.max(jnp.abs(a))
  axes = tuple(sorted(_common.vma(amax)))
  if axes:
    amax = lax.pmax(amax, axes)
  return fp8_ops.update_fp8_meta(amax, fp8_dtype, scale, history)


def _dequantize_scale(scale, comp):
  """The float32 scale that undoes Flax's `quantize`, which divides by the scale cast to the
  compute dtype (a bfloat16 compute dtype rounds it): multiply by that same value."""
  return scale.astype(comp).astype(jnp.float32)


def _scaled_dot(a8, b8, scale, *, contract, dtype):
  """(a8 · b8 contracted over `contract` = (a's axis, b's axis)) * scale: a local FP8 dot,
  products accumulated in float32."""
  out = lax.dot_general(a8, b8, (((contract[0],), (contract[1],)), ((), ())),
                        preferred_element_type=jnp.float32)
  return (out * scale).astype(dtype)
