"""The fused GEMM+AllReduce path as traced on any machine (the GPU faked by patching the platform
check; nothing runs the kernel): the FFI call, its attributes and workspace, its result typed
invariant over the axis like psum's, a backward without communication, and impl="auto" taking
XLA for this op."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxflux
from jaxflux import _runtime, tuning
from jaxflux.ops.gemm import gemm
import fused_calls
from conftest import make_mesh
from jaxpr_util import equations, ffi_calls
from test_fused_tracing import _FakeGpu

TARGET = "jaxflux_matmul_all_reduce"


@pytest.fixture
def workspace(monkeypatch):
  """A CUDA build with two Hopper GPUs, faked below the platform check (which then runs); the
  workspace sizes the calls ask for are recorded."""
  asked = []
  monkeypatch.setattr(_runtime, "cuda_built", lambda: True)
  monkeypatch.setattr(_runtime, "_gpu_devices", lambda: (_FakeGpu("9.0"), _FakeGpu("9.0")))
  monkeypatch.setattr(_runtime, "multi_process", lambda: False)
  monkeypatch.setattr(_runtime, "sm_count", lambda: 132)
  monkeypatch.setattr(_runtime, "gemm_workspace_bytes", lambda *args: 1024)
  monkeypatch.setattr(_runtime, "ensure_workspace", lambda nbytes: asked.append(nbytes) or 0)
  monkeypatch.setattr(_runtime, "target_name", lambda op: f"jaxflux_{op}")
  monkeypatch.setattr(_runtime, "register_targets", lambda: frozenset())
  return asked


def _mapped(body, tp=2, nbatch=0, w_spec=P("tp", None), check_vma=True):
  lead = (None,) * nbatch
  return jax.shard_map(body, mesh=make_mesh((tp,), ("tp",)),
                       in_specs=(P(*lead, None, "tp"), w_spec), out_specs=P(),
                       check_vma=check_vma)


def _fused_op(x, w):
  return jaxflux.matmul_all_reduce(x, w, "tp", impl="fused")


def _sds(shape, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("tp,batch,m,want", [
    # decode (rows <= 128): the swap-AB decode GEMM, pushed whole, swizzle 1
    (2, (), 16, {"tile": 2, "push_chunks": 0, "swizzle": 1}),
    (2, (), 128, {"tile": 2, "push_chunks": 0, "swizzle": 1}),
    (4, (2,), 64, {"tile": 2, "push_chunks": 0, "swizzle": 1}),
    # prefill: stock 128x256, chunked unless batched; swizzle 1 below 2048 rows, 4 from there
    (2, (), 129, {"tile": 0, "push_chunks": 1, "swizzle": 1}),
    (2, (2,), 512, {"tile": 0, "push_chunks": 0, "swizzle": 1}),
    (8, (), 4096, {"tile": 0, "push_chunks": 1, "swizzle": 4}),
    (2, (2,), 1024, {"tile": 0, "push_chunks": 0, "swizzle": 4}),
])
def test_the_call_carries_the_table_choice_and_its_workspace(workspace, tp, batch, m, want):
  k, n = 64, 96
  f = _mapped(_fused_op, tp=tp, nbatch=len(batch))
  x, w = _sds(batch + (m, k * tp)), _sds((k * tp, n))
  assert jax.eval_shape(f, x, w) == _sds(batch + (m, n))
  [(target, attrs)] = ffi_calls(jax.make_jaxpr(f)(x, w))
  assert target == TARGET
  assert {name: attrs[name] for name in want} == want
  assert attrs["tp"] == tp and attrs["transpose_w"] == 0 and attrs["grid_sms"] == 0
  assert attrs["debug_skip_rank"] == -1 and attrs["num_groups"] == 1
  rows = (batch[0] if batch else 1) * m
  # Two parities of tp receive slots, each one rank's bfloat16 partial, 256-byte aligned.
  assert workspace[-1] == 2 * tp * -(-rows * n * 2 // 256) * 256


def test_an_override_reaches_the_call(workspace):
  x, w = _sds((16, 128)), _sds((128, 64))
  with tuning.override("matmul_all_reduce", tile="cooperative_128x256_cluster2x1",
                       push="chunked", swizzle=8, grid_sms=100):
    [(_, attrs)] = ffi_calls(jax.make_jaxpr(_mapped(_fused_op))(x, w))
  assert {k: attrs[k] for k in ("tile", "push_chunks", "swizzle", "grid_sms")} == {
      "tile": 0, "push_chunks": 1, "swizzle": 8, "grid_sms": 100}


def test_an_overridden_chunked_push_with_batched_x_fails_at_trace_time(workspace):
  x, w = _sds((2, 512, 128)), _sds((128, 64))
  with tuning.override("matmul_all_reduce", push="chunked"):
    with pytest.raises(ValueError, match=r"matmul_all_reduce: push='chunked' needs an unbatched "
                                         r"x.*2 batch entries. Override push='whole'"):
      jax.eval_shape(_mapped(_fused_op, nbatch=1), x, w)


def test_the_weight_given_transposed_reaches_the_call(workspace):
  """transpose_w: w is [N, k]; the output is [.., M, N] all the same."""
  body = lambda x, wt: fused_calls.matmul_all_reduce(x, wt, "tp", transpose_w=True)  # noqa: E731
  f = _mapped(body, w_spec=P(None, "tp"))
  x, wt = _sds((16, 128)), _sds((96, 128))
  assert jax.eval_shape(f, x, wt) == _sds((16, 96))
  [(target, attrs)] = ffi_calls(jax.make_jaxpr(f)(x, wt))
  assert target == TARGET and attrs["transpose_w"] == 1


def test_a_group_of_one_runs_the_plain_gemm(workspace):
  f = _mapped(_fused_op, tp=1)
  [(target, attrs)] = ffi_calls(jax.make_jaxpr(f)(_sds((16, 64)), _sds((64, 32))))
  assert target == "jaxflux_gemm" and attrs["kernel"] == 0


def test_forward_and_grad_trace_with_matching_types_and_no_backward_communication(workspace):
  """The result typed invariant over tp (out_specs P() accepts it), and jax.grad traces: the
  backward is two local matmuls, with no collective and no second FFI call."""
  f = _mapped(_fused_op)
  x, w = jnp.ones((16, 128), jnp.bfloat16), jnp.ones((128, 64), jnp.bfloat16)
  grad = jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32)), argnums=(0, 1))
  jaxpr = jax.make_jaxpr(grad)(x, w)
  assert [target for target, _ in ffi_calls(jaxpr)] == [TARGET]
  assert not _collectives(jaxpr.jaxpr)
  dx, dw = jax.eval_shape(grad, x, w)
  assert (dx.shape, dw.shape, dx.dtype, dw.dtype) == ((16, 128), (128, 64), jnp.bfloat16,
                                                      jnp.bfloat16)


def _collectives(jaxpr) -> set:
  """The communicating primitives of a jaxpr, nested ones included (psum is `psum_invariant`
  or `psum` by jax version; pvary/pcast only retype and are left out)."""
  return {eqn.primitive.name for eqn in equations(jaxpr)
          if eqn.primitive.name.startswith(("psum", "all_gather", "reduce_scatter", "all_to_all",
                                            "ppermute"))}


@pytest.mark.parametrize("m", [1, 16, 2048, 16384])
def test_auto_takes_xla_even_where_the_kernel_could_run(workspace, m):
  f = _mapped(lambda x, w: jaxflux.matmul_all_reduce(x, w, "tp", impl="auto"))
  jaxpr = jax.make_jaxpr(f)(_sds((m, 8192)), _sds((8192, 8192)))
  assert ffi_calls(jaxpr) == []
  assert {name for name in _collectives(jaxpr.jaxpr) if name.startswith("psum")}


@pytest.mark.parametrize("w_shape,kwargs,match", [
    ((60, 32), {}, r"w shard is \[K, N\] = \[30, 32\]; .*multiples of 8"),
    ((64, 36), {}, r"w shard is \[K, N\] = \[32, 36\]; .*multiples of 8"),
    ((64, 32), {"preferred_element_type": jnp.float32}, r"preferred_element_type=float32"),
])
def test_fused_raises_for_shapes_it_does_not_take(workspace, w_shape, kwargs, match):
  f = _mapped(lambda x, w: jaxflux.matmul_all_reduce(x, w, "tp", impl="fused", **kwargs))
  with pytest.raises(jaxflux.FusedKernelUnavailableError,
                     match=rf"matmul_all_reduce\(impl='fused'\): .*{match}"):
    jax.eval_shape(f, _sds((8, w_shape[0])), _sds(w_shape))


def test_fused_needs_hopper(workspace, monkeypatch):
  monkeypatch.setattr(_runtime, "_gpu_devices", lambda: (_FakeGpu("8.0"), _FakeGpu("8.0")))
  with pytest.raises(jaxflux.FusedKernelUnavailableError, match=r"Hopper.*8\.0"):
    jax.eval_shape(_mapped(_fused_op), _sds((8, 64)), _sds((64, 32)))


@pytest.mark.parametrize("rows,tile,swizzle", [(1, 2, 1), (128, 2, 1), (129, 0, 1),
                                               (2047, 0, 1), (2048, 0, 4), (8192, 0, 4)])
def test_the_gemm_only_mode_is_tuned_as_the_fused_op(workspace, rows, tile, swizzle):
  """gemm(kernel="matmul_all_reduce"): CUTLASS's GEMM (kernel 0) with the fused op's tile."""
  [(target, attrs)] = ffi_calls(jax.make_jaxpr(
      lambda x, w: gemm(x, w, kernel="matmul_all_reduce"))(_sds((rows, 64)), _sds((64, 32))))
  assert target == "jaxflux_gemm"
  assert (attrs["kernel"], attrs["tile"], attrs["swizzle"]) == (0, tile, swizzle)
  with tuning.override("matmul_all_reduce", tile="cooperative_128x128_streamk", swizzle=2):
    [(_, forced)] = ffi_calls(jax.make_jaxpr(
        lambda x, w: gemm(x, w, kernel="matmul_all_reduce"))(_sds((rows, 64)), _sds((64, 32))))
  assert (forced["tile"], forced["swizzle"]) == (1, 2)
