"""jaxflux.ops._ragged_exchange.ragged_all_to_all: on CPU (its all_to_all equivalent) against a
NumPy model of lax.ragged_all_to_all's contract, values and the operand's gradient, on random
ragged layouts; lowered for a GPU, the program holds XLA's ragged all-to-all and no other."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import make_mesh
from jaxflux.ops._ragged_exchange import ragged_all_to_all

RANKS, ROWS, WIDTH = 4, 7, 3


def layout(seed):
  """Per device: its operand [ROWS, WIDTH] and, per destination, an input offset and a size
  (chunks in a shuffled order, gaps between them); the output slot each sender's chunk takes
  at each receiver (sender i at i * ROWS, shifted by a random amount that keeps it inside)."""
  rng = np.random.default_rng(seed)
  operand = rng.standard_normal((RANKS, ROWS, WIDTH)).astype(np.float32)
  in_off = np.zeros((RANKS, RANKS), np.int32)
  sizes = np.zeros((RANKS, RANKS), np.int32)
  for d in range(RANKS):
    cuts = np.sort(rng.integers(0, ROWS + 1, RANKS + 1))
    for slot, j in enumerate(rng.permutation(RANKS)):  # destination j's chunk, in any order
      in_off[d, j], sizes[d, j] = cuts[slot], rng.integers(0, cuts[slot + 1] - cuts[slot] + 1)
  out_off = np.zeros((RANKS, RANKS), np.int32)  # [sender, receiver]
  for i in range(RANKS):
    for j in range(RANKS):
      out_off[i, j] = i * ROWS + rng.integers(0, ROWS - sizes[i, j] + 1)
  return operand, in_off, sizes, out_off


def model(operand, in_off, sizes, out_off, output):
  """Each receiver's output under lax.ragged_all_to_all's contract, in NumPy."""
  out = output.copy()
  for j in range(RANKS):
    for i in range(RANKS):
      chunk = operand[i, in_off[i, j]:in_off[i, j] + sizes[i, j]]
      out[j, out_off[i, j]:out_off[i, j] + sizes[i, j]] = chunk
  return out


def run(operand, in_off, sizes, out_off, output):
  """The exchange in a shard_map over RANKS devices, each holding its row of every array."""
  mesh = make_mesh((RANKS,), ("ep",))
  recv_sizes = sizes.T.copy()  # receiver j gets sizes[i, j] from sender i

  def local(operand, output, in_off, sizes, out_off, recv_sizes):
    return ragged_all_to_all(operand[0], output[0], in_off[0], sizes[0], out_off[0],
                             recv_sizes[0], axis="ep")[None]

  f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("ep"),) * 6, out_specs=P("ep")))
  args = (operand, output, in_off, sizes, out_off, recv_sizes)
  return f, tuple(jnp.asarray(a) for a in args)


@pytest.mark.parametrize("seed", range(4))
def test_matches_the_contract_and_its_transpose(seed):
  operand, in_off, sizes, out_off = layout(seed)
  output = np.random.default_rng(100 + seed).standard_normal(
      (RANKS, RANKS * ROWS, WIDTH)).astype(np.float32)  # rows no one writes keep these
  f, args = run(operand, in_off, sizes, out_off, output)
  want = model(operand, in_off, sizes, out_off, output)
  np.testing.assert_array_equal(np.asarray(f(*args)), want)

  # The operand's gradient: each row sent gets the cotangent of the place it landed.
  ct = np.random.default_rng(200 + seed).standard_normal(want.shape).astype(np.float32)
  grad = jax.grad(lambda op: jnp.sum(f(op, *args[1:]) * ct))(args[0])
  want_grad = np.zeros_like(operand)
  for j in range(RANKS):
    for i in range(RANKS):
      n = sizes[i, j]
      want_grad[i, in_off[i, j]:in_off[i, j] + n] += ct[j, out_off[i, j]:out_off[i, j] + n]
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-6, atol=1e-6)


def test_a_gpu_program_holds_the_ragged_all_to_all():
  """Lowered for CUDA (without a GPU: jax.export), the exchange is XLA's ragged all-to-all, and
  the CPU equivalent's all_to_all is gone."""
  operand, in_off, sizes, out_off = layout(0)
  f, args = run(operand, in_off, sizes, out_off, np.zeros((RANKS, RANKS * ROWS, WIDTH),
                                                          np.float32))
  exported = jax.export.export(
      f, platforms=("cuda",),
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")])(*args)
  text = exported.mlir_module()
  assert "@ragged_all_to_all" in text
  assert "all_to_all" not in text.replace("ragged_all_to_all", "")
