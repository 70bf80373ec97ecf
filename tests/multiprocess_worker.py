"""One process of a multi-process jaxflux run on CPU (driven by tests/test_multiprocess.py).

    python tests/multiprocess_worker.py PORT NUM_PROCESSES PROCESS_ID LOCAL_DEVICES

Joins jax.distributed on 127.0.0.1:PORT with LOCAL_DEVICES CPU devices (cross-process
collectives through gloo), then, on meshes built from all processes' devices, runs
`jaxflux.all_gather_matmul` and `jaxflux.matmul_reduce_scatter` (impl="auto") in a jitted
shard_map, a column -> row MLP of `jaxflux.Dense` and the same of `jaxflux.nnx.Linear`, and
checks values and gradients against float64 NumPy. Every process builds the same inputs from
fixed seeds; each checks the shards it holds against the matching slice of the reference, so
together the processes check every element without gathering anything to one host.

A failed comparison is recorded, not raised, so this process keeps taking part in the
collectives of later steps (a process that left early would leave its peers waiting); the
exit status is 1 if any comparison failed. Prints `PASS <case>` per case and, last,
`WORKER OK <process id>`.
"""

import sys

import jax

PORT, NUM_PROCESSES, PROCESS_ID, LOCAL_DEVICES = map(int, sys.argv[1:5])

# Before any backend starts: the CPU client is created with these.
jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the default; said for clarity
jax.config.update("jax_default_matmul_precision", "highest")
# The coordinator listens on loopback only (JAX's default is every interface); explicit values,
# so no cluster auto-detection (SLURM, Open MPI) may override them; a peer that never shows up
# fails the run within a minute instead of the default five.
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{PORT}", num_processes=NUM_PROCESSES,
                           process_id=PROCESS_ID, coordinator_bind_address=f"127.0.0.1:{PORT}",
                           cluster_detection_method="deactivate", initialization_timeout=60)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxflux  # noqa: E402
import jaxflux.nnx  # noqa: E402

FAILURES: list[str] = []


def normal(seed, shape):
  """The same array in every process (NumPy, fixed seed)."""
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def place(a, mesh, spec):
  """A global array over `mesh` from a host array every process holds in full."""
  return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda idx: a[idx])


def check(case, actual, expected, rtol=1e-5, atol=1e-5):
  """Compares the shards of `actual` this process holds with the same slices of `expected`."""
  failures_before = len(FAILURES)
  if jax.tree.structure(actual) != jax.tree.structure(expected):
    FAILURES.append(f"{case}: tree {jax.tree.structure(actual)}, expected "
                    f"{jax.tree.structure(expected)}")
  for path, a, e in zip(*_paths_and_leaves(actual), jax.tree.leaves(expected)):
    if a.shape != e.shape:
      FAILURES.append(f"{case}{path}: global shape {a.shape}, expected {e.shape}")
      continue
    for shard in a.addressable_shards:
      try:
        np.testing.assert_allclose(np.asarray(shard.data, np.float64), e[shard.index],
                                   rtol=rtol, atol=atol * max(1.0, np.abs(e).max()))
      except AssertionError as err:
        FAILURES.append(f"{case}{path} shard {shard.index} on {shard.device}: {err}")
  print(f"{'PASS' if len(FAILURES) == failures_before else 'FAIL'} {case}", flush=True)


def _paths_and_leaves(tree):
  paths, leaves = zip(*jax.tree_util.tree_leaves_with_path(tree))
  return [jax.tree_util.keystr(p) for p in paths], leaves


def meshes():
  """(name, mesh) pairs over jax.devices(), all processes' devices in process order."""
  devices = np.array(jax.devices())
  n, local = NUM_PROCESSES, LOCAL_DEVICES
  # tp4 has an Auto axis; the dp x tp meshes have Explicit ones (jax.make_mesh's default, and
  # what flax.nnx needs: it refuses meshes that mix the two when it creates sharded params).
  dp_tp = (AxisType.Explicit, AxisType.Explicit)
  out = [(f"tp{devices.size}", Mesh(devices, ("tp",), axis_types=(AxisType.Auto,)))]
  # Rows of devices.reshape(n, local) are processes.
  if local > 1:
    # The production layout: tp inside a process (host), dp across processes.
    out.append((f"dp{n}xtp{local}-tp-in-process",
                Mesh(devices.reshape(n, local), ("dp", "tp"), axis_types=dp_tp)))
    # The other way round: every tp group spans processes.
    out.append((f"dp{local}xtp{n}-tp-across",
                Mesh(devices.reshape(n, local).T, ("dp", "tp"), axis_types=dp_tp)))
  elif n >= 4:
    out.append((f"dp2xtp{n // 2}-tp-across",
                Mesh(devices.reshape(2, n // 2), ("dp", "tp"), axis_types=dp_tp)))
  return out


def check_ops(name, mesh):
  """Both ops in one jitted shard_map: values and gradients of sum(r1*y) + sum(r2*z)."""
  b = "dp" if "dp" in mesh.axis_names else None
  x1, w1, r1 = normal(1, (2, 8, 6)), normal(2, (6, 8)), normal(3, (2, 8, 8))
  x2, w2, r2 = normal(4, (2, 8, 8)), normal(5, (8, 6)), normal(6, (2, 8, 6))
  specs = (P(b, "tp", None), P(None, "tp"), P(b, None, "tp"),   # x1, w1, r1 (and y)
           P(b, None, "tp"), P("tp", None), P(b, "tp", None))   # x2, w2, r2 (and z)

  def body(x1, w1, r1, x2, w2, r2):
    y = jaxflux.all_gather_matmul(x1, w1, "tp", impl="auto")
    z = jaxflux.matmul_reduce_scatter(x2, w2, "tp", impl="auto")
    # Each device holds a disjoint block of y and of z: the global loss is the sum over devices.
    loss = jax.lax.psum(jnp.sum(r1 * y) + jnp.sum(r2 * z), mesh.axis_names)
    return loss, (y, z)

  loss = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), (specs[2], specs[5])))

  args = [place(a, mesh, s) for a, s in zip((x1, w1, r1, x2, w2, r2), specs)]
  (_, (y, z)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 3, 4), has_aux=True))(*args)

  f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
  check(f"{name} all_gather_matmul value", y, f64(x1) @ f64(w1))
  check(f"{name} matmul_reduce_scatter value", z, f64(x2) @ f64(w2))
  check(f"{name} op gradients", grads, (
      f64(r1) @ f64(w1).T, np.einsum("bmk,bmn->kn", f64(x1), f64(r1)),
      f64(r2) @ f64(w2).T, np.einsum("bmk,bmn->kn", f64(x2), f64(r2))))


class LinenMLP(nn.Module):
  """Sequence-parallel MLP: tokens sharded in, column then row Dense, tokens sharded out."""
  hidden: int

  @nn.compact
  def __call__(self, x):
    h = jaxflux.Dense(self.hidden, tensor_parallel="column")(x)
    return jaxflux.Dense(x.shape[-1], tensor_parallel="row")(nn.relu(h))


class NnxMLP(nnx.Module):
  def __init__(self, features, hidden):
    rngs = nnx.Rngs(0)
    self.up = jaxflux.nnx.Linear(features, hidden, tensor_parallel="column", rngs=rngs)
    self.down = jaxflux.nnx.Linear(hidden, features, tensor_parallel="row", rngs=rngs)

  def __call__(self, x):
    return self.down(nnx.relu(self.up(x)))


def mlp_reference(x, p, r):
  """float64 relu MLP: y, and the gradients of sum(r * y) as ({layer: {kernel, bias}}, dx)."""
  x, r = np.asarray(x, np.float64), np.asarray(r, np.float64)
  k1, b1, k2, b2 = (np.asarray(p[k][n], np.float64) for k in ("up", "down")
                    for n in ("kernel", "bias"))
  pre = x @ k1 + b1
  h = np.maximum(pre, 0)
  dh = (r @ k2.T) * (pre > 0)
  grads = {"up": {"kernel": np.einsum("btk,btn->kn", x, dh), "bias": dh.sum((0, 1))},
           "down": {"kernel": np.einsum("btk,btn->kn", h, r), "bias": r.sum((0, 1))}}
  return h @ k2 + b2, grads, dh @ k1.T


def check_layers(name, mesh):
  """jaxflux.Dense and jaxflux.nnx.Linear MLPs: output, param and input gradients."""
  b = "dp" if "dp" in mesh.axis_names else None
  features, hidden = 8, 16
  p = {"up": {"kernel": normal(11, (features, hidden)) / 3, "bias": normal(12, (hidden,))},
       "down": {"kernel": normal(13, (hidden, features)) / 4, "bias": normal(14, (features,))}}
  x, r = normal(15, (2, 8, features)), normal(16, (2, 8, features))
  param_specs = {"up": {"kernel": P(None, "tp"), "bias": P("tp")},
                 "down": {"kernel": P("tp", None), "bias": P()}}
  placed = jax.tree.map(lambda a, s: place(a, mesh, s), p, param_specs)
  tokens = P(b, "tp", None)  # the residual-stream layout: tokens sharded over tp
  gx, gr = place(x, mesh, tokens), place(r, mesh, tokens)
  y_ref, grads_ref, dx_ref = mlp_reference(x, p, r)

  with jax.set_mesh(mesh):
    linen_params = {"Dense_0": placed["up"], "Dense_1": placed["down"]}

    def linen_loss(params, x, r):
      y = LinenMLP(hidden).apply({"params": params}, x)
      return jnp.sum(y * r), y

    (_, y), (grads, dx) = jax.jit(
        jax.value_and_grad(linen_loss, argnums=(0, 1), has_aux=True))(linen_params, gx, gr)
    check(f"{name} linen Dense MLP", (y, grads["Dense_0"], grads["Dense_1"], dx),
          (y_ref, grads_ref["up"], grads_ref["down"], dx_ref))

    # Abstract model, then a checkpoint's params: no initializer runs (or compiles).
    model = nnx.eval_shape(lambda: NnxMLP(features, hidden))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, placed)
    nnx.update(model, state)
    graphdef, state = nnx.split(model)

    def nnx_loss(state, x, r):
      y = nnx.merge(graphdef, state)(x)
      return jnp.sum(y * r), y

    (_, y), (dstate, dx) = jax.jit(
        jax.value_and_grad(nnx_loss, argnums=(0, 1), has_aux=True))(state, gx, gr)
    grads = nnx.to_pure_dict(dstate)
    check(f"{name} nnx Linear MLP", (y, grads["up"], grads["down"], dx),
          (y_ref, grads_ref["up"], grads_ref["down"], dx_ref))


def tp_spans_processes(mesh) -> bool:
  """Whether some tp group holds devices of more than one process."""
  devices = np.moveaxis(mesh.devices, mesh.axis_names.index("tp"), -1).reshape(-1, mesh.shape["tp"])
  return any(len({d.process_index for d in group}) > 1 for group in devices)


def main():
  assert jax.process_count() == NUM_PROCESSES and jax.local_device_count() == LOCAL_DEVICES
  assert jax.device_count() == NUM_PROCESSES * LOCAL_DEVICES
  for name, mesh in meshes():
    if PROCESS_ID == 0:
      print(f"mesh {name}: {dict(mesh.shape)}, tp spans processes: {tp_spans_processes(mesh)}",
            flush=True)
    check_ops(name, mesh)
    check_layers(name, mesh)
  for failure in FAILURES:
    print(f"process {PROCESS_ID}: MISMATCH {failure}", file=sys.stderr)
  jax.distributed.shutdown()
  if FAILURES:
    sys.exit(1)
  print(f"WORKER OK {PROCESS_ID}", flush=True)


if __name__ == "__main__":
  main()
