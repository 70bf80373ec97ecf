"""One process of a one-process-per-GPU jaxflux run (driven by tests/test_multiprocess_gpu.py).

    python tests/multiprocess_gpu_worker.py PORT NUM_PROCESSES PROCESS_ID MODE

Joins jax.distributed on 127.0.0.1:PORT driving GPU PROCESS_ID (every GPU stays visible, so that
CUDA IPC can map the peers' memory), then, on a ('tp',) mesh over all processes' GPUs:
  MODE=check: the fused all_gather_matmul and matmul_reduce_scatter against float32 NumPy,
    200 back-to-back calls with fresh data and no host sync, and gradients;
  MODE=die: one fused call, then process 1 exits at once and process 0 makes another call, which
    must fail with jaxflux's timeout error instead of hanging.
Prints `PASS <case>` per case and, last, `WORKER OK <process id>`.
"""
import os
import sys

import jax

PORT, NUM_PROCESSES, PROCESS_ID = map(int, sys.argv[1:4])
MODE = sys.argv[4]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{PORT}", num_processes=NUM_PROCESSES,
                           process_id=PROCESS_ID, local_device_ids=[PROCESS_ID],
                           coordinator_bind_address=f"127.0.0.1:{PORT}",
                           cluster_detection_method="deactivate", initialization_timeout=60)

print(f"joined: process {PROCESS_ID} of {NUM_PROCESSES}, devices {jax.devices()}", flush=True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxflux  # noqa: E402
from jaxflux import _runtime  # noqa: E402

mesh = Mesh(np.asarray(jax.devices()), ("tp",))
tp = mesh.size
failures = []


def global_array(host, spec):
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def check(name, got, want, tol=1e-2):
  """Compares the shards this process holds with the same slices of the reference."""
  worst = 0.0
  for shard in got.addressable_shards:
    g = np.asarray(shard.data, np.float64)
    w = np.asarray(want[shard.index], np.float64)
    worst = max(worst, float(np.linalg.norm(g - w) / np.linalg.norm(w)))
  if worst <= tol:
    print(f"PASS {name}", flush=True)
  else:
    failures.append(f"{name}: rel err {worst:.3g}")
    print(f"FAIL {name}: rel err {worst:.3g}", flush=True)


def operands(seed, m, k, n):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((m, k), np.float32)
  w = (rng.standard_normal((k, n), np.float32) / np.sqrt(k))
  bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
  return bf(x), bf(w)


def make_ag():
  return jax.jit(jax.shard_map(lambda x, w: jaxflux.all_gather_matmul(x, w, "tp", impl="fused"),
                               mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                               out_specs=P(None, "tp")))


ag = make_ag()
rs = jax.jit(jax.shard_map(lambda x, w: jaxflux.matmul_reduce_scatter(x, w, "tp", impl="fused"),
                           mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
                           out_specs=P("tp", None)))
bf16 = lambda a, spec: global_array(a.astype(jnp.bfloat16), spec)  # noqa: E731


def run_check():
  """Traced under jax.set_mesh: the ops take their peers' slots from a constant table."""
  x, w = operands(1, 256 * tp, 512, 384 * tp)
  check("all_gather_matmul value", ag(bf16(x, P("tp", None)), bf16(w, P(None, "tp"))), x @ w)
  x, w = operands(2, 256 * tp, 512 * tp, 384)
  check("matmul_reduce_scatter value", rs(bf16(x, P(None, "tp")), bf16(w, P("tp", None))), x @ w)

  outs, refs = [], []
  for i in range(200):  # back to back, fresh data, no host sync
    x, w = operands(100 + i, 128 * tp, 256, 128 * tp)
    outs.append(ag(bf16(x, P("tp", None)), bf16(w, P(None, "tp"))))
    refs.append(x @ w)
  for i in range(0, 200, 17):
    check(f"back-to-back call {i}", outs[i], refs[i])

  x, w = operands(3, 128 * tp, 256, 128 * tp)
  ct = np.random.default_rng(4).standard_normal((128 * tp, 128 * tp)).astype(np.float32)
  # The cotangent is an argument: a jitted function may not close over an array that spans
  # other processes' devices.
  loss = lambda x, w, ct: jnp.sum(ag(x, w).astype(jnp.float32) * ct)  # noqa: E731
  dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(bf16(x, P("tp", None)), bf16(w, P(None, "tp")),
                                                   global_array(ct, P(None, "tp")))
  check("gradient x", dx, ct @ w.T)
  check("gradient w", dw, x.T @ ct)


def run_check_gathered_slots():
  """Traced without jax.set_mesh: the slots come from jaxflux_device_slot + an all-gather."""
  gathered = make_ag()
  x, w = operands(6, 128 * tp, 256, 128 * tp)
  check("all_gather_matmul value, slots gathered in the program",
        gathered(bf16(x, P("tp", None)), bf16(w, P(None, "tp"))), x @ w)


def run_die():
  jaxflux.configure(timeout_s=5.0)
  x, w = operands(5, 128 * tp, 256, 128 * tp)
  xs, ws = bf16(x, P("tp", None)), bf16(w, P(None, "tp"))
  ag(xs, ws).block_until_ready()
  print("PASS first call", flush=True)
  if PROCESS_ID == 1:
    os._exit(0)  # dies without a word to anyone
  try:
    ag(xs, ws).block_until_ready()
    _runtime.check_errors()
    failures.append("the call with a dead peer did not fail")
  except RuntimeError as e:
    if "timed out" in str(e) and "all_gather_matmul" in str(e):
      print(f"PASS dead peer: {str(e)[:200]}", flush=True)
    else:
      failures.append(f"unexpected error: {e}")
  print(f"WORKER OK {PROCESS_ID}" if not failures else f"FAILURES {failures}", flush=True)
  os._exit(0 if not failures else 1)  # skip jax.distributed's shutdown barrier (peer is gone)


if MODE == "check":
  with jax.set_mesh(mesh):
    run_check()
  run_check_gathered_slots()
  _runtime.check_errors()
else:
  with jax.set_mesh(mesh):
    run_die()

if failures:
  print(f"FAILURES {failures}", flush=True)
  sys.exit(1)
print(f"WORKER OK {PROCESS_ID}", flush=True)
