"""The reference path compiles to exactly the expected collectives: one all-gather or one
reduce-scatter per op forward, and the expected pair in the backward pass."""
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jaxflux
from conftest import make_mesh
from hlo_util import count_collectives


def compiled_text(f, *args) -> str:
  return jax.jit(f).lower(*args).compile().as_text()


def sharded(mesh, op, **kw):
  if op == "ag":
    specs = dict(in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp"))
    body = functools.partial(jaxflux.all_gather_matmul, axis_name="tp", impl="xla", **kw)
  else:
    specs = dict(in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None))
    body = functools.partial(jaxflux.matmul_reduce_scatter, axis_name="tp", impl="xla", **kw)
  return jax.shard_map(body, mesh=mesh, **specs)


def test_forward_collectives():
  mesh = make_mesh((4,), ("tp",))
  x, w = jnp.ones((32, 16)), jnp.ones((16, 32))
  assert count_collectives(compiled_text(sharded(mesh, "ag"), x, w)) == {"all-gather": 1}
  assert count_collectives(compiled_text(sharded(mesh, "rs"), x, w)) == {"reduce-scatter": 1}


def test_backward_collectives():
  """value_and_grad of AG+GEMM = all-gather (fwd, reused for dW) + reduce-scatter (dX);
  GEMM+RS = reduce-scatter (fwd) + all-gather (dX, reused for dW): no extra collective."""
  mesh = make_mesh((4,), ("tp",))
  x, w = jnp.ones((32, 16)), jnp.ones((16, 32))
  # The one all-reduce sums the scalar loss over devices.
  for op, expected in (("ag", {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 1}),
                       ("rs", {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 1})):
    f = sharded(mesh, op)
    # A cotangent that is an argument, not a constant XLA could fold through the collectives.
    grad = jax.value_and_grad(lambda x, w, r, f=f: jnp.sum(f(x, w) * r), argnums=(0, 1))
    assert count_collectives(compiled_text(grad, x, w, jnp.ones((32, 32)))) == expected, op
