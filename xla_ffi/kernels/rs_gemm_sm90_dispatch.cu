// Dispatch of the fused GEMM+ReduceScatter's own-rows GEMM over the element type, to the
// instantiations in instantiations/rs_gemm_sm90_*.cu. No CUTLASS here (compiles fast).
#include "xla_ffi/kernels/rs_gemm_sm90.h"

namespace jaxflux {

size_t RsGemmWorkspaceBytes_bf16(const RsGemmProblem& problem);
size_t RsGemmWorkspaceBytes_f16(const RsGemmProblem& problem);
const char* RsGemmRun_bf16(const RsGemmProblem& problem, void* workspace, cudaStream_t stream);
const char* RsGemmRun_f16(const RsGemmProblem& problem, void* workspace, cudaStream_t stream);

size_t RsGemmSm90WorkspaceBytes(GemmDtype dtype, const RsGemmProblem& problem) {
  return dtype == GemmDtype::kF16 ? RsGemmWorkspaceBytes_f16(problem)
                                  : RsGemmWorkspaceBytes_bf16(problem);
}

const char* RsGemmSm90(GemmDtype dtype, const RsGemmProblem& problem, void* workspace,
                       cudaStream_t stream) {
  return dtype == GemmDtype::kF16 ? RsGemmRun_f16(problem, workspace, stream)
                                  : RsGemmRun_bf16(problem, workspace, stream);
}

}  // namespace jaxflux
