"""A program of the tp=1 kernels works with JAX's persistent compilation cache: a second process
compiles nothing it can load, and computes the same bits. (Their HLO holds no process state: the
workspace is a result sized by the module from the shapes and attributes alone.)"""
import pytest

from test_command_buffers_gpu import run_worker


@pytest.mark.gpu
@pytest.mark.slow
def test_a_second_process_hits_the_cache_and_computes_the_same_bits(tmp_path):
  cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
  first = run_worker("", seed=5, **cache)
  assert any((tmp_path / "cache").iterdir()), "the first process wrote no cache entry"
  second = run_worker("", seed=5, **cache)
  # (The first process may load its own second compilation of the step from the cache too.)
  assert second["cache_hits"] > first["cache_hits"], (first, second)
  assert len(second["digests"]) == 1 and second["digests"] == first["digests"]
  for target, calls in second["calls_per_run"].items():
    assert calls >= 2, (target, calls)  # the loaded program still runs the kernels
