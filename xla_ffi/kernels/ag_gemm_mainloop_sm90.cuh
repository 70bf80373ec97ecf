// The fused AllGather+GEMM's mainloop: CUTLASS's sm90 TMA warp-specialized mainloop (the stock
// collective the builder picks) with a second source for A. The tiles of this rank's own rows
// are loaded straight from its shard x, the FFI operand; every other tile from the gathered
// buffer that peers push into. So the own shard need not be copied into that buffer before the
// GEMM can start (a serial read and write of the shard on XLA's stream).
//
// Only the producer's load differs from the stock collective: it picks the TMA descriptor (and
// the tile's coordinate in that tensor) per output tile, then runs the same pipeline of
// A and B loads. The math, the shared-memory pipeline and the epilogue are untouched.
// Precondition (checked on the host, ag_gemm_sm90::Run): a shard's rows are a whole number of
// tiles, so no tile mixes rows of both sources.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace jaxflux::ag_gemm_sm90 {

template <class Stock>
struct LocalShardMainloop : Stock {
  using typename Stock::ElementA;
  using typename Stock::InternalElementA;
  using typename Stock::GmemTiledCopyA;
  using typename Stock::GmemTiledCopyB;
  using typename Stock::SmemLayoutA;
  using typename Stock::SmemLayoutB;
  using typename Stock::TileShape;
  using typename Stock::DispatchPolicy;
  using typename Stock::MainloopPipeline;
  using typename Stock::PipelineState;
  using typename Stock::TensorStorage;
  using ClusterShape = typename DispatchPolicy::ClusterShape;
  using TmaA = typename Stock::Params::TMA_A;
  static constexpr int kTileM = cute::size<0>(TileShape{});

  struct Arguments : Stock::Arguments {
    // This rank's shard, [batch * shard_rows, K] row-major; nullptr: every tile from A.
    const ElementA* ptr_a_local = nullptr;
    int shard_rows = 0;  // rows of one batch entry of one shard (a multiple of kTileM)
    int tp = 1;
    int rank = 0;
  };

  struct Params : Stock::Params {
    TmaA tma_load_a_local;
    int local_tiles = 0;   // M tiles of one batch entry of one shard; 0: no local source
    int local_rows = 0;    // rows of the local tensor (batch * shard_rows)
    int tiles_per_batch = 0;  // M tiles of one batch entry of A (tp * local_tiles)
    int first_local = 0;      // the first own M tile within a batch entry (rank * local_tiles)
    int total_tiles = 0;      // M tiles of A (batch * tiles_per_batch)
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                        void* workspace) {
    Params params{};
    static_cast<typename Stock::Params&>(params) =
        Stock::to_underlying_arguments(problem_shape, args, workspace);
    auto [M, N, K, L] = cute::append<4>(problem_shape, 1);
    if (args.ptr_a_local == nullptr || args.shard_rows <= 0 || args.shard_rows % kTileM != 0 ||
        args.tp <= 0 || M % (args.tp * args.shard_rows) != 0) {
      return params;  // local_tiles = 0: the stock load from A for every tile
    }
    const int batch = M / (args.tp * args.shard_rows);
    params.local_rows = batch * args.shard_rows;
    params.local_tiles = args.shard_rows / kTileM;
    params.tiles_per_batch = args.tp * params.local_tiles;
    params.first_local = args.rank * params.local_tiles;
    params.total_tiles = batch * params.tiles_per_batch;
    auto x = cute::make_tensor(reinterpret_cast<InternalElementA const*>(args.ptr_a_local),
                               cute::make_layout(cute::make_shape(params.local_rows, K, L),
                                                 args.dA));
    params.tma_load_a_local = cute::make_tma_copy_A_sm90(
        GmemTiledCopyA{}, x, SmemLayoutA{}(cute::_, cute::_, cute::Int<0>{}), TileShape{},
        ClusterShape{});
    return params;
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    Stock::prefetch_tma_descriptors(params);
    if (params.local_tiles > 0) {
      cute::prefetch_tma_descriptor(params.tma_load_a_local.get_tma_descriptor());
    }
  }

  // The stock (A, B) tiled TMA tensors, plus the local shard's.
  template <class ProblemShapeMNKL>
  CUTLASS_DEVICE auto load_init(ProblemShapeMNKL const& problem_shape,
                                Params const& params) const {
    auto stock = Stock::load_init(problem_shape, params);
    auto [M, N, K, L] = problem_shape;
    auto m_local = params.tma_load_a_local.get_tma_tensor(cute::make_shape(params.local_rows, K, L));
    auto g_local = cute::local_tile(m_local, TileShape{}, cute::make_coord(cute::_, cute::_, cute::_),
                                    cute::Step<cute::_1, cute::Underscore, cute::_1>{});
    return cute::make_tuple(cute::get<0>(stock), cute::get<1>(stock), g_local);
  }

  // Producer warp: the A and B loads of one output tile's k tiles into the smem pipeline.
  template <class TensorA, class TensorB, class TensorALocal, class KTileIterator,
            class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline,
                           PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB, TensorALocal> const& load_inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter,
                           int k_tile_count, int /*thread_idx*/, uint32_t block_rank_in_cluster,
                           TensorStorage& shared_tensors) {
    const bool leader = cute::elect_one_sync();  // warp-collective: before any branch
    if (!leader) return;
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    auto gB = cute::get<1>(load_inputs)(cute::_, cute::_, n_coord, cute::_, l_coord);
    const int local = LocalTile(params, static_cast<int>(m_coord));
    if (local >= 0) {
      auto gA = cute::get<2>(load_inputs)(cute::_, cute::_, local, cute::_, l_coord);
      LoadTiles(params.tma_load_a_local, gA, params, gB, pipeline, smem_pipe_write, k_tile_iter,
                k_tile_count, block_rank_in_cluster, shared_tensors);
    } else {
      auto gA = cute::get<0>(load_inputs)(cute::_, cute::_, m_coord, cute::_, l_coord);
      LoadTiles(params.tma_load_a, gA, params, gB, pipeline, smem_pipe_write, k_tile_iter,
                k_tile_count, block_rank_in_cluster, shared_tensors);
    }
  }

 private:
  // The tile's index in the local shard's tensor, or -1 when its rows are not this rank's.
  CUTLASS_DEVICE static int LocalTile(Params const& params, int m_tile) {
    if (params.local_tiles == 0 || m_tile >= params.total_tiles) return -1;
    const int batch = m_tile / params.tiles_per_batch;
    const int within = m_tile % params.tiles_per_batch - params.first_local;
    if (within < 0 || within >= params.local_tiles) return -1;
    return batch * params.local_tiles + within;
  }

  // One elected thread: per k tile, wait for a free stage, then TMA A (from `tma_a`) and B into
  // it; the stage's barrier completes when both have landed (the consumers wait on it).
  template <class TmaCopyA, class TensorGA, class TensorGB, class KTileIterator>
  CUTLASS_DEVICE static void LoadTiles(TmaCopyA const& tma_a, TensorGA const& gA,
                                       Params const& params, TensorGB const& gB,
                                       MainloopPipeline& pipeline, PipelineState state,
                                       KTileIterator k_tile_iter, int k_tile_count,
                                       uint32_t block_rank_in_cluster,
                                       TensorStorage& shared_tensors) {
    using namespace cute;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    constexpr uint32_t kClusterM = size<0>(ClusterShape{});
    const uint32_t cluster_m = block_rank_in_cluster % kClusterM;
    const uint32_t cluster_n = block_rank_in_cluster / kClusterM;
    // A is shared (multicast) by the CTAs of the cluster's row, B by those of its column.
    auto cta_tma_a = tma_a.get_slice(cluster_n);
    auto cta_tma_b = params.tma_load_b.get_slice(cluster_m);
    Tensor tAgA = cta_tma_a.partition_S(gA);  // (TMA, TMA_M, TMA_K, k)
    Tensor tAsA = cta_tma_a.partition_D(sA);  // (TMA, TMA_M, TMA_K, stage)
    Tensor tBgB = cta_tma_b.partition_S(gB);
    Tensor tBsB = cta_tma_b.partition_D(sB);
    uint16_t mcast_a = 0, mcast_b = 0;
    auto cluster_layout = Layout<ClusterShape>{};  // (m, n) -> CTA rank in the cluster
    if constexpr (is_same_v<GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
      for (int n = 0; n < size<1>(cluster_layout); ++n) {
        mcast_a |= uint16_t(1) << cluster_layout(cluster_m, n, Int<0>{});
      }
    }
    if constexpr (is_same_v<GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
      for (int m = 0; m < size<0>(cluster_layout); ++m) {
        mcast_b |= uint16_t(1) << cluster_layout(m, cluster_n, Int<0>{});
      }
    }
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(state);
      auto* barrier = pipeline.producer_get_barrier(state);
      const int stage = state.index();
      copy(tma_a.with(*barrier, mcast_a), tAgA(_, _, _, *k_tile_iter), tAsA(_, _, _, stage));
      copy(params.tma_load_b.with(*barrier, mcast_b), tBgB(_, _, _, *k_tile_iter),
           tBsB(_, _, _, stage));
      ++k_tile_iter;
      ++state;
    }
  }
};

}  // namespace jaxflux::ag_gemm_sm90
