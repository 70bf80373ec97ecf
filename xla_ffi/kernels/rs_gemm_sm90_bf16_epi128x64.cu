// The own-rows GEMM of the fused GEMM+ReduceScatter, bfloat16, with a 128x64 epilogue sub-tile:
// an experiment (JAXFLUX_GEMM_RS_EPILOGUE_TILE=128x64, rs_gemm_sm90_dispatch.cu). Four C
// stages of 128x64 prefetch a whole 128x256 tile of the peer's partial (the automatic 128x32
// sub-tile prefetches half of it), at the price of one mainloop stage (3 instead of 4).
#include "xla_ffi/kernels/rs_gemm_sm90.cuh"

using RsEpilogueTile128x64 = cute::Shape<cute::_128, cute::_64>;  // (a comma-free macro argument)
JAXFLUX_RS_GEMM_INSTANCE(bf16_epi128x64, cutlass::bfloat16_t, RsEpilogueTile128x64)
