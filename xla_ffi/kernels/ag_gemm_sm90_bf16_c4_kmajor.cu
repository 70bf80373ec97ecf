// One instantiation of the fused AllGather+GEMM kernel with a K-major B (the weight given
// transposed, GemmProblem::b_kmajor; see ag_gemm_sm90.cuh).
#include "xla_ffi/kernels/ag_gemm_sm90.cuh"

JAXFLUX_AG_GEMM_INSTANCE(bf16_c4_kmajor, cutlass::bfloat16_t, Tiles4, KMajorB)
