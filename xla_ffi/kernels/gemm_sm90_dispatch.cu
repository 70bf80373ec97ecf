// Dispatch of CUTLASS's sm90 GEMM over the element type (16-bit or FP8) and tiles (GemmTiles:
// persistent, stream-K (16-bit only) or the swap-AB decode GEMM, gemm_swap_ab_sm90_dispatch.cu),
// to the instantiations in instantiations/gemm_sm90_*.cu. No CUTLASS here (compiles fast).
#include "xla_ffi/kernels/gemm_sm90.h"

#include "xla_ffi/kernels/gemm_swap_ab_sm90.h"

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
  switch (problem.tiles) {
    case GemmTiles::kSwapAB:
      return GemmSwapAbSm90WorkspaceBytes(dtype, problem);
    case GemmTiles::kStreamK128x128:
      if (IsFp8(dtype)) return 0;  // no FP8 stream-K build: GemmSm90 refuses it
      return dtype == GemmDtype::kF16 ? GemmWorkspaceBytes_streamk_f16(problem)
                                      : GemmWorkspaceBytes_streamk_bf16(problem);
    default:
      break;
  }
  switch (dtype) {
    case GemmDtype::kE4M3: return GemmWorkspaceBytes_e4m3(problem);
    case GemmDtype::kE5M2: return GemmWorkspaceBytes_e5m2(problem);
    case GemmDtype::kF16: return GemmWorkspaceBytes_f16(problem);
    default: return GemmWorkspaceBytes_bf16(problem);
  }
}

const char* GemmSm90(GemmDtype dtype, const GemmProblem& problem, void* workspace,
                     cudaStream_t stream) {
  switch (problem.tiles) {
    case GemmTiles::kSwapAB:
      return GemmSwapAbSm90(dtype, problem, workspace, stream);
    case GemmTiles::kStreamK128x128:
      if (IsFp8(dtype)) return "no FP8 stream-K GEMM is built";
      return dtype == GemmDtype::kF16 ? GemmRun_streamk_f16(problem, workspace, stream)
                                      : GemmRun_streamk_bf16(problem, workspace, stream);
    case GemmTiles::kPersistent128x256:
      break;
    default:
      return "unknown GemmTiles";
  }
  switch (dtype) {
    case GemmDtype::kE4M3: return GemmRun_e4m3(problem, workspace, stream);
    case GemmDtype::kE5M2: return GemmRun_e5m2(problem, workspace, stream);
    case GemmDtype::kF16: return GemmRun_f16(problem, workspace, stream);
    default: return GemmRun_bf16(problem, workspace, stream);
  }
}

}  // namespace jaxflux
