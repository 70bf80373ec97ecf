"""The Flax layers (global view, under `jit` with a mesh), above the ops: the dense layers
`linen.Dense` and `nnx.Linear` on the tensor-parallel matmul (`_tensor_parallel`, with Flax's
FP8 recipe per device in `_fp8_recipe`), the mixture-of-experts MLPs `moe_linen.MoE` and
`moe_nnx.MoE` on the grouped GEMM (`_moe`), and what both kinds share (`_layer_mesh`).

Users reach them as `jaxflux.Dense`, `jaxflux.MoE` and `jaxflux.nnx.Linear` /
`jaxflux.nnx.MoE`; nothing is imported here, so that plain op users never import Flax.
"""
