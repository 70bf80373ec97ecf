// Dispatch of the fused GEMM+ReduceScatter's own-rows GEMM over the element type (16-bit or FP8), to the
// instantiations in instantiations/rs_gemm_sm90_*.cu. No CUTLASS here (compiles fast).
#include "xla_ffi/kernels/rs_gemm_sm90.h"

namespace jaxflux {

size_t RsGemmWorkspaceBytes_bf16(const RsGemmProblem& problem);
size_t RsGemmWorkspaceBytes_f16(const RsGemmProblem& problem);
const char* RsGemmRun_bf16(const RsGemmProblem& problem, void* workspace, cudaStream_t stream);
const char* RsGemmRun_f16(const RsGemmProblem& problem, void* workspace, cudaStream_t stream);
size_t RsGemmWorkspaceBytes_e4m3(const RsGemmProblem& problem);
size_t RsGemmWorkspaceBytes_e5m2(const RsGemmProblem& problem);
const char* RsGemmRun_e4m3(const RsGemmProblem& problem, void* workspace, cudaStream_t stream);
const char* RsGemmRun_e5m2(const RsGemmProblem& problem, void* workspace, cudaStream_t stream);

size_t RsGemmSm90WorkspaceBytes(GemmDtype dtype, const RsGemmProblem& problem) {
  switch (dtype) {
    case GemmDtype::kF16: return RsGemmWorkspaceBytes_f16(problem);
    case GemmDtype::kE4M3: return RsGemmWorkspaceBytes_e4m3(problem);
    case GemmDtype::kE5M2: return RsGemmWorkspaceBytes_e5m2(problem);
    default: return RsGemmWorkspaceBytes_bf16(problem);
  }
}

const char* RsGemmSm90(GemmDtype dtype, const RsGemmProblem& problem, void* workspace,
                       cudaStream_t stream) {
  switch (dtype) {
    case GemmDtype::kF16: return RsGemmRun_f16(problem, workspace, stream);
    case GemmDtype::kE4M3: return RsGemmRun_e4m3(problem, workspace, stream);
    case GemmDtype::kE5M2: return RsGemmRun_e5m2(problem, workspace, stream);
    default: return RsGemmRun_bf16(problem, workspace, stream);
  }
}

}  // namespace jaxflux
