// Dispatch of the fused GEMM+ReduceScatter's own-rows GEMM over the element type, to the
// instantiations in rs_gemm_sm90_{bf16,f16}.cu, and for bfloat16 with
// JAXFLUX_GEMM_RS_EPILOGUE_TILE=128x64 (an experiment) to rs_gemm_sm90_bf16_epi128x64.cu.
// No CUTLASS here (compiles fast).
#include <cstdlib>
#include <cstring>

#include "xla_ffi/kernels/rs_gemm_sm90.h"

namespace jaxflux {

size_t RsGemmWorkspaceBytes_bf16(const RsGemmProblem& problem);
size_t RsGemmWorkspaceBytes_f16(const RsGemmProblem& problem);
const char* RsGemmRun_bf16(const RsGemmProblem& problem, void* workspace, cudaStream_t stream);
const char* RsGemmRun_f16(const RsGemmProblem& problem, void* workspace, cudaStream_t stream);
size_t RsGemmWorkspaceBytes_bf16_epi128x64(const RsGemmProblem& problem);
const char* RsGemmRun_bf16_epi128x64(const RsGemmProblem& problem, void* workspace,
                                     cudaStream_t stream);

namespace {

bool Epilogue128x64() {
  static const bool on = [] {
    const char* env = std::getenv("JAXFLUX_GEMM_RS_EPILOGUE_TILE");
    return env != nullptr && std::strcmp(env, "128x64") == 0;
  }();
  return on;
}

}  // namespace

size_t RsGemmSm90WorkspaceBytes(GemmDtype dtype, const RsGemmProblem& problem) {
  if (dtype == GemmDtype::kF16) return RsGemmWorkspaceBytes_f16(problem);
  return Epilogue128x64() ? RsGemmWorkspaceBytes_bf16_epi128x64(problem)
                          : RsGemmWorkspaceBytes_bf16(problem);
}

const char* RsGemmSm90(GemmDtype dtype, const RsGemmProblem& problem, void* workspace,
                       cudaStream_t stream) {
  if (dtype == GemmDtype::kF16) return RsGemmRun_f16(problem, workspace, stream);
  return Epilogue128x64() ? RsGemmRun_bf16_epi128x64(problem, workspace, stream)
                          : RsGemmRun_bf16(problem, workspace, stream);
}

}  // namespace jaxflux
