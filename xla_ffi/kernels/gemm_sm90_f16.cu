// fp16 instantiation of the sm90 GEMM (see gemm_sm90.cuh).
#include "xla_ffi/kernels/gemm_sm90.cuh"

namespace jaxflux {

size_t GemmSm90WorkspaceBytesF16(const GemmProblem& problem) {
  return gemm_sm90::WorkspaceBytes<cutlass::half_t>(problem);
}

const char* GemmSm90F16(const GemmProblem& problem, void* workspace, cudaStream_t stream) {
  return gemm_sm90::Run<cutlass::half_t>(problem, workspace, stream);
}

}  // namespace jaxflux
