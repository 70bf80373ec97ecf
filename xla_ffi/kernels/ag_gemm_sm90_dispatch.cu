// Dispatch of the fused AllGather+GEMM over (dtype, B layout, tile config) to the
// instantiations in ag_gemm_sm90_{bf16,f16}_c*[_kmajor].cu, and the choice of config. No CUTLASS here (compiles fast).
#include <cstdlib>

#include "xla_ffi/kernels/ag_gemm_sm90.h"
#include "xla_ffi/kernels/device_info.h"

namespace jaxflux {

#define JAXFLUX_DECLARE_AG_GEMM(NAME)                                                       \
  size_t AgGemmWorkspaceBytes_##NAME(const AgGemmProblem& problem);                         \
  const char* AgGemmRun_##NAME(const AgGemmProblem& problem, void* workspace,               \
                               cudaStream_t stream);
JAXFLUX_DECLARE_AG_GEMM(bf16_c0)
JAXFLUX_DECLARE_AG_GEMM(bf16_c1)
JAXFLUX_DECLARE_AG_GEMM(bf16_c2)
JAXFLUX_DECLARE_AG_GEMM(bf16_c3)
JAXFLUX_DECLARE_AG_GEMM(bf16_c0_kmajor)
JAXFLUX_DECLARE_AG_GEMM(bf16_c1_kmajor)
JAXFLUX_DECLARE_AG_GEMM(bf16_c2_kmajor)
JAXFLUX_DECLARE_AG_GEMM(bf16_c3_kmajor)
JAXFLUX_DECLARE_AG_GEMM(f16_c0)
JAXFLUX_DECLARE_AG_GEMM(f16_c1)
JAXFLUX_DECLARE_AG_GEMM(f16_c2)
JAXFLUX_DECLARE_AG_GEMM(f16_c3)
JAXFLUX_DECLARE_AG_GEMM(f16_c0_kmajor)
JAXFLUX_DECLARE_AG_GEMM(f16_c1_kmajor)
JAXFLUX_DECLARE_AG_GEMM(f16_c2_kmajor)
JAXFLUX_DECLARE_AG_GEMM(f16_c3_kmajor)
#undef JAXFLUX_DECLARE_AG_GEMM

namespace {

struct Entry {
  size_t (*workspace_bytes)(const AgGemmProblem&);
  const char* (*run)(const AgGemmProblem&, void*, cudaStream_t);
};

// [dtype][B K-major][config], in AgGemmConfig order.
constexpr Entry kTable[2][2][kAgGemmNumConfigs] = {
    {{{AgGemmWorkspaceBytes_bf16_c0, AgGemmRun_bf16_c0},
      {AgGemmWorkspaceBytes_bf16_c1, AgGemmRun_bf16_c1},
      {AgGemmWorkspaceBytes_bf16_c2, AgGemmRun_bf16_c2},
      {AgGemmWorkspaceBytes_bf16_c3, AgGemmRun_bf16_c3}},
     {{AgGemmWorkspaceBytes_bf16_c0_kmajor, AgGemmRun_bf16_c0_kmajor},
      {AgGemmWorkspaceBytes_bf16_c1_kmajor, AgGemmRun_bf16_c1_kmajor},
      {AgGemmWorkspaceBytes_bf16_c2_kmajor, AgGemmRun_bf16_c2_kmajor},
      {AgGemmWorkspaceBytes_bf16_c3_kmajor, AgGemmRun_bf16_c3_kmajor}}},
    {{{AgGemmWorkspaceBytes_f16_c0, AgGemmRun_f16_c0},
      {AgGemmWorkspaceBytes_f16_c1, AgGemmRun_f16_c1},
      {AgGemmWorkspaceBytes_f16_c2, AgGemmRun_f16_c2},
      {AgGemmWorkspaceBytes_f16_c3, AgGemmRun_f16_c3}},
     {{AgGemmWorkspaceBytes_f16_c0_kmajor, AgGemmRun_f16_c0_kmajor},
      {AgGemmWorkspaceBytes_f16_c1_kmajor, AgGemmRun_f16_c1_kmajor},
      {AgGemmWorkspaceBytes_f16_c2_kmajor, AgGemmRun_f16_c2_kmajor},
      {AgGemmWorkspaceBytes_f16_c3_kmajor, AgGemmRun_f16_c3_kmajor}}}};

const Entry& Lookup(GemmDtype dtype, const AgGemmProblem& problem) {
  int c = static_cast<int>(problem.config);
  if (c < 0 || c >= kAgGemmNumConfigs) c = 0;
  return kTable[dtype == GemmDtype::kF16 ? 1 : 0][problem.gemm.b_kmajor ? 1 : 0][c];
}

}  // namespace

AgGemmConfig ChooseAgGemmConfig(const GemmProblem& problem) {
  static const int forced = [] {
    const char* env = std::getenv("JAXFLUX_AG_GEMM_CONFIG");
    const int c = env ? std::atoi(env) : -1;
    return (c >= 0 && c < kAgGemmNumConfigs) ? c : -1;
  }();
  if (forced >= 0) return static_cast<AgGemmConfig>(forced);
  // Measured on 2xH200 (benchmarks/results/ag_gemm_gpu_tp2_config*_2026-11-30.json): the
  // cooperative 128x256 tile with a 2x1 cluster is the fastest config on every row but one. The
  // exception has few tiles (Llama-70B QKV at M=2048: 320 tiles on 132 SMs, 2.4 waves): with
  // under kMinWaves waves of 128x256 tiles the last, partly empty wave costs more than the bigger
  // tile saves, and the 128x128 ping-pong tile (twice the tiles, so a smaller last wave) wins.
  constexpr long kMinWaves = 4;
  const long sms = SmCount(problem.device);
  const long tiles = static_cast<long>(problem.batch) * ((problem.m + 127) / 128) *
                     ((problem.n + 255) / 256);
  if (sms > 0 && tiles < kMinWaves * sms) return AgGemmConfig::kPingpong128x128Cluster1x2;
  return AgGemmConfig::kCoop128x256Cluster2x1;
}

int AgGemmTileRows(AgGemmConfig config) {
  return config == AgGemmConfig::kCoop256x128Cluster1x2 ? 256 : 128;  // ag_gemm_sm90.cuh Tiles*
}

size_t AgGemmSm90WorkspaceBytes(GemmDtype dtype, const AgGemmProblem& problem) {
  return Lookup(dtype, problem).workspace_bytes(problem);
}

const char* AgGemmSm90(GemmDtype dtype, const AgGemmProblem& problem, void* workspace,
                       cudaStream_t stream) {
  return Lookup(dtype, problem).run(problem, workspace, stream);
}

}  // namespace jaxflux
