"""A traced program with fused calls depends on its shapes and settings only, never on what the
process traced before: its workspace class is a pure function of the call's need, and the `site`
attribute a key of the call's signature. So a second process traces the same HLO and loads the
first one's compiled program from JAX's persistent cache (tests/test_compilation_cache_gpu.py
runs that on a GPU)."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxflux
from jaxflux import _runtime
from jaxflux.ops import _group_call
from conftest import make_mesh
from jaxpr_util import ffi_calls

GROUP_TARGETS = {"jaxflux_all_gather_matmul", "jaxflux_matmul_reduce_scatter",
                 "jaxflux_matmul_all_reduce"}


@pytest.fixture
def classes(fake_hopper, monkeypatch):
  """fake_hopper, with each fused call's workspace class the runtime's own (no GPU needed)."""
  monkeypatch.setattr(_runtime, "ensure_workspace", _runtime.workspace_class)
  monkeypatch.setattr(_runtime._settings, "workspace_bytes", None)


def test_workspace_class_is_the_smallest_power_of_two_that_holds_the_need(classes):
  smallest, largest = _runtime._ext.workspace_classes
  assert _runtime.workspace_class(0) == smallest == 21  # 2 MiB
  assert _runtime.workspace_class(2 << 20) == 21
  assert _runtime.workspace_class((2 << 20) + 1) == 22
  assert _runtime.workspace_class(96 << 20) == 27
  with pytest.raises(ValueError, match=r"needs \d+ bytes .* split the call along its rows"):
    _runtime.workspace_class((1 << largest) + 1)


def test_the_configured_reserve_is_the_least_class(classes):
  jaxflux.configure(workspace_bytes=64 << 20)
  assert _runtime.workspace_class(1 << 20) == 26
  assert _runtime.workspace_class(100 << 20) == 27  # a larger need still gets its own class


def _program(rows):
  """AG+GEMM, then GEMM+RS, then GEMM+AllReduce on a tp=2 mesh, `rows` rows per shard."""
  def body(x, w1, w2, w3):
    h = jaxflux.all_gather_matmul(x, w1, "tp", impl="fused")  # [2 rows, 2n/2]
    y = jaxflux.matmul_reduce_scatter(h, w2, "tp", impl="fused")  # [rows, k]
    return jaxflux.matmul_all_reduce(y[:, :64], w3, "tp", impl="fused")

  mesh = make_mesh((2,), ("tp",))
  f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), P(None, "tp"), P("tp", None),
                                               P("tp", None)),
                    out_specs=P("tp", None), check_vma=False)
  args = (jnp.ones((2 * rows, 256), jnp.bfloat16), jnp.ones((256, 512), jnp.bfloat16),
          jnp.ones((512, 256), jnp.bfloat16), jnp.ones((128, 128), jnp.bfloat16))
  return f, args


def _group_calls(rows):
  f, args = _program(rows)
  return [(target, attrs) for target, attrs in ffi_calls(jax.make_jaxpr(f)(*args))
          if target in GROUP_TARGETS]


def test_a_program_traces_alike_whatever_the_process_traced_before(classes):
  first = _group_calls(256)
  assert {target for target, _ in first} == GROUP_TARGETS
  _group_calls(8192)  # other shapes, a larger workspace class
  assert _group_calls(256) == first


def test_site_keys_tell_signatures_apart_and_classes_follow_the_need(classes):
  small, large = _group_calls(256), _group_calls(8192)
  for (target, a), (_, b) in zip(small, large):
    assert a["site"] != b["site"], target
    assert 0 <= a["site"] < 1 << 62
  # AG+GEMM's receive slots grow with the rows: 2 parities x 2 ranks x the shard.
  ag = [attrs for target, attrs in large if target == "jaxflux_all_gather_matmul"][0]
  assert ag["workspace_class"] == _runtime.workspace_class(2 * 2 * 8192 * 256 * 2)


_KEY_OF_A_FIXED_CALL = """
import jax, jax.numpy as jnp
from jaxflux.ops import _group_call
x = jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)
print(_group_call.signature_key("all_gather_matmul", (x,), x, {"tp": 2, "tile": 3}))
"""


def test_the_signature_key_is_stable_across_processes():
  """A pure function of its inputs (no hash seed, no counter): a fixed call keys alike in
  processes with different hash seeds, and tells attributes apart."""
  x = jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)
  key = _group_call.signature_key("all_gather_matmul", (x,), x, {"tp": 2, "tile": 3})
  assert key == _group_call.signature_key("all_gather_matmul", (x,), x, {"tile": 3, "tp": 2})
  assert key != _group_call.signature_key("all_gather_matmul", (x,), x, {"tp": 2, "tile": 4})
  # The other process hashes strings with another seed than this one's (random unless the
  # suite runs under a fixed PYTHONHASHSEED: then the other seed still differs).
  seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
  out = subprocess.run([sys.executable, "-c", _KEY_OF_A_FIXED_CALL], capture_output=True,
                       text=True, timeout=120, check=True,
                       env=dict(os.environ, PYTHONHASHSEED=seed, JAX_PLATFORMS="cpu"))
  assert int(out.stdout.split()[-1]) == key, out.stderr[-2000:]
