"""The accuracy bar behind the fused FP8 GEMM+ReduceScatter's bfloat16 partials.

The fused op pushes each rank's partial product over the wire in bfloat16 (the output dtype) and
sums the tp partials with fp32 accumulation: at tp=2 the owner adds the peer's bf16 partial to its
own fp32 accumulator in the epilogue, elsewhere a pass sums every rank's bf16 partial. Float32
partials would cost twice the bytes on the wire. The bar: the result with bf16 partials stays
within 1.5x the relative Frobenius error of rounding the exact sum to bfloat16 once (what float32
partials give), measured here on FP8 products of the benchmark's kind (e4m3 operands, K split over
the ranks). Pure NumPy: the kernels' arithmetic (exact FP8 products, fp32 sums, bf16 roundings)
is emulated, not run.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

BAR = 1.5  # bf16 partials' error / one rounding's error


def _bf16(a: np.ndarray) -> np.ndarray:
  return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32),
                    np.float64)


def _rel(a: np.ndarray, exact: np.ndarray) -> float:
  return float(np.linalg.norm(a - exact) / np.linalg.norm(exact))


def _partials(tp: int, m: int, k: int, n: int, seed: int) -> np.ndarray:
  """[tp, m, n] exact partial products of e4m3 operands, K split over the ranks."""
  rng = np.random.default_rng(seed)
  x = np.asarray(jnp.asarray(rng.standard_normal((m, k)) * 8, jnp.float8_e4m3fn), np.float64)
  w = np.asarray(jnp.asarray(rng.standard_normal((k, n)) * 8, jnp.float8_e4m3fn), np.float64)
  kk = k // tp
  return np.stack([x[:, r * kk:(r + 1) * kk] @ w[r * kk:(r + 1) * kk] for r in range(tp)])


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_bf16_partials_stay_within_the_bar(tp):
  p = _partials(tp, m=256, k=4096, n=512, seed=tp)
  exact = p.sum(axis=0)
  once = _rel(_bf16(exact), exact)  # float32 partials: the fp32 sum, rounded once
  if tp == 2:  # the epilogue: own fp32 accumulator + the peer's bf16 partial, rounded once
    fused = _bf16(p[0].astype(np.float32) + _bf16(p[1]))
  else:  # the reduction pass: every partial in bf16, summed in fp32 in rank order
    acc = np.zeros_like(exact, dtype=np.float32)
    for r in range(tp):
      acc = acc + _bf16(p[r]).astype(np.float32)
    fused = _bf16(acc)
  err = _rel(fused, exact)
  print(f"tp={tp}: bf16 partials {err:.3e}, one rounding {once:.3e}, ratio {err / once:.2f}")
  assert err <= BAR * once, (err, once)


def test_the_bar_can_fail():
  """Partials rounded to e5m2 on the wire (2 mantissa bits) would miss it."""
  p = _partials(2, m=256, k=4096, n=512, seed=7)
  exact = p.sum(axis=0)
  once = _rel(_bf16(exact), exact)
  coarse = np.asarray(jnp.asarray(p[1], jnp.float32).astype(jnp.float8_e5m2), np.float64)
  assert _rel(_bf16(p[0] + coarse), exact) > BAR * once
