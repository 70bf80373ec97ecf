"""The fused AllGather+GEMM path as traced on any machine: which shapes it takes, what auto
picks, and that its FFI call is typed like the XLA path under shard_map, so jax.grad traces
(an earlier version typed x_full as unvarying and the custom_vjp backward failed on GPU only).
The GPU is faked by patching the platform check; nothing here runs the kernel."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxflux
from jaxflux import _runtime, tuning
from jaxflux.tuning import device as tuning_device
from jaxflux.ops import _platform
from jaxflux.ops.gemm import gemm
import fused_calls
from conftest import make_mesh
from jaxpr_util import equations, ffi_calls


@pytest.fixture
def fake_gpu(monkeypatch):
  """Tracing as if a CUDA build and GPUs were present (the FFI target is never lowered), of no
  kind with a device table (the sm90 defaults), wherever the test runs."""
  monkeypatch.setattr(tuning_device, "current", lambda: None)
  monkeypatch.setattr(_platform, "platform_reason", lambda axis_name=None: None)
  monkeypatch.setattr(_runtime, "ensure_workspace", lambda nbytes: 0)
  monkeypatch.setattr(_runtime, "gemm_workspace_bytes", lambda *args: 1024)
  monkeypatch.setattr(_runtime, "target_name", lambda op: f"jaxflux_{op}")


def _shard_mapped(fn, tp=2):
  mesh = make_mesh((tp,), ("tp",))
  return jax.shard_map(fn, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                       out_specs=P(None, "tp"))


def _jaxpr_text(fn, *args) -> str:
  return str(jax.make_jaxpr(fn)(*args))


def test_fused_forward_and_grad_trace_with_matching_types(fake_gpu):
  x = jnp.ones((8, 64), jnp.bfloat16)
  w = jnp.ones((64, 32), jnp.bfloat16)
  f = _shard_mapped(lambda x, w: jaxflux.all_gather_matmul(x, w, "tp", impl="fused"))
  assert "jaxflux_all_gather_matmul" in _jaxpr_text(f, x, w)
  loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32))
  text = _jaxpr_text(jax.grad(loss, argnums=(0, 1)), x, w)
  assert "jaxflux_all_gather_matmul" in text


def test_return_gathered_traces(fake_gpu):
  x = jnp.ones((2, 8, 64), jnp.float16)
  w = jnp.ones((64, 32), jnp.float16)
  mesh = make_mesh((2,), ("tp",))
  f = jax.shard_map(
      lambda x, w: jaxflux.all_gather_matmul(x, w, "tp", impl="fused", return_gathered=True),
      mesh=mesh, in_specs=(P(None, "tp", None), P(None, "tp")),
      out_specs=(P(None, None, "tp"), P()), check_vma=False)
  y, x_full = jax.eval_shape(f, x, w)
  assert y.shape == (2, 8, 32) and x_full.shape == (2, 8, 64)


@pytest.mark.parametrize("w_shape,kwargs,match", [
    ((60, 32), {}, r"w shard is \[K, N\] = \[60, 16\]; .*multiples of 8"),
    ((64, 36), {}, r"w shard is \[K, N\] = \[64, 18\]; .*multiples of 8"),
    ((64, 32), {"preferred_element_type": jnp.float32}, r"preferred_element_type=float32"),
])
def test_fused_raises_for_shapes_it_does_not_take(fake_gpu, w_shape, kwargs, match):
  x = jnp.ones((8, w_shape[0]), jnp.bfloat16)
  w = jnp.ones(w_shape, jnp.bfloat16)
  f = _shard_mapped(lambda x, w: jaxflux.all_gather_matmul(x, w, "tp", impl="fused", **kwargs))
  with pytest.raises(jaxflux.FusedKernelUnavailableError, match=match):
    jax.eval_shape(f, x, w)


@pytest.mark.parametrize("tp,rows,fused", [
    (2, 2048, True),     # measured ahead of XLA on 2xH200
    (2, 8192, True),
    (2, 1024, False),    # below the measured region
    (4, 8192, False),    # tp=4 not measured yet
])
def test_auto_takes_fused_only_where_measured_ahead(fake_gpu, tp, rows, fused):
  x = jnp.ones((rows, 64), jnp.bfloat16)
  w = jnp.ones((64, 32 * tp), jnp.bfloat16)
  f = _shard_mapped(lambda x, w: jaxflux.all_gather_matmul(x, w, "tp", impl="auto"), tp=tp)
  text = _jaxpr_text(f, x, w)
  assert ("jaxflux_all_gather_matmul" in text) == fused
  assert ("all_gather[" in text or "all_gather " in text) == (not fused)


def test_gemm_rejects_unknown_kernel():
  x = jax.ShapeDtypeStruct((8, 16), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((16, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"kernel='rows' is not one of \('cutlass', "
                                       r"'all_gather_matmul', 'own_rows', "
                                       r"'matmul_all_reduce'\)"):
    jax.eval_shape(lambda a, b: gemm(a, b, kernel="rows"), x, w)


@pytest.mark.parametrize("kernel,rows,k,n,want", [
    ("cutlass", 4096, 4096, 8192, {"kernel": 0, "swizzle": 1}),
    # Cooperative, swizzle 4 (also under 4 waves: 16 x 16 tiles = 256 < 4 x 132), or 8 where
    # 2048-row bands tile each shard (of rows / 2) and N is whole groups of 8 tiles.
    ("all_gather_matmul", 2048, 64, 4096, {"kernel": 1, "tile": 0, "swizzle": 4}),
    ("all_gather_matmul", 16384, 64, 8192, {"kernel": 1, "tile": 0, "swizzle": 8}),
    ("all_gather_matmul", 16384, 64, 5120, {"kernel": 1, "tile": 0, "swizzle": 4}),
    # Own rows as GEMM+RS at tp=2 tunes them: chunked (swizzle 4 from 2048 rows) up to K 16384
    # and past it, and the whole push (CUTLASS's order) for a small partial.
    ("own_rows", 4096, 4096, 8192,
     {"kernel": 2, "own_rows_schedule": 0, "push_chunks": 1, "swizzle": 4}),
    ("own_rows", 8192, 24576, 12288,
     {"kernel": 2, "own_rows_schedule": 0, "push_chunks": 1, "swizzle": 4}),
    ("own_rows", 256, 4096, 8192,
     {"kernel": 2, "own_rows_schedule": 0, "push_chunks": 0, "swizzle": 1}),
])
def test_gemm_kernels_are_tuned_as_the_fused_ops_tune_them(fake_gpu, monkeypatch, kernel, rows,
                                                           k, n, want):
  monkeypatch.setattr(_runtime, "sm_count", lambda: 132)
  monkeypatch.setattr(_runtime, "register_targets", lambda: frozenset())
  x = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
  c = jax.ShapeDtypeStruct((rows, n), jnp.bfloat16) if kernel == "own_rows" else None
  [(target, attrs)] = ffi_calls(jax.make_jaxpr(lambda x, w: gemm(x, w, kernel=kernel, c=c))(
      x, w))
  assert target == "jaxflux_gemm"
  assert {name: attrs[name] for name in want} == want
  assert attrs["grid_sms"] == 0 and attrs["transpose_w"] == 0
  with tuning.override("matmul_reduce_scatter", grid_sms=100, own_rows_swizzle=8), \
       tuning.override("all_gather_matmul", grid_sms=100, swizzle=2):
    [(_, forced)] = ffi_calls(jax.make_jaxpr(lambda x, w: gemm(x, w, kernel=kernel, c=c))(x, w))
  assert forced["grid_sms"] == 100
  assert forced["swizzle"] == {"cutlass": 1, "all_gather_matmul": 2, "own_rows": 8}[kernel]


def test_gemm_and_grouped_gemm_declare_their_workspace_as_a_sized_result(fake_gpu, monkeypatch):
  """The workspace is a second u8 result, sized by the module for the call's own rows (leading
  axes folded), N, K and attributes, so the handler allocates nothing (command buffers)."""
  asked = []
  monkeypatch.setattr(_runtime, "register_targets", lambda: frozenset())
  monkeypatch.setattr(_runtime, "gemm_workspace_bytes",
                      lambda dtype, m, n, k, attrs: asked.append((m, n, k, attrs)) or 4096)
  monkeypatch.setattr(_runtime, "grouped_gemm_workspace_bytes",
                      lambda dtype, m, n, k, groups, attrs: asked.append((m, n, k, groups, attrs))
                      or 768)
  x = jax.ShapeDtypeStruct((3, 16, 64), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)
  [eqn] = [e for e in equations(jax.make_jaxpr(
      lambda x, w: gemm(x, w, kernel="matmul_all_reduce"))(x, w)) if e.primitive.name == "ffi_call"]
  assert [(o.aval.shape, o.aval.dtype) for o in eqn.outvars] == [((3, 16, 32), jnp.bfloat16),
                                                                 ((4096,), jnp.uint8)]
  m, n, k, attrs = asked.pop()
  assert (m, n, k) == (48, 32, 64)
  assert attrs == {name: int(v) for name, v in dict(eqn.params["attributes"]).items()}
  xg = jax.ShapeDtypeStruct((40, 64), jnp.bfloat16)
  wg = jax.ShapeDtypeStruct((4, 64, 32), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
  [eqn] = [e for e in equations(jax.make_jaxpr(
      lambda x, w, g: jaxflux.grouped_matmul(x, w, g, impl="fused"))(xg, wg, sizes))
      if e.primitive.name == "ffi_call"]
  assert eqn.outvars[1].aval.shape == (768,) and eqn.outvars[1].aval.dtype == jnp.uint8
  m, n, k, groups, attrs = asked.pop()
  assert (m, n, k, groups) == (40, 32, 64, 4) and attrs["kind"] == 0


def test_the_grouped_tile_override_reaches_every_call_it_traces(fake_gpu, monkeypatch):
  monkeypatch.setattr(_runtime, "register_targets", lambda: frozenset())
  monkeypatch.setattr(_runtime, "grouped_gemm_workspace_bytes", lambda *args: 256)
  x = jnp.ones((40, 64), jnp.bfloat16)
  w = jnp.ones((4, 64, 32), jnp.bfloat16)
  sizes = jnp.array([10, 10, 10, 10], jnp.int32)
  for tile in tuning.GROUPED_TILES:  # a function of its own per block: JAX caches its traces
    loss = lambda x, w: jnp.sum(jaxflux.grouped_matmul(x, w, sizes, impl="fused")  # noqa: E731
                                .astype(jnp.float32))
    with tuning.override("grouped_matmul", tile=tile):
      calls = ffi_calls(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w))
    assert len(calls) == 3  # forward, dx, dw
    assert all(attrs["tile"] == tuning.GROUPED_TILES.index(tile) for _, attrs in calls), calls


def test_fused_reduce_scatter_forward_and_grad_trace(fake_gpu):
  x = jnp.ones((8, 64), jnp.bfloat16)   # per device [M=8, K=32]
  w = jnp.ones((64, 32), jnp.bfloat16)  # per device [K=32, N=32]
  mesh = make_mesh((2,), ("tp",))
  f = jax.shard_map(lambda x, w: jaxflux.matmul_reduce_scatter(x, w, "tp", impl="fused"),
                    mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None))
  assert "jaxflux_matmul_reduce_scatter" in _jaxpr_text(f, x, w)
  loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32))
  text = _jaxpr_text(jax.grad(loss, argnums=(0, 1)), x, w)
  # The backward of GEMM+ReduceScatter is the fused AllGather+GEMM.
  assert "jaxflux_all_gather_matmul" in text and "jaxflux_matmul_reduce_scatter" in text


def _rs_mapped(tp, body):
  return jax.shard_map(body, mesh=make_mesh((tp,), ("tp",)),
                       in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None))


@pytest.mark.parametrize("tp,reduce,attr", [(2, "epilogue", 1), (2, "pass", 0), (2, None, 1),
                                            (4, "pass", 0), (4, None, 0)])
def test_reduce_scatter_reduction_modes_trace_into_the_call(fake_gpu, tp, reduce, attr):
  """The reduction the tuning table picks (tp=2 here: the epilogue for this small partial; other
  tp: the pass), or the one an override forces, reaches the call as its `reduce` attribute."""
  x = jnp.ones((8 * tp, 32 * tp), jnp.bfloat16)
  w = jnp.ones((32 * tp, 32), jnp.bfloat16)
  forced = {} if reduce is None else {"reduce": reduce}
  with tuning.override("matmul_reduce_scatter", **forced):
    f = _rs_mapped(tp, lambda x, w: fused_calls.matmul_reduce_scatter(x, w, "tp"))
    [(target, attrs)] = ffi_calls(jax.make_jaxpr(f)(x, w))
  assert target == "jaxflux_matmul_reduce_scatter" and attrs["reduce"] == attr
  assert attrs["push_chunks"] == 0 and attrs["debug_skip_rank"] == -1


@pytest.mark.parametrize("tp,fields,match", [
    (4, {"reduce": "epilogue"}, r"reduce='epilogue' needs tp=2 \(here tp=4\)"),
    (2, {"reduce": "pass", "push": "chunked"}, r"push='chunked' needs reduce='epilogue'"),
])
def test_reduce_scatter_rejects_reduction_modes_it_lacks(fake_gpu, tp, fields, match):
  x = jnp.ones((8 * tp, 32 * tp), jnp.bfloat16)
  w = jnp.ones((32 * tp, 32), jnp.bfloat16)
  with tuning.override("matmul_reduce_scatter", **fields):
    f = _rs_mapped(tp, lambda x, w: fused_calls.matmul_reduce_scatter(x, w, "tp"))
    with pytest.raises(ValueError, match=match):
      jax.eval_shape(f, x, w)


def test_an_unknown_reduction_mode_fails_at_the_override():
  with pytest.raises(ValueError, match=r"reduce='fast' is not valid; reduce takes 'epilogue' "
                                       r"or 'pass'"):
    with tuning.override("matmul_reduce_scatter", reduce="fast"):
      pass


def test_all_gather_choice_traces_into_the_call(fake_gpu, monkeypatch):
  """The tile and swizzle of the device's table (here H200's: ping-pong under 4 waves) or of an
  override, and the own rows read from x only where a shard is whole tiles."""
  monkeypatch.setattr(_runtime, "sm_count", lambda: 132)
  monkeypatch.setattr(tuning_device, "current",
                      lambda: tuning.Device("NVIDIA H200", "9.0", 132))

  def attrs_of(m):
    x = jnp.ones((2 * m, 64), jnp.bfloat16)
    w = jnp.ones((64, 64), jnp.bfloat16)
    f = _shard_mapped(lambda x, w: fused_calls.all_gather_matmul(x, w, "tp", False)[0])
    [(target, attrs)] = ffi_calls(jax.make_jaxpr(f)(x, w))
    assert target == "jaxflux_all_gather_matmul"
    return attrs
  # 4 tiles: few waves, ping-pong; the class's swizzle 4 halved so that its bands of 4 x 128
  # rows fit a shard of 256.
  assert {k: attrs_of(256)[k] for k in ("tile", "swizzle", "local_read", "grid_sms")} == {
      "tile": 1, "swizzle": 2, "local_read": 1, "grid_sms": 0}
  assert attrs_of(200)["local_read"] == 0  # not whole 128-row tiles: copied first
  with tuning.override("all_gather_matmul", tile="cooperative_128x256_cluster2x1", swizzle=1,
                       local_read="copy", grid_sms=100):
    forced = attrs_of(256)
  assert {k: forced[k] for k in ("tile", "swizzle", "local_read", "grid_sms")} == {
      "tile": 0, "swizzle": 1, "local_read": 0, "grid_sms": 100}


@pytest.mark.parametrize("tp,rows,k_local,fused", [
    (2, 2048, 64, True),         # measured ahead of XLA on 2xH200
    (2, 8192, 14336, True),      # Llama-70B FC2: 1.09x
    (2, 16384, 14336, False),    # Llama-70B FC2: within noise of XLA, so XLA
    (2, 16384, 24576, False),    # GPT-3 FC2: measured at parity
    (2, 1024, 64, False),        # below the measured region
    (4, 8192, 64, False),        # tp=4 not measured yet
])
def test_auto_reduce_scatter_takes_fused_only_where_measured_ahead(fake_gpu, tp, rows, k_local,
                                                                   fused):
  x = jax.ShapeDtypeStruct((rows, k_local * tp), jnp.bfloat16)  # per device [rows, k_local]
  w = jax.ShapeDtypeStruct((k_local * tp, 32), jnp.bfloat16)
  mesh = make_mesh((tp,), ("tp",))
  f = jax.shard_map(lambda x, w: jaxflux.matmul_reduce_scatter(x, w, "tp", impl="auto"),
                    mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None))
  text = _jaxpr_text(f, x, w)
  assert ("jaxflux_matmul_reduce_scatter" in text) == fused
  assert ("reduce_scatter[" in text) == (not fused)  # XLA's psum_scatter primitive


def test_backward_hands_the_weights_over_untransposed(fake_gpu):
  """A column -> row MLP's gradient: the backward runs the partner kernels on the forward
  weights as they are (transpose_w=1, read K-major), so the traced program holds no transpose
  of a weight (XLA would materialize it before the FFI call; docs/design.md, "The weight is
  never transposed")."""
  mesh = make_mesh((2,), ("tp",))

  def mlp(x, w1, w2):
    h = jaxflux.all_gather_matmul(x, w1, "tp", impl="fused")
    return jaxflux.matmul_reduce_scatter(h, w2, "tp", impl="fused")
  f = jax.shard_map(mlp, mesh=mesh, in_specs=(P("tp", None), P(None, "tp"), P("tp", None)),
                    out_specs=P("tp", None))
  x = jnp.ones((16, 64), jnp.bfloat16)
  w1 = jnp.ones((64, 32), jnp.bfloat16)
  w2 = jnp.ones((32, 64), jnp.bfloat16)
  grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))
  jaxpr = jax.make_jaxpr(grad)(x, w1, w2)
  calls = []
  for eqn in equations(jaxpr):
    assert eqn.primitive.name != "transpose", eqn
    if eqn.primitive.name == "ffi_call":
      calls.append((eqn.params["target_name"], int(dict(eqn.params["attributes"])["transpose_w"])))
  assert calls == [("jaxflux_all_gather_matmul", 0), ("jaxflux_matmul_reduce_scatter", 0),
                   ("jaxflux_all_gather_matmul", 1), ("jaxflux_matmul_reduce_scatter", 1)]


class _FakeGpu:
  def __init__(self, compute_capability):
    self.compute_capability = compute_capability


@pytest.fixture
def fake_hopper(monkeypatch):
  """A CUDA build with two Hopper GPUs, faked below the platform check (which then runs)."""
  monkeypatch.setattr(_runtime, "cuda_built", lambda: True)
  monkeypatch.setattr(_runtime, "_gpu_devices", lambda: (_FakeGpu("9.0"), _FakeGpu("9.0")))
  monkeypatch.setattr(_runtime, "multi_process", lambda: False)
  monkeypatch.setattr(_runtime, "sm_count", lambda: 132)
  monkeypatch.setattr(_runtime, "ensure_workspace", lambda nbytes: 0)
  monkeypatch.setattr(_runtime, "gemm_workspace_bytes", lambda *args: 1024)
  monkeypatch.setattr(_runtime, "target_name", lambda op: f"jaxflux_{op}")


def test_fused_kernels_need_hopper_gpus(fake_hopper, monkeypatch):
  assert _platform.platform_reason() is None
  monkeypatch.setattr(_runtime, "_gpu_devices", lambda: (_FakeGpu("8.0"), _FakeGpu("10.0")))
  reason = _platform.platform_reason()
  assert "Hopper" in reason and "8.0" in reason and "10.0" in reason
  x = jnp.ones((8, 64), jnp.bfloat16)
  w = jnp.ones((64, 32), jnp.bfloat16)
  with pytest.raises(jaxflux.FusedKernelUnavailableError, match="Hopper"):
    jax.eval_shape(_shard_mapped(lambda x, w: jaxflux.all_gather_matmul(x, w, "tp",
                                                                        impl="fused")), x, w)


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_another_auto_axis_makes_auto_use_xla_and_fused_raise(fake_hopper, op):
  """Inside a shard_map manual over tp only, a dp axis GSPMD partitions (Auto, size > 1) hides
  the device groups from the fused op: auto takes XLA, fused names the axis; manual over both
  axes, auto takes the fused kernel."""
  mesh = make_mesh((4, 2), ("dp", "tp"))
  fn = getattr(jaxflux, op)
  if op == "all_gather_matmul":
    specs, x = (P(None, "tp"), P(None, "tp")), jnp.ones((2, 4096, 64), jnp.bfloat16)
    w, out = jnp.ones((64, 128), jnp.bfloat16), P(None, None, "tp")
  else:
    specs, x = (P(None, None, "tp"), P("tp", None)), jnp.ones((2, 4096, 64), jnp.bfloat16)
    w, out = jnp.ones((64, 128), jnp.bfloat16), P(None, "tp", None)

  def mapped(impl, axis_names):
    return jax.shard_map(lambda x, w: fn(x, w, "tp", impl=impl), mesh=mesh, in_specs=specs,
                         out_specs=out, axis_names=axis_names)

  assert f"jaxflux_{op}" not in _jaxpr_text(mapped("auto", {"tp"}), x, w)
  with pytest.raises(jaxflux.FusedKernelUnavailableError, match=r"mesh axis 'dp' \(size 4\)"):
    jax.eval_shape(mapped("fused", {"tp"}), x, w)
  assert f"jaxflux_{op}" in _jaxpr_text(mapped("auto", {"dp", "tp"}), x, w)


def test_jax_export_refuses_a_fused_program_naming_the_target(fake_gpu):
  """jaxflux's FFI targets carry no serialization guarantee (their attributes follow the
  library's version, and a cross-process call's arena must be set up by tracing it), so
  jax.export refuses them with JAX's error, which names the target."""
  from jax import export

  mesh = make_mesh((1,), ("tp",))
  f = jax.jit(jax.shard_map(lambda x, w: jaxflux.matmul_all_reduce(x, w, "tp", impl="fused"),
                            mesh=mesh, in_specs=(P(), P()), out_specs=P()))
  x = jax.ShapeDtypeStruct((8, 64), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"custom calls whose targets have no compatibility "
                                       r"guarantees(.|\n)*jaxflux_gemm"):
    export.export(f, platforms=["cuda"])(x, w)
