// The own-rows GEMM of the fused GEMM+ReduceScatter, float16 (see rs_gemm_sm90.cuh).
#include "xla_ffi/kernels/rs_gemm_sm90.cuh"

JAXFLUX_RS_GEMM_INSTANCE(f16, cutlass::half_t)
