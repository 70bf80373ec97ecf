"""Test setup: 8 virtual CPU devices (set before JAX starts its backends), float32 matmuls at
full precision so the pure-JAX path can be compared tightly with float64 NumPy references, and
the `gpu` marker, which skips a test unless the fused CUDA kernels can run here.
"""
import os

import jax

if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
  jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402

import jaxflux  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before -m selects on the markers added here
def pytest_collection_modifyitems(config, items):
  _mark_all_but_one_instance_slow(items)
  if jaxflux.has_cuda():
    return
  skip = pytest.mark.skip(reason="needs CUDA GPUs and a CUDA build of jaxflux")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def _mark_all_but_one_instance_slow(items):
  """`@pytest.mark.quick_once("tile")`: the first instance of the test for each value of `tile`
  not already slow stays in the quick tier, every other instance is marked slow (the full tier
  runs them)."""
  seen = set()
  for item in items:
    marker = item.get_closest_marker("quick_once")
    if marker is None or not hasattr(item, "callspec") or item.get_closest_marker("slow"):
      continue
    key = (item.nodeid.partition("[")[0],) + tuple(
        repr(item.callspec.params[name]) for name in marker.args)
    if key in seen:
      item.add_marker(pytest.mark.slow)
    seen.add(key)


def pytest_configure(config):
  # CI sets JAXFLUX_REQUIRE_8_DEVICES=1 so that a misconfigured run fails instead of skipping.
  if os.environ.get("JAXFLUX_REQUIRE_8_DEVICES") == "1" and len(jax.devices()) < 8:
    pytest.exit(f"expected 8 devices, found {len(jax.devices())}: {jax.devices()}", returncode=1)


@pytest.fixture
def fake_hopper(monkeypatch):
  """Tracing as if a CUDA build and one 132-SM Hopper GPU per device were present: the platform
  check passes and the FFI targets are named, never registered or lowered, so tests can read
  the fused path's jaxprs on any machine."""
  from jaxflux import _runtime
  from jaxflux.ops import _platform

  monkeypatch.setattr(_platform, "platform_reason", lambda axis_name=None: None)
  monkeypatch.setattr(_runtime, "ensure_workspace", lambda nbytes: 0)
  monkeypatch.setattr(_runtime, "target_name", lambda op: f"jaxflux_{op}")
  monkeypatch.setattr(_runtime, "register_targets", lambda: None)
  monkeypatch.setattr(_runtime, "sm_count", lambda: 132)
  # The workspace results' sizes come from the CUDA module; any size traces alike.
  monkeypatch.setattr(_runtime, "gemm_workspace_bytes", lambda *args: 1024)
  monkeypatch.setattr(_runtime, "grouped_gemm_workspace_bytes", lambda *args: 1024)


def make_mesh(shape, names, devices=None) -> Mesh:
  """A mesh with Auto axes (shard_map then reshards unsharded inputs as needed)."""
  devices = jax.devices() if devices is None else devices
  n = int(np.prod(shape))
  if len(devices) < n:
    pytest.skip(f"needs {n} devices, have {len(devices)}")
  return Mesh(np.asarray(devices[:n]).reshape(shape), names, axis_types=(AxisType.Auto,) * len(shape))


def mesh_of(shape, names, axis_types=AxisType.Explicit) -> Mesh:
  """jax.make_mesh over the first devices, Explicit axes by default (as jax.make_mesh does)."""
  n = int(np.prod(shape))
  if jax.device_count() < n:
    pytest.skip(f"needs {n} devices, have {jax.device_count()}")
  if isinstance(axis_types, AxisType):
    axis_types = (axis_types,) * len(shape)
  return jax.make_mesh(shape, names, axis_types, devices=jax.devices()[:n])


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-5):
  """Leaf-wise allclose, with atol relative to each expected leaf's largest magnitude."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert a.shape == e.shape and a.dtype == e.dtype
    a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol * max(1.0, np.abs(e).max()))


def load_script(path, name: str):
  """Imports a script that is not part of the package (examples/, benchmarks/) as a module."""
  import importlib.util
  import sys

  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses (flax modules) resolve annotations through it
  spec.loader.exec_module(module)
  return module


def write_trace(directory, events: list) -> None:
  """A jax.profiler-style trace (`plugins/profile/<run>/*.trace.json.gz`) under `directory`."""
  import gzip
  import json

  trace = directory / "plugins" / "profile" / "run" / "host.trace.json.gz"
  trace.parent.mkdir(parents=True)
  with gzip.open(trace, "wt") as f:
    json.dump({"traceEvents": events}, f)
