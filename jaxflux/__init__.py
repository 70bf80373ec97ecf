"""jaxflux: tensor-parallel matmuls with the collective hidden inside the GEMM (FLUX for JAX).

Ops (per-device view, inside `jax.shard_map`): `all_gather_matmul`, `matmul_reduce_scatter`,
`matmul_all_reduce`; `grouped_matmul`, the grouped GEMM of mixture-of-experts layers;
`all_gather_grouped_matmul` and `grouped_matmul_reduce_scatter`, the tensor-parallel
mixture-of-experts matmuls, routed by `moe_routing`.
Flax layers (global view, under `jit` with a mesh): `jaxflux.Dense` (Linen), `jaxflux.nnx.Linear`;
the mixture-of-experts MLP `jaxflux.MoE` (Linen), `jaxflux.nnx.MoE`.
Kernel choices: `jaxflux.tuning` (the measured table, and `override` for measurement).
"""
from jaxflux._runtime import check_errors, configure, has_cuda
from jaxflux import tuning
from jaxflux.ops import (FusedKernelUnavailableError, MoeRouting, all_gather_grouped_matmul,
                         all_gather_matmul, grouped_matmul, grouped_matmul_reduce_scatter,
                         matmul_all_reduce, matmul_reduce_scatter, moe_routing)

__version__ = "0.2.0"

__all__ = [
    "Dense",
    "FusedKernelUnavailableError",
    "MoE",
    "MoeRouting",
    "all_gather_grouped_matmul",
    "all_gather_matmul",
    "check_errors",
    "configure",
    "grouped_matmul",
    "grouped_matmul_reduce_scatter",
    "has_cuda",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "moe_routing",
    "nnx",
    "tuning",
]


def __getattr__(name):
  # The Flax layers import flax, which plain op users need not pay for at import time.
  if name == "Dense":
    from jaxflux.layers.linen import Dense
    return Dense
  if name == "MoE":
    from jaxflux.layers.moe_linen import MoE
    return MoE
  if name == "nnx":
    import importlib
    return importlib.import_module("jaxflux.nnx")
  raise AttributeError(f"module 'jaxflux' has no attribute {name!r}")
