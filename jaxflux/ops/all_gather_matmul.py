"""AllGather+GEMM: y = all_gather(x, axis=-2) @ w, the column-parallel matmul of tensor parallelism.

Per-device view inside `jax.shard_map`:
  x      [..., m, K]      this device's token shard
  w      [K, n]           this device's column shard of the weight
  y      [..., tp*m, n]   all tokens, this device's output columns
  x_full [..., tp*m, K]   the gathered input (returned with return_gathered=True; the backward
                          pass reuses it for dW)

Backward (the pair closes under differentiation, so fused kernels serve both passes):
  dx = matmul_reduce_scatter(dy, wᵀ)       [..., m, K]
  dw = x_fullᵀ · dy                         [K, n]
The backward hands w over as is with transpose_w (the kernels read it K-major), so no transposed
copy of the weight is made; the partner op's backward does the same with its weight.
"""
from __future__ import annotations

import importlib
import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jaxflux.ops import _common


def all_gather_matmul(x, w, axis_name: str, *, return_gathered: bool = False, impl: str = "auto",
                      preferred_element_type=None, precision=None):
  """All-gathers `x` along its token axis (-2) over `axis_name`, then multiplies by `w`.

  Equivalent to `lax.all_gather(x, axis_name, axis=x.ndim - 2, tiled=True) @ w`, with the
  collective hidden inside the GEMM when the fused kernel runs. Call it inside `jax.shard_map`.

  Args:
    x: [..., m, K] local token shard; leading axes are batch.
    w: [K, n] local column shard of the weight.
    axis_name: the tensor-parallel mesh axis (size tp).
    return_gathered: also return x_full = the gathered x, [..., tp*m, K].
    impl: "auto" (fused kernel where it exists and the benchmark measured it ahead, else XLA),
      "fused" (the fused kernel or an error, never a silent fallback) or "xla" (pure-JAX
      reference). The fused kernel (Hopper GPUs, tp <= 8) takes bfloat16/float16 x and w of one
      dtype, K and N multiples of 8, and writes y in that dtype. Its backward computes dX with
      matmul_reduce_scatter(impl=impl).
    preferred_element_type: output dtype (accumulation is fp32 on the fused path); default is
      the promoted input dtype.
    precision: `lax.Precision` for the XLA path, as in `lax.dot_general` (the fused kernel always
      multiplies bf16/fp16 inputs with fp32 accumulation).

  Returns:
    y [..., tp*m, n], or (y, x_full) when return_gathered.
  """
  op = "all_gather_matmul"
  _common.check_impl(op, impl)
  _common.check_operands(op, x, w)
  _common.axis_size(op, axis_name)
  return apply(x, w, axis_name, bool(return_gathered), impl, preferred_element_type, precision,
               transpose_w=False)


def apply(x, w, axis_name, return_gathered, impl, preferred_element_type, precision, *,
          transpose_w):
  """all_gather_matmul of checked operands, by w or, with transpose_w, by wᵀ (w is then [n, K]:
  matmul_reduce_scatter's backward passes its forward weight so)."""
  _resolve(impl, x, w, preferred_element_type, axis_name, transpose_w)
  return _all_gather_matmul(x, w, axis_name, return_gathered, impl,
                            _common.static_dtype(preferred_element_type), precision, transpose_w)


# impl="auto" takes the fused kernel only where the benchmark measured it ahead of XLA unfused:
# on 2xH200 it won on every benchmark shape at M = 2048 and 8192 (1.02-1.27x,
# benchmarks/results/ag_gemm_gpu_tp2_fused_2026-11-30.json). Smaller M and other tp are not
# measured yet, so auto keeps XLA there.
AUTO_FUSED_TP = (2,)
AUTO_FUSED_MIN_ROWS = 2048  # gathered rows, tp * m (times batch)


def _auto_prefers_fused(x, w, tp: int) -> bool:
  """impl="auto": fused only inside the measured winning region (see AUTO_FUSED_*)."""
  del w
  rows = tp * (x.size // x.shape[-1])
  return tp in AUTO_FUSED_TP and rows >= AUTO_FUSED_MIN_ROWS


def _resolve(impl, x, w, preferred_element_type, axis_name, transpose_w=False) -> str:
  return _common.resolve_on_axis("all_gather_matmul", impl, x, w, preferred_element_type,
                                 axis_name, _auto_prefers_fused, transpose_w)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def _all_gather_matmul(x, w, axis_name, return_gathered, impl, preferred_element_type, precision,
                       transpose_w):
  y, x_full = _forward(x, w, axis_name, impl, preferred_element_type, precision, return_gathered,
                       transpose_w)
  return (y, x_full) if return_gathered else y


def _forward(x, w, axis_name, impl, preferred_element_type, precision, want_gathered,
             transpose_w):
  """(y, x_full); x_full is None when not wanted and the fused kernel runs."""
  if _resolve(impl, x, w, preferred_element_type, axis_name, transpose_w) == "fused":
    return _fused(x, w, axis_name, want_gathered, transpose_w=transpose_w)
  x_full = lax.all_gather(x, axis_name, axis=x.ndim - 2, tiled=True)
  y = _common.matmul(x_full, w, precision=precision,
                     preferred_element_type=preferred_element_type, transpose_w=transpose_w)
  return y, x_full


def _fused(x, w, axis_name, want_gathered, debug_skip_rank=-1, config=None, transpose_w=False):
  """The fused kernel (jaxflux_all_gather_matmul FFI target, xla_ffi/ffi/ag_gemm.cc).

  debug_skip_rank: test hook; that rank never signals its peers, so they time out.
  config: one of jaxflux.ops.gemm.AG_GEMM_CONFIGS (tests, tuning), None: the kernel chooses.
  transpose_w: w is [n, K] and the kernel multiplies by wᵀ, reading w K-major.
  """
  from jaxflux.ops import all_gather as all_gather_module  # rank_info lives with the runtime op
  from jaxflux.ops import gemm as gemm_module

  tp = lax.axis_size(axis_name)
  if tp == 1:  # nothing to gather
    y = gemm_module.gemm(x, w.T if transpose_w else w)
    return y, (x if want_gathered else None)
  shard_bytes = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
  m, k = x.shape[-2:]
  n = w.shape[0] if transpose_w else w.shape[1]
  out_types = [jax.ShapeDtypeStruct(x.shape[:-2] + (tp * m, n), x.dtype)]
  if want_gathered:
    out_types.append(jax.ShapeDtypeStruct(x.shape[:-2] + (tp * m, k), x.dtype))
  # The gathered A: two parities of tp shards each, every parity half slot-aligned.
  outs = all_gather_module.call_group_op(
      "all_gather_matmul", out_types, (x, w), axis_name,
      2 * all_gather_module.slot_bytes(tp * shard_bytes), debug_skip_rank=debug_skip_rank,
      config=gemm_module.config_index("all_gather_matmul", config), transpose_w=int(transpose_w))
  # Typed like the XLA path's results: varying along the gathered axis and wherever x, w vary.
  axes = _common.vma(x) | _common.vma(w) | {axis_name}
  outs = [_common.mark_varying(o, axes) for o in outs]
  return outs[0], (outs[1] if want_gathered else None)


def _fwd(x, w, axis_name, return_gathered, impl, preferred_element_type, precision, transpose_w):
  y, x_full = _forward(x, w, axis_name, impl, preferred_element_type, precision, True,
                       transpose_w)
  out = (y, x_full) if return_gathered else y
  # x itself is kept only for its type (varying mesh axes); x_full carries the values.
  return out, (x, x_full, w)


def _bwd(axis_name, return_gathered, impl, preferred_element_type, precision, transpose_w,
         residuals, ct):
  # The module (jaxflux.ops re-exports its function under the same name); imported here, as
  # the pair import each other.
  rs = importlib.import_module("jaxflux.ops.matmul_reduce_scatter")

  x, x_full, w = residuals
  dy, dx_full = ct if return_gathered else (ct, None)
  compute_dtype = _common.result_dtype(x, w, None)
  dy = dy.astype(compute_dtype)
  # dX = dy · W_effᵀ goes through GEMM+ReduceScatter (the fused pair serves both passes), with
  # the same w flipped: W_effᵀ is w itself when w came transposed, else w read K-major.
  dx = rs.apply(dy, w, axis_name, impl, x.dtype, precision, transpose_w=not transpose_w)
  if dx_full is not None:
    dx = dx + lax.psum_scatter(dx_full, axis_name, scatter_dimension=x.ndim - 2,
                               tiled=True).astype(x.dtype)
  # dW_eff = x_fullᵀ · dy; w holds its transpose when transpose_w.
  dw = (_common.weight_grad(dy, x_full, precision=precision, dtype=w.dtype) if transpose_w
        else _common.weight_grad(x_full, dy, precision=precision, dtype=w.dtype))
  return _common.match_vma(dx, x), _common.match_vma(dw, w)


_all_gather_matmul.defvjp(_fwd, _bwd)
