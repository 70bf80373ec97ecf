// fp16 instantiation of the fused AllGather+GEMM (see ag_gemm_sm90.cuh).
#include "xla_ffi/kernels/ag_gemm_sm90.cuh"

namespace jaxflux {

size_t AgGemmSm90WorkspaceBytesF16(const AgGemmProblem& problem) {
  return ag_gemm_sm90::WorkspaceBytes<cutlass::half_t>(problem);
}

const char* AgGemmSm90F16(const AgGemmProblem& problem, void* workspace, cudaStream_t stream) {
  return ag_gemm_sm90::Run<cutlass::half_t>(problem, workspace, stream);
}

}  // namespace jaxflux
