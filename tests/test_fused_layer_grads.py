"""jax.grad of the layers' fused path traces at every group size: a column + row pair of
jaxflux.Dense with impl="fused" (bf16, fp16 and Flax's FP8 recipe; with and without sequence
parallelism, so all three ops; with and without a dp axis and logical axes) at tp 1, 2 and 8.

At tp=1 the fused ops run the GEMM-only target, whose result once came back typed without the
manual axes the custom_vjp expects, so the backward failed to trace on a one-GPU machine only.
The GPU is faked by patching the platform check; nothing here runs a kernel."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflux
from conftest import mesh_of
from jaxpr_util import equations


def _ffi_targets(jaxpr) -> list[str]:
  return [eqn.params["target_name"] for eqn in equations(jaxpr)
          if eqn.primitive.name == "ffi_call"]


class _Mlp(nn.Module):
  """Column then row, as a transformer's MLP; bias on, so the row layer's bias path runs too."""
  dtype: jnp.dtype
  fp8: bool
  sequence_parallel: bool
  logical: bool

  @nn.compact
  def __call__(self, x):
    kw = dict(dtype=self.dtype, param_dtype=self.dtype, impl="fused",
              sequence_parallel=self.sequence_parallel)
    if self.fp8:
      kw["dot_general_cls"] = nn.Fp8DirectDotGeneralOp
    column_init = row_init = nn.initializers.lecun_normal()
    if self.logical:
      column_init = nn.with_logical_partitioning(column_init, ("embed", "mlp"))
      row_init = nn.with_logical_partitioning(row_init, ("mlp", "embed"))
    h = jaxflux.Dense(128, tensor_parallel="column", kernel_init=column_init, **kw)(x)
    return jaxflux.Dense(64, tensor_parallel="row", kernel_init=row_init, **kw)(nn.gelu(h))


DTYPES = {"bf16": (jnp.bfloat16, False), "fp16": (jnp.float16, False),
          "fp8": (jnp.bfloat16, True)}


@pytest.mark.parametrize("logical", [False, True], ids=["plain", "logical"])
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "replicated"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("dp,tp", [(1, 1), (2, 1), (1, 2), (2, 2), (1, 8)])
def test_grad_of_the_fused_layers_traces(fake_hopper, dp, tp, dtype, sequence_parallel, logical):
  compute, fp8 = DTYPES[dtype]
  model = _Mlp(compute, fp8, sequence_parallel, logical)
  mesh = mesh_of((dp, tp), ("dp", "tp"))
  rules = (("embed", None), ("mlp", "tp"))
  x = np.random.default_rng(0).standard_normal((2 * dp, 64, 64)).astype(np.float32)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    variables = jax.eval_shape(model.init, jax.random.key(0), x)

    def loss(variables, x):
      return jnp.sum(model.apply(variables, x).astype(jnp.float32))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(variables, x)
  targets = _ffi_targets(jaxpr)
  if tp == 1:  # no communication: each op is the GEMM-only target
    # SP: forward AG + RS, backward RS + AG; replicated: forward AR (the backward is XLA's).
    assert targets == ["jaxflux_gemm"] * (4 if sequence_parallel else 1), targets
  elif sequence_parallel:
    assert sorted(targets) == sorted(["jaxflux_all_gather_matmul",
                                      "jaxflux_matmul_reduce_scatter"] * 2), targets
  else:  # column without SP needs no communication; row ends in GEMM+AllReduce
    assert targets == ["jaxflux_matmul_all_reduce"], targets
