// Dispatch of CUTLASS's sm90 GEMM over the element type (16-bit or FP8) and scheduler (stock
// persistent or stream-K; FP8: persistent only), to the instantiations in instantiations/gemm_sm90_*.cu. No CUTLASS here (compiles
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
size_t GemmWorkspaceBytes_e4m3(const GemmProblem& problem);
size_t GemmWorkspaceBytes_e5m2(const GemmProblem& problem);
const char* GemmRun_e4m3(const GemmProblem& problem, void* workspace, cudaStream_t stream);
const char* GemmRun_e5m2(const GemmProblem& problem, void* workspace, cudaStream_t stream);

size_t GemmSm90WorkspaceBytes(GemmDtype dtype, const GemmProblem& problem) {
  if (IsFp8(dtype)) {  // no FP8 stream-K build: GemmSm90 refuses it
    if (problem.streamk) return 0;
    return dtype == GemmDtype::kE4M3 ? GemmWorkspaceBytes_e4m3(problem)
                                     : GemmWorkspaceBytes_e5m2(problem);
  }
  const bool f16 = dtype == GemmDtype::kF16;
  if (problem.streamk) {
    return f16 ? GemmWorkspaceBytes_streamk_f16(problem) : GemmWorkspaceBytes_streamk_bf16(problem);
  }
  return f16 ? GemmWorkspaceBytes_f16(problem) : GemmWorkspaceBytes_bf16(problem);
}

const char* GemmSm90(GemmDtype dtype, const GemmProblem& problem, void* workspace,
                     cudaStream_t stream) {
  if (IsFp8(dtype)) {
    if (problem.streamk) return "no FP8 stream-K GEMM is built";
    return dtype == GemmDtype::kE4M3 ? GemmRun_e4m3(problem, workspace, stream)
                                     : GemmRun_e5m2(problem, workspace, stream);
  }
  const bool f16 = dtype == GemmDtype::kF16;
  if (problem.streamk) {
    return f16 ? GemmRun_streamk_f16(problem, workspace, stream)
               : GemmRun_streamk_bf16(problem, workspace, stream);
  }
  return f16 ? GemmRun_f16(problem, workspace, stream) : GemmRun_bf16(problem, workspace, stream);
}

}  // namespace jaxflux
