// bf16 instantiation of the sm90 GEMM (see gemm_sm90.cuh) and the dtype dispatch.
#include "xla_ffi/kernels/gemm_sm90.cuh"

namespace jaxflux {

// Defined in gemm_sm90_f16.cu.
size_t GemmSm90WorkspaceBytesF16(const GemmProblem& problem);
const char* GemmSm90F16(const GemmProblem& problem, void* workspace, cudaStream_t stream);

size_t GemmSm90WorkspaceBytes(GemmDtype dtype, const GemmProblem& problem) {
  if (dtype == GemmDtype::kF16) return GemmSm90WorkspaceBytesF16(problem);
  return gemm_sm90::WorkspaceBytes<cutlass::bfloat16_t>(problem);
}

const char* GemmSm90(GemmDtype dtype, const GemmProblem& problem, void* workspace,
                     cudaStream_t stream) {
  if (dtype == GemmDtype::kF16) return GemmSm90F16(problem, workspace, stream);
  return gemm_sm90::Run<cutlass::bfloat16_t>(problem, workspace, stream);
}

}  // namespace jaxflux
