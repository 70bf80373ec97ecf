// Dispatch of the fused AllGather+GEMM over (dtype, B layout, tile config) to the instantiations
// in instantiations/ag_gemm_sm90_*.cu. No CUTLASS here (compiles fast).
#include "xla_ffi/kernels/ag_gemm_sm90.h"

namespace jaxflux {

#define JAXFLUX_DECLARE_AG_GEMM(NAME)                                                       \
  size_t AgGemmWorkspaceBytes_##NAME(const AgGemmProblem& problem);                         \
  const char* AgGemmRun_##NAME(const AgGemmProblem& problem, void* workspace,               \
                               cudaStream_t stream);
JAXFLUX_DECLARE_AG_GEMM(bf16_cooperative_128x256_cluster2x1_nmajor)
JAXFLUX_DECLARE_AG_GEMM(bf16_pingpong_128x128_cluster1x2_nmajor)
JAXFLUX_DECLARE_AG_GEMM(bf16_cooperative_128x256_cluster2x1_kmajor)
JAXFLUX_DECLARE_AG_GEMM(bf16_pingpong_128x128_cluster1x2_kmajor)
JAXFLUX_DECLARE_AG_GEMM(f16_cooperative_128x256_cluster2x1_nmajor)
JAXFLUX_DECLARE_AG_GEMM(f16_pingpong_128x128_cluster1x2_nmajor)
JAXFLUX_DECLARE_AG_GEMM(f16_cooperative_128x256_cluster2x1_kmajor)
JAXFLUX_DECLARE_AG_GEMM(f16_pingpong_128x128_cluster1x2_kmajor)
JAXFLUX_DECLARE_AG_GEMM(e4m3_cooperative_128x256_cluster2x1_kmajor)
JAXFLUX_DECLARE_AG_GEMM(e4m3_pingpong_128x128_cluster1x2_kmajor)
JAXFLUX_DECLARE_AG_GEMM(e5m2_cooperative_128x256_cluster2x1_kmajor)
JAXFLUX_DECLARE_AG_GEMM(e5m2_pingpong_128x128_cluster1x2_kmajor)
#undef JAXFLUX_DECLARE_AG_GEMM

namespace {

struct Entry {
  size_t (*workspace_bytes)(const AgGemmProblem&);
  const char* (*run)(const AgGemmProblem&, void*, cudaStream_t);
};

#define JAXFLUX_AG_GEMM_ENTRY(NAME) {AgGemmWorkspaceBytes_##NAME, AgGemmRun_##NAME}

// [dtype][B K-major][config], in GemmDtype and AgGemmConfig order. FP8 reads B K-major only
// (wgmma's 8-bit operands): no N-major entries.
constexpr Entry kNone{nullptr, nullptr};
constexpr Entry kTable[4][2][kAgGemmNumConfigs] = {
    {{JAXFLUX_AG_GEMM_ENTRY(bf16_cooperative_128x256_cluster2x1_nmajor),
      JAXFLUX_AG_GEMM_ENTRY(bf16_pingpong_128x128_cluster1x2_nmajor)},
     {JAXFLUX_AG_GEMM_ENTRY(bf16_cooperative_128x256_cluster2x1_kmajor),
      JAXFLUX_AG_GEMM_ENTRY(bf16_pingpong_128x128_cluster1x2_kmajor)}},
    {{JAXFLUX_AG_GEMM_ENTRY(f16_cooperative_128x256_cluster2x1_nmajor),
      JAXFLUX_AG_GEMM_ENTRY(f16_pingpong_128x128_cluster1x2_nmajor)},
     {JAXFLUX_AG_GEMM_ENTRY(f16_cooperative_128x256_cluster2x1_kmajor),
      JAXFLUX_AG_GEMM_ENTRY(f16_pingpong_128x128_cluster1x2_kmajor)}},
    {{kNone, kNone},
     {JAXFLUX_AG_GEMM_ENTRY(e4m3_cooperative_128x256_cluster2x1_kmajor),
      JAXFLUX_AG_GEMM_ENTRY(e4m3_pingpong_128x128_cluster1x2_kmajor)}},
    {{kNone, kNone},
     {JAXFLUX_AG_GEMM_ENTRY(e5m2_cooperative_128x256_cluster2x1_kmajor),
      JAXFLUX_AG_GEMM_ENTRY(e5m2_pingpong_128x128_cluster1x2_kmajor)}}};

#undef JAXFLUX_AG_GEMM_ENTRY

// nullptr for a config or layout outside the table (the handlers validate them first).
const Entry* Lookup(GemmDtype dtype, const AgGemmProblem& problem) {
  const int c = static_cast<int>(problem.config);
  const int d = static_cast<int>(dtype);
  if (c < 0 || c >= kAgGemmNumConfigs || d < 0 || d >= 4) return nullptr;
  const Entry* entry = &kTable[d][problem.gemm.b_kmajor ? 1 : 0][c];
  return entry->run != nullptr ? entry : nullptr;
}

}  // namespace

size_t AgGemmSm90WorkspaceBytes(GemmDtype dtype, const AgGemmProblem& problem) {
  const Entry* entry = Lookup(dtype, problem);
  return entry != nullptr ? entry->workspace_bytes(problem) : 0;
}

const char* AgGemmSm90(GemmDtype dtype, const AgGemmProblem& problem, void* workspace,
                       cudaStream_t stream) {
  const Entry* entry = Lookup(dtype, problem);
  if (entry == nullptr) return "no AllGather+GEMM kernel for this dtype, layout and tile config";
  return entry->run(problem, workspace, stream);
}

}  // namespace jaxflux
