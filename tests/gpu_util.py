"""Helpers shared by the GPU tests of the fused kernels and their GEMM."""
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh

import jaxflux

# Relative Frobenius error allowed against a float32 reference.
TOL = {jnp.bfloat16: 1e-2, jnp.float16: 5e-3}
ROOT = pathlib.Path(__file__).resolve().parents[1]


def gpu_mesh() -> Mesh:
  """A 1-D ('tp',) mesh over every local GPU; skips the test with fewer than 2."""
  devices = jax.devices("gpu") if jaxflux.has_cuda() else []
  if len(devices) < 2:
    pytest.skip("needs at least 2 GPUs")
  return Mesh(np.asarray(devices), ("tp",))


def operands(seed, x_shape, w_shape, dtype, scale_w=True):
  """Fresh random x and w; scale_w divides w by sqrt(K) to keep outputs O(1)."""
  kx, kw = jax.random.split(jax.random.key(seed))
  w = jax.random.normal(kw, w_shape, jnp.float32)
  if scale_w:
    w = w / np.sqrt(w_shape[0])
  return jax.random.normal(kx, x_shape, jnp.float32).astype(dtype), w.astype(dtype)


def rel_err(got, want) -> float:
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def reference(x, w):
  """x @ w in float32 at the highest precision: the independent reference."""
  return jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32),
                    precision=lax.Precision.HIGHEST)


def bench_shapes(op: str) -> list:
  """pytest params (M, K, N) for every `op` shape of shapes.json at M in {1024, 8192}."""
  shapes = json.loads((ROOT / "benchmarks" / "shapes.json").read_text())[op]
  return [pytest.param(M, s["K"], s["N"], id=f"{s['name']}-M{M}") for s in shapes
          for M in (1024, 8192)]


def check_back_to_back(f, make, calls: int = 200, every: int = 17) -> None:
  """Calls f on `calls` fresh operand pairs make(i), back to back with no host sync between
  them, then checks every `every`-th result against the float32 reference (bf16 operands)."""
  inputs, outs = [], []
  for i in range(calls):
    x, w = make(jnp.int32(i))
    inputs.append((x, w))
    outs.append(f(x, w))
  for (x, w), y in zip(inputs[::every], outs[::every]):
    assert rel_err(y, reference(x, w)) <= TOL[jnp.bfloat16]


def check_matmul_grads(dx, dw, x, w, ct) -> None:
  """dX, dW of sum((x @ w) * ct), whatever the op then does with the product's rows, against
  float32 matmuls of the same bf16 operands."""
  dx_ref = jnp.matmul(ct, w.astype(jnp.float32).T, precision=lax.Precision.HIGHEST)
  dw_ref = jnp.matmul(x.astype(jnp.float32).T, ct, precision=lax.Precision.HIGHEST)
  assert rel_err(dx, dx_ref) <= TOL[jnp.bfloat16]
  assert rel_err(dw, dw_ref) <= TOL[jnp.bfloat16]
