"""The tensor-parallel ops: the public ones (one module each) and their internal layers."""
from jaxflux.ops._common import FusedKernelUnavailableError
from jaxflux.ops.all_gather_matmul import all_gather_matmul
from jaxflux.ops.grouped_matmul import grouped_matmul
from jaxflux.ops.matmul_all_reduce import matmul_all_reduce
from jaxflux.ops.matmul_reduce_scatter import matmul_reduce_scatter
from jaxflux.ops.moe_matmul import all_gather_grouped_matmul, grouped_matmul_reduce_scatter
from jaxflux.ops.moe_routing import MoeRouting, moe_routing

__all__ = ["FusedKernelUnavailableError", "MoeRouting", "all_gather_grouped_matmul",
           "all_gather_matmul", "grouped_matmul", "grouped_matmul_reduce_scatter",
           "matmul_all_reduce", "matmul_reduce_scatter", "moe_routing"]
