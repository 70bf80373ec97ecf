// Dispatch of the fused AllGather+GEMM over (dtype, tile config) to the instantiations in
// ag_gemm_sm90_{bf16,f16}_c*.cu, and the choice of config. No CUTLASS here (compiles fast).
#include <cstdlib>

#include "xla_ffi/kernels/ag_gemm_sm90.h"

namespace jaxflux {

#define JAXFLUX_DECLARE_AG_GEMM(NAME)                                                       \
  size_t AgGemmWorkspaceBytes_##NAME(const AgGemmProblem& problem);                         \
  const char* AgGemmRun_##NAME(const AgGemmProblem& problem, void* workspace,               \
                               cudaStream_t stream);
JAXFLUX_DECLARE_AG_GEMM(bf16_c0)
JAXFLUX_DECLARE_AG_GEMM(bf16_c1)
JAXFLUX_DECLARE_AG_GEMM(bf16_c2)
JAXFLUX_DECLARE_AG_GEMM(bf16_c3)
JAXFLUX_DECLARE_AG_GEMM(f16_c0)
JAXFLUX_DECLARE_AG_GEMM(f16_c1)
JAXFLUX_DECLARE_AG_GEMM(f16_c2)
JAXFLUX_DECLARE_AG_GEMM(f16_c3)
#undef JAXFLUX_DECLARE_AG_GEMM

namespace {

struct Entry {
  size_t (*workspace_bytes)(const AgGemmProblem&);
  const char* (*run)(const AgGemmProblem&, void*, cudaStream_t);
};

// [dtype][config], in AgGemmConfig order.
constexpr Entry kTable[2][kAgGemmNumConfigs] = {
    {{AgGemmWorkspaceBytes_bf16_c0, AgGemmRun_bf16_c0},
     {AgGemmWorkspaceBytes_bf16_c1, AgGemmRun_bf16_c1},
     {AgGemmWorkspaceBytes_bf16_c2, AgGemmRun_bf16_c2},
     {AgGemmWorkspaceBytes_bf16_c3, AgGemmRun_bf16_c3}},
    {{AgGemmWorkspaceBytes_f16_c0, AgGemmRun_f16_c0},
     {AgGemmWorkspaceBytes_f16_c1, AgGemmRun_f16_c1},
     {AgGemmWorkspaceBytes_f16_c2, AgGemmRun_f16_c2},
     {AgGemmWorkspaceBytes_f16_c3, AgGemmRun_f16_c3}},
};

const Entry& Lookup(GemmDtype dtype, AgGemmConfig config) {
  int c = static_cast<int>(config);
  if (c < 0 || c >= kAgGemmNumConfigs) c = 0;
  return kTable[dtype == GemmDtype::kF16 ? 1 : 0][c];
}

}  // namespace

AgGemmConfig ChooseAgGemmConfig(const GemmProblem& problem) {
  (void)problem;
  static const int forced = [] {
    const char* env = std::getenv("JAXFLUX_AG_GEMM_CONFIG");
    const int c = env ? std::atoi(env) : -1;
    return (c >= 0 && c < kAgGemmNumConfigs) ? c : -1;
  }();
  if (forced >= 0) return static_cast<AgGemmConfig>(forced);
  return AgGemmConfig::kCoop128x256Cluster2x1;
}

size_t AgGemmSm90WorkspaceBytes(GemmDtype dtype, const AgGemmProblem& problem) {
  return Lookup(dtype, problem.config).workspace_bytes(problem);
}

const char* AgGemmSm90(GemmDtype dtype, const AgGemmProblem& problem, void* workspace,
                       cudaStream_t stream) {
  return Lookup(dtype, problem.config).run(problem, workspace, stream);
}

}  // namespace jaxflux
