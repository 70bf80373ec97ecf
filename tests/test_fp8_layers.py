"""jaxflux.Dense with Flax's FP8 recipe (dot_general_cls=nn.Fp8DirectDotGeneralOp or
nn.Fp8DotGeneralOp) against flax.linen.Dense with the same class, on virtual CPU devices
(impl="xla"), over a few SGD steps.

Each step the `_overwrite_with_gradient` variables are overwritten with their "gradients" (their
new values), as Flax's FP8 users do. Two comparisons per step:

- From the same state (flax's): the six variables' updates are Flax's bit for bit (the amax is
  a max, exact under any sharding, and the scale arithmetic is Flax's own functions), and since
  both layers then quantize to the same FP8 values, outputs and gradients differ only by how the
  FP8 products are accumulated and scaled: float32 to ~1e-6, bfloat16 by a few bfloat16 ulps
  (Flax rounds its FP8 dot to bfloat16 and then multiplies by a bfloat16-rounded scale).
- Along each layer's own trajectory: after a step the params differ by that rounding, so an
  element near an FP8 rounding boundary may quantize one FP8 step apart; the params, scales and
  histories after STEPS steps agree within FP8 rounding (see TRAJECTORY_TOL).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxflux
from conftest import mesh_of

# Flax deprecates nn.Fp8DotGeneralOp (in favour of Fp8DirectDotGeneralOp); still supported.
pytestmark = pytest.mark.filterwarnings("ignore:The Fp8DotGeneralOp is deprecated")

OWG = "_overwrite_with_gradient"
DIRECT, QDQ = nn.Fp8DirectDotGeneralOp, nn.Fp8DotGeneralOp
STEPS, LR = 5, 0.05
SHAPE, FEATURES = (2, 8, 16), 32  # x [batch, tokens, in], out features
# Same state: float32 differs by accumulation order only (seen: 2e-7); bfloat16 by a few ulps
# of 2^-8 (seen: 9e-3, Flax rounding its FP8 dot and its scale to bfloat16 before
# multiplying), relative to the largest magnitude.
SAME_STATE_TOL = {"float32": 1e-5, "bfloat16": 2e-2}
# Own trajectories, relative to the largest magnitude (the scales and histories: to each value).
# Seen: float32 1e-7, bfloat16 4e-4 (these seeds flip no FP8 rounding). The bound allows a few
# elements near a rounding boundary to quantize one FP8 step apart along the way (an e4m3 step
# is 2^-3 of the value; one of 16 products in a sum, scaled by the step size LR).
TRAJECTORY_TOL = {"float32": 1e-3, "bfloat16": 1e-2}

def normal(seed, shape, scale=1.0):
  # NumPy, not jax.random: eager jax ops each compile, which dominates a CPU test run.
  return np.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, np.float32)


def batch(step):
  """Fresh data per step: x with amax ~10 (so the e4m3 scale moves off 1) and a small
  output gradient r = dL/dy (so the e5m2 scale does too)."""
  return normal(100 + step, SHAPE, 3.0), normal(200 + step, SHAPE[:-1] + (FEATURES,), 1e-2)


def make_dense(cls, dtype, **tp):
  """flax.linen.Dense, or jaxflux.Dense with tensor-parallel fields `tp`; a random bias."""
  if tp:
    return jaxflux.Dense(FEATURES, dtype=dtype, dot_general_cls=cls, impl="xla",
                         bias_init=nn.initializers.normal(1.0), **tp)
  return nn.Dense(FEATURES, dtype=dtype, dot_general_cls=cls,
                  bias_init=nn.initializers.normal(1.0))


def train_step(module):
  """(new variables, y, d/dx, all variable gradients) of loss sum(y * r), one SGD step on
  the params, the FP8 variables overwritten with their gradients."""

  def step(variables, x, r):
    def loss(variables, x):
      y = module.apply(variables, x)
      return jnp.sum(y.astype(jnp.float32) * r), y

    (_, y), (grads, dx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(variables, x)
    params = jax.tree.map(lambda p, g: p - LR * g, variables["params"], grads["params"])
    return {"params": params, OWG: grads[OWG]}, y, dx, grads

  return jax.jit(step)


@functools.cache
def flax_run(cls, dtype):
  """flax.linen.Dense's trajectory: per step (state before it, step outputs), host arrays."""
  module = make_dense(cls, dtype)
  x0, _ = batch(0)
  variables = jax.device_get(nn.unbox(module.init(jax.random.key(0), x0)))
  step, states, outs = train_step(module), [variables], []
  for t in range(STEPS):
    out = jax.device_get(step(states[-1], *batch(t)))
    states.append(out[0])
    outs.append(out)
  return states, outs


def assert_close(actual, expected, tol, what):
  assert jax.tree.structure(actual) == jax.tree.structure(expected), what
  for path, a, e in zip(jax.tree.leaves_with_path(actual), jax.tree.leaves(actual),
                        jax.tree.leaves(expected)):
    assert a.dtype == e.dtype, (what, path[0])
    a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
    np.testing.assert_allclose(a, e, rtol=0, atol=tol * np.abs(e).max(),
                               err_msg=f"{what} {jax.tree_util.keystr(path[0])}")


def assert_equal(actual, expected, what):
  assert jax.tree.structure(actual) == jax.tree.structure(expected), what
  for path, a, e in zip(jax.tree.leaves_with_path(actual), jax.tree.leaves(actual),
                        jax.tree.leaves(expected)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e),
                                  err_msg=f"{what} {jax.tree_util.keystr(path[0])}")


def check_against_flax(mesh, mode, cls, dtype, *, data_spec=P(), sequence_parallel=True):
  states, ref_outs = flax_run(cls, jnp.dtype(dtype).name)
  module = make_dense(cls, dtype, tensor_parallel=mode, sequence_parallel=sequence_parallel)
  same_tol, traj_tol = SAME_STATE_TOL[jnp.dtype(dtype).name], TRAJECTORY_TOL[jnp.dtype(dtype).name]
  with jax.set_mesh(mesh):
    step = train_step(module)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, data_spec))
    own = states[0]
    for t in range(STEPS):
      x, r = map(put, batch(t))
      # From flax's state: the same variables, the same FP8 updates bit for bit.
      new, y, dx, grads = jax.device_get(step(states[t], x, r))
      ref_new, ref_y, ref_dx, ref_grads = ref_outs[t]
      assert_equal(grads[OWG], ref_grads[OWG], f"step {t} FP8 variables")
      assert_close((y, dx, grads["params"]), (ref_y, ref_dx, ref_grads["params"]), same_tol,
                   f"step {t} (y, dx, param grads)")
      own = jax.device_get(step(own, x, r)[0])
  # Along its own trajectory, within FP8 rounding of flax's.
  assert_close(own["params"], states[-1]["params"], traj_tol, "params after training")
  for name, value in own[OWG][f"{cls.__name__}_0"].items():
    ref = states[-1][OWG][f"{cls.__name__}_0"][name]
    np.testing.assert_allclose(value, ref, rtol=traj_tol, atol=0, err_msg=name)
  # The variables did move: the histories hold STEPS amaxes, the scales left 1.
  assert np.count_nonzero(own[OWG][f"{cls.__name__}_0"]["kernel_amax_history"]) == STEPS
  assert own[OWG][f"{cls.__name__}_0"]["input_scale"][0] < 0.1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cls", [DIRECT, QDQ], ids=["direct", "qdq"])
@pytest.mark.parametrize("mode", ["column", "row"])
def test_matches_flax_tp2(mode, cls, dtype):
  check_against_flax(mesh_of((2,), ("tp",)), mode, cls, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cls", [DIRECT, QDQ], ids=["direct", "qdq"])
@pytest.mark.parametrize("mode", ["column", "row"])
def test_matches_flax_dp_by_tp(mode, cls, dtype):
  """Batch sharded over an Explicit dp axis: the amax is still the global one (pmax over dp
  and tp), the kernel's gradient summed over dp."""
  mesh = mesh_of((2, 2), ("dp", "tp"), (AxisType.Explicit, AxisType.Auto))
  check_against_flax(mesh, mode, cls, dtype, data_spec=P("dp"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["column", "row"])
def test_matches_flax_without_sequence_parallel(mode, dtype):
  """Tokens replicated: local FP8 dots (column), the FP8 matmul_all_reduce (row)."""
  mesh = mesh_of((2, 2), ("dp", "tp"), (AxisType.Explicit, AxisType.Auto))
  check_against_flax(mesh, mode, DIRECT, dtype, data_spec=P("dp"), sequence_parallel=False)


@pytest.mark.parametrize("mode,cls", [("row", DIRECT), ("row", QDQ), ("column", DIRECT)],
                         ids=["row-direct", "row-qdq", "column-direct"])
def test_without_sequence_parallel_the_row_forward_is_the_fp8_all_reduce(monkeypatch, mode, cls):
  """Tokens replicated over tp=4: a row layer's forward sums its partials through one FP8
  jaxflux.matmul_all_reduce per call (e4m3 x and weight, the weight K-major, both scales); a
  column layer's through none. Both still match flax.linen.Dense."""
  calls = []
  real = jaxflux.ops.matmul_all_reduce

  def spy(x, w, axis_name, **kw):
    calls.append((jnp.dtype(x.dtype), jnp.dtype(w.dtype), tuple(w.shape), axis_name,
                  kw.get("transpose_w"), kw.get("x_scale") is not None,
                  kw.get("w_scale") is not None))
    return real(x, w, axis_name, **kw)

  monkeypatch.setattr(jaxflux.ops, "matmul_all_reduce", spy)
  check_against_flax(mesh_of((4,), ("tp",)), mode, cls, "bfloat16", sequence_parallel=False)
  if mode == "column":
    assert calls == []
  else:
    e4m3 = jnp.dtype(jnp.float8_e4m3fn)
    assert calls and set(calls) == {(e4m3, e4m3, (FEATURES, SHAPE[-1] // 4), "tp", True, True,
                                     True)}, calls


def test_same_variables_and_submodule_as_flax():
  """The submodule flax.linen.Dense creates (class, name), its six variables, and the params;
  the params boxed with their tensor-parallel partitioning, the FP8 variables replicated."""
  x = normal(0, SHAPE)
  ref = jax.eval_shape(make_dense(DIRECT, None).init, jax.random.key(0), x)
  with jax.set_mesh(mesh_of((2,), ("tp",))):
    ours = jax.eval_shape(make_dense(DIRECT, None, tensor_parallel="column").init,
                          jax.random.key(0), x)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), nn.unbox(ours)) == \
      jax.tree.map(lambda a: (a.shape, a.dtype), ref)
  assert sorted(ours[OWG]["Fp8DirectDotGeneralOp_0"]) == sorted(
    ["input_scale", "kernel_scale", "output_grad_scale", "input_amax_history",
     "kernel_amax_history", "output_grad_amax_history"])
  assert nn.get_partition_spec(ours)["params"]["kernel"] == P(None, "tp")


def test_fm32_variables_match_flax():
  """Flax's `fm32` meta dtype (gradients accumulate by max, for a layer applied several times)
  passes through: the variables' gradients are Flax's, in that dtype."""
  from flax.linen import fp8_ops

  def as_fm32(variables):
    meta = jax.tree.map(lambda a: jax.lax.convert_element_type(a, fp8_ops.fm32), variables[OWG])
    return {"params": variables["params"], OWG: meta}

  def grads(module, variables, x, r):
    loss = lambda v: jnp.sum(module.apply(as_fm32(v), x).astype(jnp.float32) * r)
    return jax.device_get(jax.jit(jax.grad(loss))(variables))

  states, _ = flax_run(DIRECT, "float32")
  x, r = batch(1)
  ref = grads(make_dense(DIRECT, None), states[1], x, r)
  with jax.set_mesh(mesh_of((2,), ("tp",))):
    ours = grads(make_dense(DIRECT, None, tensor_parallel="row"), states[1], x, r)
  assert_equal(ours[OWG], ref[OWG], "FP8 variables")
  assert_close(ours["params"], ref["params"], SAME_STATE_TOL["float32"], "param grads")


class _NotFp8(nn.Module):
  def __call__(self, *args, **kwargs):
    return jax.lax.dot_general(*args)


class _Nanoo(DIRECT):
  e4m3_dtype = jnp.float8_e4m3fnuz
  e5m2_dtype = jnp.float8_e5m2fnuz


@pytest.mark.parametrize("kwargs, match", [
  (dict(dot_general_cls=_NotFp8), r"dot_general_cls='_NotFp8'.*only dot_general_cls.*"
   r"Fp8DirectDotGeneralOp"),
  (dict(dot_general_cls=nn.Fp8Einsum), r"Fp8Einsum.*only dot_general_cls"),
  (dict(dot_general_cls=_Nanoo), r"e4m3_dtype=float8_e4m3fnuz.*float8_e4m3fn"),
  (dict(dot_general=jax.lax.dot_general), r"dot_general function.*tensor_parallel=None.*"
   r"dot_general_cls=nn.Fp8DirectDotGeneralOp"),
])
@pytest.mark.parametrize("mode", ["column", "row"])
def test_unsupported_dot_general_raises_at_construction(mode, kwargs, match):
  with pytest.raises(ValueError, match=match):
    jaxflux.Dense(8, tensor_parallel=mode, **kwargs)
  jaxflux.Dense(8, **kwargs)  # tensor_parallel=None: flax.linen.Dense's rules


def test_train_step_collectives():
  """The FP8 training step of a column + row pair moves its tensors as the bfloat16 one does:
  one all-gather and one reduce-scatter per layer each way (the column layer's dW reuses the
  forward's gathered FP8 input, the row layer's the gathered FP8 output gradient), plus
  all-reduces (pmax) that make the amaxes global. Not counted: the XLA reference path's
  all-gather of the per-row x_scale [..., m, 1] next to each gathered FP8 operand (the fused
  kernels take the scales as arguments)."""
  import re

  class MLP(nn.Module):
    cls: type | None

    @nn.compact
    def __call__(self, x):
      kw = dict(dot_general_cls=self.cls, dtype=jnp.bfloat16, impl="xla")
      h = jaxflux.Dense(32, tensor_parallel="column", **kw)(x)
      return jaxflux.Dense(16, tensor_parallel="row", **kw)(nn.gelu(h))

  def collectives(cls):
    model, x, r = MLP(cls), normal(0, SHAPE), normal(1, SHAPE)
    loss = lambda v, x: jnp.sum(model.apply(v, x).astype(jnp.float32) * r)
    with jax.set_mesh(mesh_of((2,), ("tp",))):
      variables = jax.jit(model.init)(jax.random.key(0), x)
      step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
      hlo = step.lower(variables, x).compile().as_text()
    # Per collective instruction (async starts counted once), its op and result shape.
    counts = {}
    for line in hlo.splitlines():
      found = re.search(r"= (.*) (all-gather|reduce-scatter|all-reduce|all-to-all|"
                        r"collective-permute)(?:-start)?\(", line)
      if found and not (found[2] == "all-gather" and re.search(r",1\]", found[1])):
        counts[found[2]] = counts.get(found[2], 0) + 1
    return counts

  bf16, fp8 = collectives(None), collectives(DIRECT)
  moves = lambda counts: {k: v for k, v in counts.items() if k != "all-reduce"}
  assert moves(bf16) == moves(fp8) == {"all-gather": 2, "reduce-scatter": 2}, (bf16, fp8)
  # Both sum the row layer's replicated bias gradient; FP8 adds the amaxes of x, kernel and dY
  # of two layers: six pmaxes, which XLA may combine.
  assert 1 <= fp8.get("all-reduce", 0) - bf16.get("all-reduce", 0) <= 6, (bf16, fp8)
