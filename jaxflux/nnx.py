"""Flax NNX layers: `jaxflux.nnx.Linear`, `flax.nnx.Linear` with fused tensor-parallel matmuls,
and `jaxflux.nnx.MoE`, the mixture-of-experts MLP (both in `jaxflux/layers/`)."""
from jaxflux.layers.moe_nnx import MoE
from jaxflux.layers.nnx import Linear

__all__ = ["Linear", "MoE"]
