"""The kernel configuration of a fused call, chosen once from this GPU's tables (jaxflux.tuning)
and encoded as its FFI target's attributes (_attributes).

The plan of an op call (_plan) holds it, so the forward's fused call and the GEMM-only target
at tp=1 pass on one choice as they get it; a backward's partner plan chooses its own for its
shapes.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jaxflux import _runtime
from jaxflux.ops import _attributes
from jaxflux.tuning import chooser


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """A fused call's kernel: the table's choice and the attributes of the target that runs it
  (jaxflux_gemm at tp=1, the op's own target above), transpose_w included."""
  tuned: chooser.Tuned
  attributes: tuple  # ((name, int), ...), sorted: hashable, as a Plan must be

  @property
  def choice(self):
    return self.tuned.choice

  @property
  def transpose_w(self) -> bool:
    """The weight is given [N, K] and read K-major."""
    return bool(self.attrs()["transpose_w"])

  def attrs(self) -> dict:
    return dict(self.attributes)


def choose(op: str, x, w, *, tp: int, transpose_w: bool, out_dtype) -> KernelConfig:
  """The configuration of `op` on per-device x [..., m, K] and w [K, n] ([n, K] with
  transpose_w) at group size tp, writing out_dtype (the partials the ops push are in it). At
  tp=1 an op is its GEMM alone, tuned as GEMM+AllReduce tunes its GEMM (by rows)."""
  name = jnp.dtype(x.dtype).name
  n = w.shape[0] if transpose_w else w.shape[1]
  k = x.shape[-1]
  itemsize = jnp.dtype(out_dtype).itemsize
  batch, m = math.prod(x.shape[:-2]), x.shape[-2]
  if tp == 1:
    tuned = chooser.choose_tp1_gemm(dtype=name, rows=batch * m, k=k, n=n, itemsize=itemsize)
  elif op == "all_gather_matmul":
    tuned = chooser.choose_all_gather_matmul(dtype=name, tp=tp, rows=batch * tp * m, k=k, n=n,
                                            sms=_runtime.sm_count(), shard_rows=m)
  elif op == "matmul_reduce_scatter":
    tuned = chooser.choose_matmul_reduce_scatter(dtype=name, tp=tp, batch=batch, m=m // tp, k=k,
                                                n=n, itemsize=itemsize)
  else:
    tuned = chooser.choose_matmul_all_reduce(dtype=name, tp=tp, batch=batch, m=m, k=k, n=n,
                                            itemsize=itemsize)
  if tp > 1:
    tuned = _leave_sms_to_peers(tuned)
  # At tp=1 the op runs the GEMM-only target's kernel.
  attrs = _attributes.of_call(op if tp > 1 else "gemm", tuned.choice, shard_rows=m,
                              transpose_w=transpose_w)
  return KernelConfig(tuned, tuple(sorted(attrs.items())))


# SMs a fused GEMM leaves free where ranks share one GPU: a peer's push within one device is a
# copy kernel, which a GEMM holding every SM while it spins on that push would starve (one did,
# in a two-rank matrix run without the cap; 100 of an H100's 132 ran at tp 2, 4 and 8).
SHARED_GPU_FREE_SMS = 32


def _leave_sms_to_peers(tuned: chooser.Tuned) -> chooser.Tuned:
  """tuned, its grid capped at SMs - SHARED_GPU_FREE_SMS where processes share a GPU (every
  process caps alike: the rule reads the job-wide ranks_per_gpu)."""
  sms = _runtime.sm_count()
  if _runtime.ranks_per_gpu() <= 1 or sms <= SHARED_GPU_FREE_SMS:
    return tuned
  cap = sms - SHARED_GPU_FREE_SMS
  if 0 < tuned.choice.grid_sms <= cap:
    return tuned
  return tuned._replace(choice=dataclasses.replace(tuned.choice, grid_sms=cap))
