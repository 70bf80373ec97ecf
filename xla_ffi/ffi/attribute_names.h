// The names of the kernels' enum attributes, in the order of their values: the one encoding the
// Python side turns a tuning choice into (the module's `attribute_names`; jaxflux/ops/
// _attributes.py). Each handler that decodes one checks its enum's size against these, so the
// two sides cannot drift apart. Plain C++: the CPU-only module exports them too.
#ifndef JAXFLUX_XLA_FFI_FFI_ATTRIBUTE_NAMES_H_
#define JAXFLUX_XLA_FFI_FFI_ATTRIBUTE_NAMES_H_

#include <array>
#include <string_view>

namespace jaxflux {

// `tile` of jaxflux_all_gather_matmul and of jaxflux_gemm's kernel 1 (AgGemmConfig).
inline constexpr std::array<std::string_view, 2> kAgGemmConfigNames = {
    "cooperative_128x256_cluster2x1", "pingpong_128x128_cluster1x2"};

// `tile` of jaxflux_matmul_all_reduce and of jaxflux_gemm's kernel 0 (GemmTiles).
inline constexpr std::array<std::string_view, 3> kGemmTilesNames = {
    "cooperative_128x256_cluster2x1", "cooperative_128x128_streamk", "swap_ab_streamk"};

// `own_rows_schedule` of jaxflux_matmul_reduce_scatter and of jaxflux_gemm's kernel 2.
inline constexpr std::array<std::string_view, 2> kOwnRowsScheduleNames = {"cooperative",
                                                                          "pingpong"};

// `tile` of jaxflux_grouped_gemm and of the MoE ops (GroupedGemmTiles).
inline constexpr std::array<std::string_view, 2> kGroupedGemmTilesNames = {"cooperative_128x256",
                                                                           "pingpong_128x128"};

}  // namespace jaxflux

#endif  // JAXFLUX_XLA_FFI_FFI_ATTRIBUTE_NAMES_H_
