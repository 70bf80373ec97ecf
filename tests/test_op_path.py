"""An op call is one path, easy to follow: from `jaxflux.all_gather_matmul`, x goes through the
checks into a plan, then the reference or the fused call, without wandering back and forth
between modules. Measured by following x: the jaxflux functions called with x (or an array of
x's shape and dtype: the tracers jax makes for it) as an argument, in call order, while the
call traces. A "return" is a call into a module the path had already left.

The GPU is faked by patching the platform check; nothing here runs a kernel."""
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxflux
from conftest import make_mesh

MAX_RETURNS = 2


def follow(fn, args, x_shape, x_dtype) -> list[tuple[str, str]]:
  """(module, function) of each jaxflux call taking an array of x's per-device shape and dtype,
  while fn(*args) traces."""
  stops = []

  def profile(frame, event, _):
    if event != "call" or not frame.f_globals.get("__name__", "").startswith("jaxflux"):
      return
    for value in frame.f_locals.values():
      if getattr(value, "shape", None) == x_shape and getattr(value, "dtype", None) == x_dtype:
        stops.append((frame.f_globals["__name__"], frame.f_code.co_name))
        return

  sys.setprofile(profile)
  try:
    jax.make_jaxpr(fn)(*args)
  finally:
    sys.setprofile(None)
  return stops


def returns(stops) -> list[str]:
  """The modules entered again after the path had left them."""
  seen, again, previous = set(), [], None
  for module, _ in stops:
    if module != previous and module in seen:
      again.append(module)
    seen.add(module)
    previous = module
  return again


CASES = {  # name: (x dtype, w dtype, kwargs)
    "bf16": (jnp.bfloat16, jnp.bfloat16, {}),
    "bf16-return_gathered": (jnp.bfloat16, jnp.bfloat16, {"return_gathered": True}),
    "fp8": (jnp.float8_e4m3fn, jnp.float8_e4m3fn,
            {"transpose_w": True, "x_scale": jnp.float32(0.5), "w_scale": jnp.float32(2.0)}),
}


@pytest.mark.parametrize("impl", ["fused", "xla"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_x_returns_to_a_module_it_left_at_most_twice(fake_hopper, case, tp, impl):
  x_dtype, w_dtype, kwargs = CASES[case]
  mesh = make_mesh((tp,), ("tp",))
  x = jnp.ones((3, 48 * tp, 80), x_dtype)  # per device [3, 48, 80]
  w_shape = (32 * tp, 80) if kwargs.get("transpose_w") else (80, 32 * tp)
  w = jnp.ones(w_shape, w_dtype)
  w_spec = P("tp") if kwargs.get("transpose_w") else P(None, "tp")
  out_specs = P(None, None, "tp")
  if kwargs.get("return_gathered"):
    out_specs = (out_specs, P(None, None, None))

  def local(x, w):
    return jaxflux.all_gather_matmul(x, w, "tp", impl=impl, **kwargs)

  f = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "tp"), w_spec), out_specs=out_specs,
                    check_vma=not kwargs.get("return_gathered"))
  stops = follow(f, (x, w), (3, 48, 80), jnp.dtype(x_dtype))
  modules = [m for m, _ in stops]
  assert modules[0] == "jaxflux.ops.all_gather_matmul", stops
  # The path reaches the implementation it resolved: the fused call or the reference.
  assert ("jaxflux.ops._fused" in modules) == (impl == "fused"), stops
  again = returns(stops)
  assert len(again) <= MAX_RETURNS, (again, stops)


def test_returns_counts_reentries_only():
  stops = [("a", "f"), ("b", "g"), ("b", "h"), ("c", "i"), ("a", "j"), ("b", "k")]
  assert returns(stops) == ["a", "b"]
