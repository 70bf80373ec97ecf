"""GPU runtime tests: copy-engine all-gather vs lax.all_gather (bitwise), back-to-back calls with
no host sync, mixing with XLA collectives, loops, alternating programs, dp x tp and permuted
meshes, and the bounded-wait timeout. Skipped unless jaxflux.has_cuda()."""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import jaxflux
from jaxflux import _runtime
from jaxflux.ops.all_gather import all_gather

pytestmark = pytest.mark.gpu


def _gpus(n=None):
  devices = jax.devices("gpu") if jaxflux.has_cuda() else []
  if len(devices) < 2:
    pytest.skip("needs at least 2 GPUs")
  return devices if n is None else devices[:n]


def _mesh(shape=None, names=("tp",), reverse=False):
  devices = _gpus()
  shape = (len(devices),) if shape is None else shape
  n = int(np.prod(shape))
  if len(devices) < n:
    pytest.skip(f"needs {n} GPUs")
  devices = np.asarray(devices[:n])
  if reverse:
    devices = devices[::-1]
  return Mesh(devices.reshape(shape), names)


def _in_spec(ndim, mesh, axis="tp"):
  spec = [None] * ndim
  spec[-2] = axis
  others = [a for a in mesh.axis_names if a != axis]
  if others and ndim >= 3:
    spec[0] = tuple(others) if len(others) > 1 else others[0]
  return P(*spec)


def _gather_fn(mesh, ndim, impl, axis="tp", **kw):
  """Per-device gathered outputs stacked on a new leading axis over all mesh axes."""
  all_axes = tuple(mesh.axis_names)
  body = lambda x: all_gather(x, axis, impl=impl, **kw)[None]
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=_in_spec(ndim, mesh, axis),
                               out_specs=P(all_axes)))


def _random(shape, dtype, seed):
  x = jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 3
  return x.astype(dtype)


def _bits(a):
  a = np.asarray(a)
  return a.view(np.dtype(f"u{a.dtype.itemsize}"))


@pytest.fixture(autouse=True)
def _clean_errors():
  jaxflux.configure(timeout_s=30.0, sync_errors=False)
  _runtime.check_errors()
  yield
  _runtime.check_errors()


SHAPES = [(8, 128), (3, 5), (1, 1), (2, 3, 7, 33), (4, 64, 1024), (5, 1)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("shard_shape", SHAPES)
def test_bitwise_equal_to_lax_all_gather(dtype, shard_shape):
  mesh = _mesh()
  tp = mesh.shape["tp"]
  shape = shard_shape[:-2] + (tp * shard_shape[-2], shard_shape[-1])
  x = _random(shape, dtype, 0)
  fused = _gather_fn(mesh, len(shape), "fused")(x)
  ref = _gather_fn(mesh, len(shape), "xla")(x)
  assert fused.shape == ref.shape == (tp,) + shape
  np.testing.assert_array_equal(_bits(fused), _bits(ref))


def test_500_back_to_back_calls_without_host_sync():
  mesh = _mesh()
  tp = mesh.shape["tp"]
  shape = (tp * 64, 384)
  f = _gather_fn(mesh, 2, "fused")
  make = jax.jit(lambda i: _random(shape, jnp.bfloat16, 1) + i.astype(jnp.bfloat16))
  xs, outs = [], []
  for i in range(500):
    x = make(jnp.int32(i % 64))
    xs.append(x)
    outs.append(f(x))
  for x, out in zip(xs, outs):
    np.testing.assert_array_equal(_bits(out), _bits(np.broadcast_to(np.asarray(x), out.shape)))


def test_mixed_with_psum_and_other_jaxflux_calls():
  mesh = _mesh()

  def body(x, y, impl):
    a = all_gather(x, "tp", impl=impl)
    s = lax.psum(x.astype(jnp.float32), "tp")
    b = all_gather(y * 2, "tp", impl=impl)
    c = all_gather(a[..., : x.shape[-2], :] + s.astype(x.dtype), "tp", impl=impl)
    return a[None], b[None], c[None], s[None]

  tp = mesh.shape["tp"]
  x = _random((tp * 16, 256), jnp.bfloat16, 2)
  y = _random((3, tp * 5, 7), jnp.float32, 3)
  outs = {}
  for impl in ("fused", "xla"):
    f = jax.jit(jax.shard_map(lambda x, y: body(x, y, impl), mesh=mesh,
                              in_specs=(P("tp"), P(None, "tp")), out_specs=P("tp")))
    outs[impl] = f(x, y)
  for a, b in zip(outs["fused"], outs["xla"]):
    np.testing.assert_array_equal(_bits(a), _bits(b))


def test_inside_fori_loop():
  mesh = _mesh()
  tp = mesh.shape["tp"]

  def body(x, impl):
    m = x.shape[-2]
    rank = lax.axis_index("tp")

    def step(i, x):
      g = all_gather(x, "tp", impl=impl)
      nxt = lax.dynamic_slice_in_dim(g, ((rank + 1) % tp) * m, m, axis=-2)
      return nxt * 1.5 + i.astype(x.dtype)

    return lax.fori_loop(0, 200, step, x)

  x = _random((tp * 32, 128), jnp.float32, 4)
  res = {impl: jax.jit(jax.shard_map(lambda x: body(x, impl), mesh=mesh, in_specs=P("tp"),
                                     out_specs=P("tp")))(x) for impl in ("fused", "xla")}
  np.testing.assert_array_equal(_bits(res["fused"]), _bits(res["xla"]))


def test_two_programs_alternating_with_workspace_growth():
  mesh = _mesh()
  tp = mesh.shape["tp"]
  small = _gather_fn(mesh, 2, "fused")
  xs_small = _random((tp * 8, 64), jnp.float16, 5)
  queued = [small(xs_small) for _ in range(20)]  # still queued when the next trace grows
  big = _gather_fn(mesh, 3, "fused")
  xs_big = _random((2, tp * 512, 2048), jnp.float32, 6)  # 8 MiB shards: forces a new arena
  outs = []
  for i in range(40):
    outs.append(("small", small(xs_small + i)) if i % 2 else ("big", big(xs_big * i)))
  for out in queued:
    np.testing.assert_array_equal(_bits(out), _bits(np.broadcast_to(xs_small, out.shape)))
  for i, (kind, out) in enumerate(outs):
    expect = xs_small + i if kind == "small" else xs_big * i
    np.testing.assert_array_equal(_bits(out), _bits(np.broadcast_to(np.asarray(expect), out.shape)))


@pytest.mark.parametrize("reverse", [False, True])
def test_dp_tp_mesh(reverse):
  n = len(_gpus())
  mesh = _mesh((1, n), ("dp", "tp"), reverse=reverse)
  x = _random((2, n * 24, 96), jnp.bfloat16, 7)
  fused = _gather_fn(mesh, 3, "fused")(x)
  ref = _gather_fn(mesh, 3, "xla")(x)
  np.testing.assert_array_equal(_bits(fused), _bits(ref))


def test_permuted_mesh_alternating_with_natural():
  natural, reverse = _mesh(), _mesh(reverse=True)
  tp = natural.shape["tp"]
  x = _random((tp * 40, 72), jnp.float32, 8)
  fn = {"n": _gather_fn(natural, 2, "fused"), "r": _gather_fn(reverse, 2, "fused")}
  outs = []
  for i in range(10):
    outs.append(fn["n"](jax.device_put(x, jax.NamedSharding(natural, P("tp")))))
    outs.append(fn["r"](jax.device_put(x, jax.NamedSharding(reverse, P("tp")))))
  for out in outs:
    np.testing.assert_array_equal(_bits(out), _bits(np.broadcast_to(np.asarray(x), out.shape)))


def test_discovery_happens_once_per_executable():
  mesh = _mesh()
  f = _gather_fn(mesh, 2, "fused")
  x = _random((mesh.shape["tp"] * 8, 32), jnp.float32, 9)
  f(x).block_until_ready()
  before = _runtime._ext.discovery_count()
  for _ in range(20):
    out = f(x)
  out.block_until_ready()
  assert _runtime._ext.discovery_count() == before


def test_timeout_fails_within_the_configured_time():
  mesh = _mesh()
  jaxflux.configure(timeout_s=2.0)
  x = _random((mesh.shape["tp"] * 8, 32), jnp.float32, 10)
  hang = _gather_fn(mesh, 2, "fused", debug_skip_rank=0)
  good = _gather_fn(mesh, 2, "fused")
  good(x).block_until_ready()
  start = time.monotonic()
  hang(x).block_until_ready()
  elapsed = time.monotonic() - start
  assert elapsed < 15.0, elapsed
  with pytest.raises(RuntimeError, match=r"timed out after 2 s waiting for rank 0"):
    _runtime.check_errors()
  # The protocol stays aligned: the next calls work.
  out = good(x)
  np.testing.assert_array_equal(_bits(out), _bits(np.broadcast_to(np.asarray(x), out.shape)))


def test_timeout_fails_next_call_with_sync_errors():
  mesh = _mesh()
  jaxflux.configure(timeout_s=2.0, sync_errors=True)
  x = _random((mesh.shape["tp"] * 8, 32), jnp.float32, 11)
  hang = _gather_fn(mesh, 2, "fused", debug_skip_rank=1)
  with pytest.raises(Exception, match="timed out"):
    hang(x).block_until_ready()
  jaxflux.configure(sync_errors=False)
  _runtime._ext.take_device_error()
  good = _gather_fn(mesh, 2, "fused")
  out = good(x)
  np.testing.assert_array_equal(_bits(out), _bits(np.broadcast_to(np.asarray(x), out.shape)))
