// Dispatch of CUTLASS's sm90 GEMM over the element type and scheduler (stock persistent or
// stream-K), to the instantiations in instantiations/gemm_sm90_*.cu. No CUTLASS here (compiles
// fast).
#include "xla_ffi/kernels/gemm_sm90.h"

namespace jaxflux {

size_t GemmWorkspaceBytes_bf16(const GemmProblem& problem);
size_t GemmWorkspaceBytes_f16(const GemmProblem& problem);
const char* GemmRun_bf16(const GemmProblem& problem, void* workspace, cudaStream_t stream);
const char* GemmRun_f16(const GemmProblem& problem, void* workspace, cudaStream_t stream);
size_t GemmWorkspaceBytes_streamk_bf16(const GemmProblem& problem);
size_t GemmWorkspaceBytes_streamk_f16(const GemmProblem& problem);
const char* GemmRun_streamk_bf16(const GemmProblem& problem, void* workspace, cudaStream_t stream);
const char* GemmRun_streamk_f16(const GemmProblem& problem, void* workspace, cudaStream_t stream);

size_t GemmSm90WorkspaceBytes(GemmDtype dtype, const GemmProblem& problem) {
  const bool f16 = dtype == GemmDtype::kF16;
  if (problem.streamk) {
    return f16 ? GemmWorkspaceBytes_streamk_f16(problem) : GemmWorkspaceBytes_streamk_bf16(problem);
  }
  return f16 ? GemmWorkspaceBytes_f16(problem) : GemmWorkspaceBytes_bf16(problem);
}

const char* GemmSm90(GemmDtype dtype, const GemmProblem& problem, void* workspace,
                     cudaStream_t stream) {
  const bool f16 = dtype == GemmDtype::kF16;
  if (problem.streamk) {
    return f16 ? GemmRun_streamk_f16(problem, workspace, stream)
               : GemmRun_streamk_bf16(problem, workspace, stream);
  }
  return f16 ? GemmRun_f16(problem, workspace, stream) : GemmRun_bf16(problem, workspace, stream);
}

}  // namespace jaxflux
