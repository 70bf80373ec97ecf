// The epilogue of GEMM+ReduceScatter's own-rows kernel: CUTLASS's sm90 TMA epilogue
// (D = A·B + C, C = the peer's partial of these rows) whose C load first waits, bounded, for the
// push chunks behind the tile's rows (TileWait). The wait sits in the epilogue, not in the
// tile scheduler, because that is where both of CUTLASS's sm90 kernels load C and only there:
// the cooperative kernel also asks the scheduler (compute_epilogue) right before, the ping-pong
// kernel does not. Only the producer warp that loads C waits; the consumers block on the
// epilogue's load pipeline for that tile, after its mainloop, so the wait overlaps the tile's
// math. With wait_for_flags = 0 (the GEMM-only kernel) it is CUTLASS's epilogue.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "xla_ffi/kernels/tile_wait.h"
#include "xla_ffi/kernels/tile_wait_sm90.cuh"

namespace jaxflux {

template <class Base, int kTileM>
class WaitingEpilogue : public Base {
 public:
  struct Arguments : Base::Arguments {
    TileWait wait{};
    int32_t wait_for_flags = 0;
    int32_t total_rows = 0;  // M of one batch entry (rows past it are TMA-clipped, not waited)
  };

  struct Params : Base::Params {
    TileWait wait{};
    int32_t wait_for_flags = 0;
    int32_t total_rows = 0;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                        void* workspace) {
    Params params;
    static_cast<typename Base::Params&>(params) =
        Base::to_underlying_arguments(problem_shape, args, workspace);
    params.wait = args.wait;
    params.wait_for_flags = args.wait_for_flags;
    params.total_rows = args.total_rows;
    return params;
  }

  // `params` is the kernel's __grid_constant__ parameter: keep its address (a copy of the wait
  // state would live in local memory; see fused_tile_scheduler_sm90.cuh).
  CUTLASS_HOST_DEVICE WaitingEpilogue(Params const& params,
                                      typename Base::TensorStorage& shared_tensors)
      : Base(params, shared_tensors), params_(&params) {}

  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class TiledMma>
  CUTLASS_DEVICE auto load(typename Base::LoadPipeline load_pipeline,
                           typename Base::LoadPipelineState load_pipe_producer_state,
                           ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_MNK,
                           TileCoordMNKL tile_coord_mnkl, TiledMma tiled_mma, int thread_idx,
                           typename Base::TensorStorage& shared_tensors, int subtile_idx = -1) {
    const Params& p = *params_;
    if (p.wait_for_flags) {
      if (!rank_checked_) {  // once per kernel, by one thread of the grid
        if (blockIdx.x == 0 && blockIdx.y == 0 && (threadIdx.x & 31) == 0) {
          tile_wait::CheckRank(p.wait);
        }
        rank_checked_ = true;
      }
      const int row0 = static_cast<int>(cute::get<0>(tile_coord_mnkl)) * kTileM;
      tile_wait::WaitForRows(p.wait, p.total_rows, row0, kTileM);
    }
    return Base::load(load_pipeline, load_pipe_producer_state, problem_shape_mnkl,
                      tile_shape_MNK, tile_coord_mnkl, tiled_mma, thread_idx, shared_tensors,
                      subtile_idx);
  }

 private:
  Params const* params_;
  bool rank_checked_ = false;
};

}  // namespace jaxflux
