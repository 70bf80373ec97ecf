// nanobind module: FFI registrations and runtime entry points only. nvcc never sees this file;
// everything CUDA lives in the jaxflux_cuda static library behind plain C++ headers.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#ifdef JAXFLUX_WITH_CUDA
#include "xla_ffi/ffi/ag_gemm.h"
#include "xla_ffi/ffi/all_gather.h"
#include "xla_ffi/ffi/device_clock.h"
#include "xla_ffi/ffi/device_slot.h"
#include "xla_ffi/ffi/gemm.h"
#include "xla_ffi/ffi/gemm_ar.h"
#include "xla_ffi/ffi/gemm_rs.h"
#include "xla_ffi/ffi/grouped_gemm.h"
#include "xla_ffi/ffi/host_executions.h"
#include "xla_ffi/ffi/moe_gemm.h"
#include "xla_ffi/ffi/rank_state_type.h"
#endif
// Plain C++: the FFI contract (attribute names, limits, slot words, workspace layouts) is
// the same in both builds.
#include "xla_ffi/ffi/attribute_names.h"
#include "xla_ffi/ffi/workspace_layout.h"
#include "xla_ffi/runtime/runtime.h"

namespace nb = nanobind;

namespace {

#ifdef JAXFLUX_WITH_CUDA
template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// The kernels' element type of operand a, by its numpy name.
jaxflux::GemmDtype GemmDtypeNamed(const std::string& name) {
  if (name == "bfloat16") return jaxflux::GemmDtype::kBF16;
  if (name == "float16") return jaxflux::GemmDtype::kF16;
  if (name == "float8_e4m3fn") return jaxflux::GemmDtype::kE4M3;
  if (name == "float8_e5m2") return jaxflux::GemmDtype::kE5M2;
  throw nb::value_error(("no GEMM kernel takes a of dtype " + name).c_str());
}

size_t OrRaise(std::optional<size_t> bytes, const std::string& error) {
  if (!bytes) throw nb::value_error(error.c_str());
  return *bytes;
}

// The kernels size their grids (and stream-K its workspace) by the SM count: refuse to size a
// workspace for a device that can't report one.
int32_t DeviceWithSms(int32_t device) {
  if (jaxflux::DeviceSmCount(device) <= 0) {
    throw nb::value_error(("no SM count for CUDA device " + std::to_string(device) +
                           ": workspaces are sized on the GPU that runs the kernels").c_str());
  }
  return device;
}
#endif

}  // namespace

NB_MODULE(_jaxflux, m) {
  m.doc() = "jaxflux native extension";
#ifdef JAXFLUX_WITH_CUDA
  m.attr("cuda_built") = true;
#else
  m.attr("cuda_built") = false;
#endif
  // The group-size cap every cross-process handler checks; Python refuses larger groups with it.
  m.attr("max_ranks") = jaxflux::kMaxRanks;
  m.attr("workspace_classes") = nb::make_tuple(jaxflux::kMinWorkspaceClass,
                                               jaxflux::kMaxWorkspaceClass);
  m.def("group_workspace_bytes",
        [](const std::string& op, int64_t tp, int64_t item_bytes, int64_t scale_bytes) {
          const auto layout = jaxflux::SlotLayoutOf(op);
          if (!layout) throw nb::value_error(("no workspace layout for op " + op).c_str());
          if (tp < 1 || item_bytes < 0 || scale_bytes < 0) {
            throw nb::value_error("group_workspace_bytes: tp >= 1, bytes >= 0");
          }
          return 2 * jaxflux::HalfBytes(*layout, static_cast<size_t>(tp),
                                        static_cast<size_t>(item_bytes),
                                        static_cast<size_t>(scale_bytes));
        },
        nb::arg("op"), nb::arg("tp"), nb::arg("item_bytes"), nb::arg("scale_bytes") = 0,
        "Bytes of symmetric workspace per GPU a communicating call of `op` needs: two "
        "epoch-parity halves of its slot layout (workspace_layout.h). item_bytes: what one "
        "rank sends each peer; scale_bytes: an FP8 AllGather+GEMM shard's row scales.");
  // The kernels' enum attributes by name, each in value order (attribute_names.h).
  {
    auto names = [](const auto& array) {
      nb::list out;
      for (std::string_view name : array) out.append(nb::str(name.data(), name.size()));
      return nb::tuple(out);
    };
    nb::dict attribute_names;
    attribute_names["ag_tile"] = names(jaxflux::kAgGemmConfigNames);
    attribute_names["gemm_tile"] = names(jaxflux::kGemmTilesNames);
    attribute_names["own_rows_schedule"] = names(jaxflux::kOwnRowsScheduleNames);
    attribute_names["grouped_tile"] = names(jaxflux::kGroupedGemmTilesNames);
    m.attr("attribute_names") = attribute_names;
  }
  m.def("slot_word",
        [](int host, int slot) {
          if (!jaxflux::SlotWordFits(host, slot)) {
            throw nb::value_error(("jaxflux: host " + std::to_string(host) + ", slot " +
                                   std::to_string(slot) + " do not fit a slot word (hosts < " +
                                   std::to_string(jaxflux::kSlotWordMaxHosts) + ", slots < " +
                                   std::to_string(1 << jaxflux::kSlotWordBits) + ")").c_str());
          }
          return jaxflux::SlotWord(host, slot);
        },
        nb::arg("host"), nb::arg("slot"),
        "The slot word naming host slot `slot` of host `host` (runtime.h's SlotWord).");

  m.def("registrations", []() {
    nb::dict registrations;
#ifdef JAXFLUX_WITH_CUDA
    // The group targets are stateful: one rank state per executable instance, created by
    // the same instantiate stage.
    auto stateful = [](auto* execute) {
      nb::dict stages;
      stages["instantiate"] = Capsule(JaxfluxRankStateInstantiate);
      stages["execute"] = Capsule(execute);
      return stages;
    };
    registrations["jaxflux_all_gather"] = stateful(JaxfluxAllGatherExecute);
    registrations["jaxflux_all_gather_matmul"] = stateful(JaxfluxAgGemmExecute);
    registrations["jaxflux_matmul_reduce_scatter"] = stateful(JaxfluxGemmRsExecute);
    registrations["jaxflux_matmul_all_reduce"] = stateful(JaxfluxGemmArExecute);
    registrations["jaxflux_all_gather_grouped_matmul"] =
        stateful(JaxfluxMoeAgGroupedGemmExecute);
    registrations["jaxflux_grouped_matmul_reduce_scatter"] =
        stateful(JaxfluxMoeGroupedGemmRsExecute);
    registrations["jaxflux_gemm"] = Capsule(JaxfluxGemm);
    registrations["jaxflux_grouped_gemm"] = Capsule(JaxfluxGroupedGemm);
    registrations["jaxflux_device_clock"] = Capsule(JaxfluxDeviceClock);
    registrations["jaxflux_device_slot"] = Capsule(JaxfluxDeviceSlot);
#endif
    return registrations;
  }, "FFI targets by name (PyCapsules or stage dicts), empty when built without CUDA.");

  m.def("type_registrations", []() {
    nb::dict types;
#ifdef JAXFLUX_WITH_CUDA
    nb::dict rank_state;
    rank_state["type_id"] = nb::capsule(reinterpret_cast<void*>(JaxfluxRankStateTypeId()));
    rank_state["type_info"] =
        nb::capsule(const_cast<void*>(static_cast<const void*>(JaxfluxRankStateTypeInfo())));
    types["jaxflux_rank_state"] = rank_state;
#endif
    return types;
  }, "FFI state types by name ({'type_id', 'type_info'} PyCapsules) for stateful targets.");

#ifdef JAXFLUX_WITH_CUDA
  m.def("ensure_workspace",
        [](const std::vector<int>& ordinals, int64_t workspace_class) {
          std::string error;
          if (!jaxflux::EnsureWorkspace(ordinals, workspace_class, &error)) {
            throw std::runtime_error(error);
          }
        },
        nb::arg("ordinals"), nb::arg("workspace_class"),
        "Makes every GPU of `ordinals` hold the arena of `workspace_class` (2^class bytes).");
  m.def("workspace_bytes", &jaxflux::WorkspaceBytes, nb::arg("workspace_class"));
  // The workspace results of the tp=1 targets (they allocate nothing while executing), sized at
  // trace time from the same description the handlers launch from.
  m.def("gemm_workspace_bytes",
        [](const std::string& dtype, int64_t m, int64_t n, int64_t k, int64_t kernel,
           int64_t transpose_w, int64_t tile, int64_t own_rows_schedule, int64_t push_chunks,
           int64_t swizzle, int64_t grid_sms, int64_t fast_accum, int32_t device) {
          std::string error;
          const jaxflux::GemmChoice choice{kernel,      transpose_w, tile,     own_rows_schedule,
                                           push_chunks, swizzle,     grid_sms, fast_accum};
          return OrRaise(jaxflux::GemmWorkspaceBytes(GemmDtypeNamed(dtype), m, n, k, choice,
                                                     DeviceWithSms(device), &error),
                         error);
        },
        nb::arg("dtype"), nb::arg("m"), nb::arg("n"), nb::arg("k"), nb::arg("kernel"),
        nb::arg("transpose_w"), nb::arg("tile"), nb::arg("own_rows_schedule"),
        nb::arg("push_chunks"), nb::arg("swizzle"), nb::arg("grid_sms"), nb::arg("fast_accum"),
        nb::arg("device"),
        "Bytes of jaxflux_gemm's workspace result for [m, k] x [k, n] with these attributes.");
  m.def("host_executions", []() {
          nb::dict counts;
          counts["jaxflux_gemm"] =
              jaxflux::HostExecutions(jaxflux::CountedTarget::kGemm).load();
          counts["jaxflux_grouped_gemm"] =
              jaxflux::HostExecutions(jaxflux::CountedTarget::kGroupedGemm).load();
          return counts;
        },
        "Times the host ran each tp=1 target's execute stage (a replayed CUDA graph would run "
        "none).");
  m.def("grouped_gemm_workspace_bytes",
        [](const std::string& dtype, int64_t m, int64_t n, int64_t k, int64_t groups,
           int64_t kind, int64_t transpose_w, int64_t tile, int32_t device) {
          std::string error;
          return OrRaise(jaxflux::GroupedGemmWorkspaceBytes(GemmDtypeNamed(dtype), m, n, k,
                                                            groups, kind, transpose_w, tile,
                                                            DeviceWithSms(device), &error),
                         error);
        },
        nb::arg("dtype"), nb::arg("m"), nb::arg("n"), nb::arg("k"), nb::arg("groups"),
        nb::arg("kind"), nb::arg("transpose_w"), nb::arg("tile"), nb::arg("device"),
        "Bytes of jaxflux_grouped_gemm's workspace result for these operands and attributes.");
  m.def("set_timeout_ns", &jaxflux::SetTimeoutNs, nb::arg("timeout_ns"));
  m.def("set_sync_errors", &jaxflux::SetSyncErrors, nb::arg("sync"));
  m.def("take_device_error", []() -> nb::object {
          char buffer[2048];
          if (!jaxflux::TakeDeviceError(buffer, sizeof(buffer))) return nb::none();
          return nb::str(buffer);
        },
        "The first error a kernel recorded since the last take (and clears it), or None.");
  m.def("discovery_count", &jaxflux::DiscoveryCount);
  m.def("sm_count", &jaxflux::DeviceSmCount, nb::arg("ordinal"),
        "Streaming multiprocessors of CUDA device `ordinal` (0 if it can't be read).");

  // One process per GPU (jaxflux/_runtime.py drives these at trace time).
  m.def("set_slot", &jaxflux::SetSlot, nb::arg("ordinal"), nb::arg("slot"),
        "Host slot of this process's GPU `ordinal` (before its first workspace).");
  m.def("set_host_index", &jaxflux::SetHostIndex, nb::arg("host"));
  m.def("max_devices", []() { return jaxflux::kMaxDevices; }, "Host slots the runtime has.");
  m.def("export_device",
        [](int64_t workspace_class, int ordinal) {
          jaxflux::IpcHandles handles;
          std::string error;
          if (!jaxflux::ExportDevice(workspace_class, ordinal, &handles, &error)) {
            throw std::runtime_error(error);
          }
          return nb::bytes(reinterpret_cast<const char*>(&handles), sizeof(handles));
        },
        nb::arg("workspace_class"), nb::arg("ordinal"),
        "CUDA IPC handles of GPU `ordinal`'s arena of `workspace_class` and its flag arrays.");
  m.def("import_peer",
        [](int64_t workspace_class, int slot, nb::bytes handles, int local_ordinal) {
          if (handles.size() != sizeof(jaxflux::IpcHandles)) {
            throw std::runtime_error("jaxflux: import_peer: handles must be " +
                                     std::to_string(sizeof(jaxflux::IpcHandles)) + " bytes");
          }
          jaxflux::IpcHandles h;
          std::memcpy(&h, handles.c_str(), sizeof(h));
          std::string error;
          if (!jaxflux::ImportPeer(workspace_class, slot, h, local_ordinal, &error)) {
            throw std::runtime_error(error);
          }
        },
        nb::arg("workspace_class"), nb::arg("slot"), nb::arg("handles"),
        nb::arg("local_ordinal"),
        "Maps another process's GPU (host slot `slot`) from its export_device bytes.");
  m.def("close_imported_peers", &jaxflux::CloseImportedPeers);
  m.def("_group_from_slot_words",
        [](int ordinal, const std::vector<int32_t>& words, int rank, int group) {
          std::vector<int> out;
          std::string error;
          if (!jaxflux::GroupFromSlotWordsForTest(ordinal, words, rank, group, &out, &error)) {
            throw std::runtime_error(error);
          }
          return out;
        },
        nb::arg("ordinal"), nb::arg("words"), nb::arg("rank"), nb::arg("group"),
        "Test hook: [rank, group, channel, slot, peers...] from a multi-process rank operand.");
  m.def("_meet_local_peers",
        [](int ordinal, int rank, int group, int64_t run_id, int64_t site, int64_t tp) {
          std::vector<int> peers;
          std::string error;
          bool met;
          {
            nb::gil_scoped_release release;  // the other ranks arrive from other threads
            met = jaxflux::MeetLocalPeersForTest(ordinal, rank, group, run_id, site, tp, &peers,
                                                 &error);
          }
          if (!met) throw std::runtime_error(error);
          return peers;
        },
        nb::arg("ordinal"), nb::arg("rank"), nb::arg("group"), nb::arg("run_id"),
        nb::arg("site"), nb::arg("tp"),
        "Test hook: one-process rank discovery's rendezvous; the host slot of each rank.");
#endif
}
