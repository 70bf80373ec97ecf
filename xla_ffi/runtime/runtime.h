// Host-side runtime of jaxflux: symmetric workspace, signal channels, epochs, rank discovery and
// the device error record. Plain C++ (no CUDA types) so that module.cc can call it without nvcc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace jaxflux {

inline constexpr int kMaxDevices = 16;      // local GPUs one process drives
inline constexpr int kMaxRanks = 8;         // ranks of one group (NVLink domain of one host)
// A group's channel is the bitmask of its host slots: the same number in every process of the
// group without any agreement (flag arrays: 2 x 8 MiB per GPU).
inline constexpr int kMaxChannels = 1 << kMaxDevices;
// The symmetric workspace is one arena per size class on every GPU: class c holds 2^c bytes. A
// call names the class of what it needs, a pure function of its shapes (and of the reserve set
// by jaxflux.configure), so a traced program carries no process history and every process of a
// group names the same arenas.
inline constexpr int kMinWorkspaceClass = 21;  // 2 MiB
inline constexpr int kMaxWorkspaceClass = 40;  // 1 TiB

// Makes every device in `ordinals` hold the arena of `workspace_class` (allocated once, kept
// until exit). False with `error` on a bad class or a failed allocation.
bool EnsureWorkspace(const std::vector<int>& ordinals, int64_t workspace_class,
                     std::string* error);

// Bytes of the arena of `workspace_class` (0 while no GPU of this process has it).
size_t WorkspaceBytes(int64_t workspace_class);

// Host slots. The runtime's per-device tables (arenas, flag arrays, the source index of a flag)
// are indexed by a GPU's slot among all GPUs of its host. With one process the slot is the CUDA
// ordinal; with one process per GPU, Python assigns slots host-wide (jaxflux/_runtime.py) before
// the first workspace. The host index tells hosts apart in a slot word (SlotWord below).
void SetSlot(int ordinal, int slot);

// A slot word names a GPU of the job in one int32: host << kSlotWordBits | its host slot. The
// rank operand carries one per rank; Python builds them with the module's `slot_word`.
inline constexpr int kSlotWordBits = 8;
inline constexpr int kSlotWordMaxHosts = 1 << 22;
constexpr bool SlotWordFits(int host, int slot) {
  return host >= 0 && host < kSlotWordMaxHosts && slot >= 0 && slot < (1 << kSlotWordBits);
}
constexpr int32_t SlotWord(int host, int slot) { return host << kSlotWordBits | slot; }
constexpr int SlotWordHost(int32_t word) { return word >> kSlotWordBits; }
constexpr int SlotWordSlot(int32_t word) { return word & ((1 << kSlotWordBits) - 1); }

int SlotOfOrdinal(int ordinal);
void SetHostIndex(int host);
int HostIndex();

// CUDA IPC handles of one device's workspace arena (of a class) and flag arrays, as bytes
// (cudaIpcMemHandle_t is 64 bytes) so that this header needs no CUDA types.
inline constexpr size_t kIpcHandleBytes = 64;
struct IpcHandles {
  char arena[kIpcHandleBytes];
  char ready_flags[kIpcHandleBytes];
  char landed_flags[kIpcHandleBytes];
};
// Exports this process's GPU `ordinal`; false with `error` if it has no arena of the class.
bool ExportDevice(int64_t workspace_class, int ordinal, IpcHandles* out, std::string* error);
// Opens another process's GPU at host slot `slot` into the tables, mapped for this process's GPU
// `local_ordinal`: its flag arrays once, its arena of `workspace_class`.
bool ImportPeer(int64_t workspace_class, int slot, const IpcHandles& handles, int local_ordinal,
                std::string* error);
// Closes every imported mapping (process exit).
void CloseImportedPeers();

// Test hook (CPU tests; no GPU needed): the group that a one-process-per-GPU rank operand names
// for this process's GPU `ordinal`: {rank, group, channel, slot, peer slot of each rank}.
bool GroupFromSlotWordsForTest(int ordinal, const std::vector<int32_t>& words, int rank,
                               int group, std::vector<int>* out, std::string* error);

// Test hook (CPU tests, from threads; no GPU needed): the one-process rendezvous of rank discovery
// for GPU `ordinal` at (run_id, site); the host slot of each rank of its group.
bool MeetLocalPeersForTest(int ordinal, int rank, int group, int64_t run_id, int64_t site,
                           int64_t tp, std::vector<int>* peers, std::string* error);

// Settings read by every handler call (so they apply to programs compiled earlier too).
void SetTimeoutNs(uint64_t timeout_ns);
uint64_t TimeoutNs();
void SetSyncErrors(bool sync);
bool SyncErrors();

// Takes (and clears) the first error a device recorded since the last take, formatted.
std::optional<std::string> TakeDeviceErrorMessage();
// Same, into a caller's buffer (plain-C shape for the nanobind module); false when none.
bool TakeDeviceError(char* buffer, size_t size);

// Test hooks: number of rank discoveries done so far (each costs one host sync).
int64_t DiscoveryCount();

// Streaming multiprocessors of CUDA device `ordinal` (0 if it can't be read).
int DeviceSmCount(int ordinal);

// JAXFLUX_DEBUG=1 (the one environment variable read here): handlers trace on stderr.
bool DebugEnabled();

}  // namespace jaxflux
