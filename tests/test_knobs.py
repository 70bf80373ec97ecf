"""The kernels' environment variables are checked at trace time (jaxflux/_knobs.py): the C++
parsers fall back to their defaults on a value they do not know, so without the check a typo
would silently measure the default."""
import pathlib
import re

import pytest

import jax.numpy as jnp

from jaxflux import _knobs, _runtime
from jaxflux.ops import _common, all_gather, gemm

DESIGN = pathlib.Path(__file__).resolve().parents[1] / "docs" / "design.md"


@pytest.mark.parametrize("name,value", [
    ("JAXFLUX_GEMM_RS_REDUCE", "epilog"), ("JAXFLUX_GEMM_RS_PUSH", "chunks"),
    ("JAXFLUX_GEMM_RS_SCHEDULE", "ping-pong"), ("JAXFLUX_AG_GEMM_CONFIG", "4"),
    ("JAXFLUX_AG_GEMM_CONFIG", "coop"), ("JAXFLUX_GEMM_SWIZZLE", "3"),
    ("JAXFLUX_GEMM_RS_SWIZZLE", "16"), ("JAXFLUX_GEMM_PLAIN_SWIZZLE", "x"),
    ("JAXFLUX_GEMM_SMS", "0"), ("JAXFLUX_AG_MAX_CHUNKS", "5"), ("JAXFLUX_AG_ABLATE", "push,gemm"),
    ("JAXFLUX_AG_GEMM_LOCAL", "direct-ish"), ("JAXFLUX_RANK_CACHE", "global"),
    ("JAXFLUX_GEMM_RS_REDUCE", "epilogue "), ("JAXFLUX_GEMM_SMS", "1_00")])
def test_a_bad_value_names_the_variable_what_it_takes_and_the_fix(name, value):
  with pytest.raises(ValueError) as err:
    _knobs.check_environment("matmul_reduce_scatter", {name: value})
  message = str(err.value)
  assert message.startswith("matmul_reduce_scatter:")
  assert f"{name}={value!r}" in message and _knobs.KNOBS[name].accepts in message
  assert f"unset {name}" in message


@pytest.mark.parametrize("name,value", [
    ("JAXFLUX_GEMM_RS_REDUCE", "pass"), ("JAXFLUX_GEMM_RS_REDUCE", "epilogue"),
    ("JAXFLUX_GEMM_RS_PUSH", "copy"), ("JAXFLUX_GEMM_RS_SCHEDULE", "pingpong"),
    ("JAXFLUX_AG_GEMM_CONFIG", "3"), ("JAXFLUX_GEMM_SWIZZLE", "8"), ("JAXFLUX_GEMM_SMS", "100"),
    ("JAXFLUX_AG_MAX_CHUNKS", "1"), ("JAXFLUX_AG_ABLATE", "push,recv"),
    ("JAXFLUX_RANK_CACHE", "site"), ("JAXFLUX_GEMM_RS_SCHEDULE", ""),
    ("JAXFLUX_AG_ABLATE", "none"), ("JAXFLUX_AG_ABLATE", "push, local"),
    ("JAXFLUX_GEMM_RS_SWIZZLE", "1"), ("JAXFLUX_GEMM_PLAIN_SWIZZLE", "4"),
    ("JAXFLUX_AG_GEMM_LOCAL", "copy"), ("JAXFLUX_GEMM_RS_PUSH", "split")])
def test_the_values_the_kernels_take_pass(name, value):
  _knobs.check_environment("op", {name: value})


def test_the_check_reads_the_process_environment(monkeypatch):
  monkeypatch.delenv("JAXFLUX_GEMM_RS_REDUCE", raising=False)
  _knobs.check_environment("op")
  monkeypatch.setenv("JAXFLUX_GEMM_RS_REDUCE", "bogus")
  with pytest.raises(ValueError, match="JAXFLUX_GEMM_RS_REDUCE='bogus'"):
    _knobs.check_environment("op")


def test_every_communicating_call_checks_before_it_starts(monkeypatch):
  """call_group_op (every fused op's FFI call) checks first: here, outside any mesh axis, the
  knob's error comes before anything else could fail."""
  monkeypatch.setenv("JAXFLUX_AG_GEMM_CONFIG", "9")
  with pytest.raises(ValueError, match="all_gather_matmul: environment variable "
                                       "JAXFLUX_AG_GEMM_CONFIG='9'"):
    all_gather.call_group_op("all_gather_matmul", (), (), "tp", 0)


@pytest.mark.parametrize("call", [
    lambda x, w: gemm.gemm(x, w), lambda x, w: gemm.gemm_own_rows(x, w, x[:, :16])])
def test_the_single_gpu_gemms_check_before_they_register(monkeypatch, call):
  """The GEMM-only ops (gemm._kernel_call) check too, once the platform could run them: with
  the platform check faked, the knob's error comes before the FFI targets are registered."""
  monkeypatch.setattr(_common, "platform_reason", lambda axis_name=None: None)
  registered = []
  monkeypatch.setattr(_runtime, "register_targets", lambda: registered.append(True))
  monkeypatch.setenv("JAXFLUX_GEMM_PLAIN_SWIZZLE", "3")
  x, w = jnp.ones((32, 64), jnp.bfloat16), jnp.ones((64, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"^gemm(_own_rows)?: environment variable "
                                       "JAXFLUX_GEMM_PLAIN_SWIZZLE='3'"):
    call(x, w)
  assert not registered


@pytest.mark.parametrize("value,cache", [(None, "state"), ("", "state"), ("site", "site"),
                                         ("state", "state")])
def test_the_rank_cache_setting_reads_unset_and_empty_as_the_default(monkeypatch, value, cache):
  """JAXFLUX_RANK_CACHE, read by the runtime's settings: empty is the default, as the check
  takes it (an empty value once chose the site cache)."""
  if value is None:
    monkeypatch.delenv("JAXFLUX_RANK_CACHE", raising=False)
  else:
    monkeypatch.setenv("JAXFLUX_RANK_CACHE", value)
  assert _runtime._Settings().rank_cache == cache


def test_the_knobs_are_the_documented_ones():
  """docs/design.md's table of environment variables and KNOBS list the same kernel knobs."""
  documented = set(re.findall(r"^\| `(JAXFLUX_\w+)`", DESIGN.read_text(), re.M))
  not_checked = {"JAXFLUX_CUDA", "JAXFLUX_DEBUG", "JAXFLUX_BENCH_WINDOWED_ON_CPU"}  # build, log, bench
  assert documented - not_checked == set(_knobs.KNOBS)
