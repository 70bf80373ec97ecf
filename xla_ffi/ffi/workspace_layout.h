// The symmetric workspace of a communicating call, per epoch-parity half: the one definition of
// its layout and size. The handlers check and address their half by it; Python asks the module
// (group_workspace_bytes) for the whole workspace a call needs when it traces the call. Plain
// C++: the same in both builds.
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

namespace jaxflux {

// Peers write into the slots with copy-engine pushes and vector stores: each slot starts
// 256-byte aligned.
inline constexpr size_t kSlotAlign = 256;

constexpr size_t SlotBytes(size_t bytes) {
  return (bytes + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
}

enum class SlotLayout {
  // [source rank][slot]: what each rank pushed (all_gather, GEMM+AllReduce, the MoE
  // all-gather).
  kReceive,
  // [source rank][slot], then [destination rank][slot], the partials staged for the peers
  // (GEMM+ReduceScatter, the MoE reduce-scatter).
  kReceiveAndStage,
  // The tp shards gathered as one operand of the GEMM, then (FP8) their row scales
  // [batch][tp][m] (AllGather+GEMM).
  kGatheredRows,
};

// The layout of the op Python names (its target without the "jaxflux_" prefix).
constexpr std::optional<SlotLayout> SlotLayoutOf(std::string_view op) {
  if (op == "all_gather" || op == "matmul_all_reduce" || op == "all_gather_grouped_matmul") {
    return SlotLayout::kReceive;
  }
  if (op == "matmul_reduce_scatter" || op == "grouped_matmul_reduce_scatter") {
    return SlotLayout::kReceiveAndStage;
  }
  if (op == "all_gather_matmul") return SlotLayout::kGatheredRows;
  return std::nullopt;
}

// Bytes of one parity half. item_bytes: what one rank sends each peer (its shard, or one
// partial); scale_bytes: the FP8 row scales one rank's shard carries (kGatheredRows only).
constexpr size_t HalfBytes(SlotLayout layout, size_t tp, size_t item_bytes,
                           size_t scale_bytes = 0) {
  switch (layout) {
    case SlotLayout::kReceive:
      return tp * SlotBytes(item_bytes);
    case SlotLayout::kReceiveAndStage:
      return 2 * tp * SlotBytes(item_bytes);
    case SlotLayout::kGatheredRows:
      return SlotBytes(tp * item_bytes) + tp * scale_bytes;
  }
  return 0;
}

}  // namespace jaxflux
