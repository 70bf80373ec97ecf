// bf16 instantiation of the fused AllGather+GEMM (see ag_gemm_sm90.cuh) and the dtype dispatch.
#include "xla_ffi/kernels/ag_gemm_sm90.cuh"

namespace jaxflux {

// Defined in ag_gemm_sm90_f16.cu.
size_t AgGemmSm90WorkspaceBytesF16(const AgGemmProblem& problem);
const char* AgGemmSm90F16(const AgGemmProblem& problem, void* workspace, cudaStream_t stream);

size_t AgGemmSm90WorkspaceBytes(GemmDtype dtype, const AgGemmProblem& problem) {
  if (dtype == GemmDtype::kF16) return AgGemmSm90WorkspaceBytesF16(problem);
  return ag_gemm_sm90::WorkspaceBytes<cutlass::bfloat16_t>(problem);
}

const char* AgGemmSm90(GemmDtype dtype, const AgGemmProblem& problem, void* workspace,
                       cudaStream_t stream) {
  if (dtype == GemmDtype::kF16) return AgGemmSm90F16(problem, workspace, stream);
  return ag_gemm_sm90::Run<cutlass::bfloat16_t>(problem, workspace, stream);
}

}  // namespace jaxflux
