"""The fused FFI calls (jaxflux.ops._fused) with their kernel configuration chosen as an op's
plan chooses it, for tests that drive a fused target directly (a weight given K-major, a rank
that never signals) rather than through the op. The library itself always passes its plan's
configuration."""
from jax import lax

from jaxflux.ops import _config, _fused


def _config_for(op: str, x, w, axis_name: str, transpose_w: bool):
  return _config.choose(op, x, w, tp=lax.axis_size(axis_name), transpose_w=transpose_w,
                        out_dtype=x.dtype)


def all_gather_matmul(x, w, axis_name: str, want_gathered: bool, *, transpose_w: bool = False,
                      debug_skip_rank: int = -1):
  config = _config_for("all_gather_matmul", x, w, axis_name, transpose_w)
  return _fused.all_gather_matmul(x, w, axis_name, want_gathered, config=config,
                                  debug_skip_rank=debug_skip_rank)


def matmul_reduce_scatter(x, w, axis_name: str, *, transpose_w: bool = False,
                          debug_skip_rank: int = -1):
  config = _config_for("matmul_reduce_scatter", x, w, axis_name, transpose_w)
  return _fused.matmul_reduce_scatter(x, w, axis_name, config=config,
                                      debug_skip_rank=debug_skip_rank)


def matmul_all_reduce(x, w, axis_name: str, *, transpose_w: bool = False,
                      debug_skip_rank: int = -1):
  config = _config_for("matmul_all_reduce", x, w, axis_name, transpose_w)
  return _fused.matmul_all_reduce(x, w, axis_name, config=config,
                                  debug_skip_rank=debug_skip_rank)
