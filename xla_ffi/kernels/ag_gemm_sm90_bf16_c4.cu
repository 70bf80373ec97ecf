// One instantiation of the fused AllGather+GEMM kernel (see ag_gemm_sm90.cuh).
#include "xla_ffi/kernels/ag_gemm_sm90.cuh"

JAXFLUX_AG_GEMM_INSTANCE(bf16_c4, cutlass::bfloat16_t, Tiles4, NMajorB)
