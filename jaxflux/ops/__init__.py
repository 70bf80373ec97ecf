"""The tensor-parallel ops: the public ones (one module each) and their internal layers."""
from jaxflux.ops._common import FusedKernelUnavailableError
from jaxflux.ops.all_gather_matmul import all_gather_matmul
from jaxflux.ops.grouped_matmul import grouped_matmul
from jaxflux.ops.matmul_all_reduce import matmul_all_reduce
from jaxflux.ops.matmul_reduce_scatter import matmul_reduce_scatter

__all__ = ["FusedKernelUnavailableError", "all_gather_matmul", "grouped_matmul",
           "matmul_all_reduce", "matmul_reduce_scatter"]
