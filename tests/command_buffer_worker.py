"""Runs a decode-step-like program of the tp=1 kernels (the decode GEMM, CUTLASS's GEMM, the
grouped GEMM and its backward) on one GPU and prints, as JSON, each target's calls per run (from
the compiled HLO), how many times the host ran their execute stage over RUNS runs after a
warm-up, the digests of the runs' output bytes, and how many compilations JAX's persistent
cache served. Run under different XLA_FLAGS by test_command_buffers_gpu.py (XLA reads them once
per process), and twice on one cache directory by test_compilation_cache_gpu.py."""
import hashlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxflux
from jaxflux import _runtime
from jaxflux.ops.gemm import gemm
import hlo_util

TARGETS = ("jaxflux_gemm", "jaxflux_grouped_gemm")
RUNS = 5


def step(x, w1, w2, wg, group_sizes):
  h = jax.nn.gelu(gemm(x, w1, kernel="matmul_all_reduce"))  # few rows: the decode GEMM
  y = gemm(h, w2, kernel="cutlass") + x

  def loss(y, wg):  # the grouped GEMM's backward: two more grouped calls (dx and dw)
    z = jaxflux.grouped_matmul(y, wg, group_sizes, impl="fused")
    return jnp.tanh(z).astype(jnp.float32).sum()

  return jax.value_and_grad(loss, argnums=(0, 1))(y, wg)


def main() -> None:
  cache_hits = []
  jax.monitoring.register_event_listener(
      lambda event, **kwargs: cache_hits.append(event)
      if event == "/jax/compilation_cache/cache_hits" else None)
  rows, hidden, ffn, groups = 16, 1024, 2048, 4
  keys = jax.random.split(jax.random.key(int(sys.argv[1])), 4)
  x = jax.random.normal(keys[0], (rows, hidden), jnp.bfloat16)
  w1 = (jax.random.normal(keys[1], (hidden, ffn)) / hidden**0.5).astype(jnp.bfloat16)
  w2 = (jax.random.normal(keys[2], (ffn, hidden)) / ffn**0.5).astype(jnp.bfloat16)
  wg = (jax.random.normal(keys[3], (groups, hidden, hidden)) / hidden**0.5).astype(jnp.bfloat16)
  group_sizes = jnp.array([5, 0, 8, 3], jnp.int32)
  f = jax.jit(step)
  calls = hlo_util.custom_call_targets(f.lower(x, w1, w2, wg, group_sizes).compile().as_text())
  jax.block_until_ready(f(x, w1, w2, wg, group_sizes))
  before = _runtime.host_executions()
  digests = set()
  for _ in range(RUNS):
    # Each run's outputs are freed before the next, so that the allocator hands XLA the same
    # buffers: a command buffer replays while its buffers stay put, and XLA records it again
    # (running the handlers on the host) when they move.
    digests.add(hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in jax.tree.leaves(
        f(x, w1, w2, wg, group_sizes)))).hexdigest())
  after = _runtime.host_executions()
  print(json.dumps({"runs": RUNS, "calls_per_run": {t: calls.get(t, 0) for t in TARGETS},
                    "host_executions": {t: after[t] - before[t] for t in TARGETS},
                    "digests": sorted(digests), "cache_hits": len(cache_hits)}))


if __name__ == "__main__":
  main()
