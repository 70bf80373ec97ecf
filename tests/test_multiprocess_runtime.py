"""The host-side pieces of the fused path across processes (one process per GPU), on CPU with a
fake extension and a fake key-value store: host slot assignment, the per-class workspace
exchange, and the trace-time reasons auto falls back to XLA. The CUDA IPC mapping itself runs
on GPUs only (tests/test_multiprocess_gpu.py)."""
import pytest

from jaxflux import _runtime, tuning
from jaxflux.ops import _platform


@pytest.mark.parametrize("records, expected", [
    # two processes of one GPU each on one host
    ({0: ("a", 1), 1: ("a", 1)}, ({0: 0, 1: 0}, {0: 0, 1: 1}, {0: 2})),
    # four processes on two hosts, interleaved process order
    ({0: ("a", 1), 1: ("b", 1), 2: ("a", 1), 3: ("b", 1)},
     ({0: 0, 1: 1, 2: 0, 3: 1}, {0: 0, 1: 0, 2: 1, 3: 1}, {0: 2, 1: 2})),
    # uneven GPU counts: process 2's first slot comes after process 0's two GPUs
    ({0: ("a", 2), 1: ("b", 4), 2: ("a", 1)},
     ({0: 0, 1: 1, 2: 0}, {0: 0, 1: 0, 2: 2}, {0: 3, 1: 4})),
])
def test_assign_host_slots(records, expected):
  assert _runtime.assign_host_slots(records) == expected


class FakeKV:
  def __init__(self, preset=None):
    self.store = dict(preset or {})

  def key_value_set(self, key, value):
    assert key not in self.store, f"{key} set twice"
    self.store[key] = value

  def blocking_key_value_get(self, key, timeout_in_ms):
    if key not in self.store:
      raise TimeoutError(f"{key} not set within {timeout_in_ms} ms")
    return self.store[key]


class FakeExt:
  def __init__(self):
    self.slots, self.host, self.imported = {}, None, []

  def max_devices(self):
    return 16

  def set_slot(self, ordinal, slot):
    self.slots[ordinal] = slot

  def set_host_index(self, host):
    self.host = host

  def export_device(self, size_class, ordinal):
    return bytes([size_class, ordinal]) * 96

  def import_peer(self, size_class, slot, handles, local_ordinal):
    self.imported.append((size_class, slot, handles, local_ordinal))

  def close_imported_peers(self):
    pass


class FakeDevice:
  def __init__(self, ordinal):
    self.local_hardware_id = ordinal


@pytest.fixture
def process1_of_2(monkeypatch):
  """This process is process 1 of 2 on one host, with CUDA ordinal 3 (CUDA_VISIBLE_DEVICES
  aside, JAX may hand a process any ordinal); process 0 has already published."""
  import jax
  import json
  kv = FakeKV({"jaxflux/hosts/0": json.dumps([_runtime._host_identity(), 1, [0]])})
  ext = FakeExt()
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(_runtime, "_kv", lambda: kv)
  monkeypatch.setattr(_runtime, "_ext", ext)
  monkeypatch.setattr(_runtime, "_gpu_devices", lambda: (FakeDevice(3),))
  monkeypatch.setattr(_runtime, "_host_slots", None)
  monkeypatch.setattr(_runtime, "_exchanged", set())
  return kv, ext


def test_host_slots_are_agreed_through_the_store(process1_of_2):
  kv, ext = process1_of_2
  hs = _runtime.host_slots()
  assert (hs.host, hs.slots, hs.total) == (0, {3: 1}, 2)
  assert ext.slots == {3: 1} and ext.host == 0
  assert "jaxflux/hosts/1" in kv.store
  assert _runtime.host_slots() is hs  # agreed once


@pytest.mark.parametrize("records, most", [
    ({0: ("a", 1, [0]), 1: ("a", 1, [1])}, 1),             # one process per GPU
    ({0: ("a", 1, [0]), 1: ("b", 1, [0])}, 1),             # ordinal 0 of two hosts
    ({p: ("a", 1, [0]) for p in range(4)}, 4),             # four ranks on one GPU
    ({0: ("a", 2, [0, 1]), 1: ("a", 1, [1]), 2: ("b", 1, [1])}, 2),
])
def test_most_processes_on_one_gpu(records, most):
  assert _runtime.most_processes_on_one_gpu(records) == most


def test_ranks_sharing_a_gpu_are_agreed_through_the_store(process1_of_2):
  import json
  kv, _ = process1_of_2
  assert _runtime.ranks_per_gpu() == 1  # process 0 drives ordinal 0, this one ordinal 3
  _runtime._host_slots = None
  del kv.store["jaxflux/hosts/1"]
  kv.store["jaxflux/hosts/0"] = json.dumps([_runtime._host_identity(), 1, [3]])
  assert _runtime.ranks_per_gpu() == 2


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter",
                                "matmul_all_reduce"])
def test_ranks_sharing_a_gpu_leave_sms_to_each_other(monkeypatch, op):
  """Where processes share a GPU, every fused GEMM's grid leaves SHARED_GPU_FREE_SMS SMs free
  (a smaller grid a table or override asks for stays); tp=1 and one rank per GPU keep theirs."""
  import jax
  import jax.numpy as jnp
  from jaxflux.ops import _config
  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  choose = lambda tp: _config.choose(op, x, w, tp=tp, transpose_w=False,  # noqa: E731
                                     out_dtype=jnp.bfloat16).choice.grid_sms
  monkeypatch.setattr(_runtime, "sm_count", lambda: 132)
  monkeypatch.setattr(_runtime, "ranks_per_gpu", lambda: 1)
  alone = choose(2)
  monkeypatch.setattr(_runtime, "ranks_per_gpu", lambda: 4)
  assert choose(2) == 132 - _config.SHARED_GPU_FREE_SMS and alone in (0, 132)
  with tuning.override(op, grid_sms=64):
    assert choose(2) == 64
  with tuning.override(op, grid_sms=120):
    assert choose(2) == 100
  assert choose(1) == 0


def test_published_values_are_agreed_once_through_the_store(process1_of_2, monkeypatch):
  kv, _ = process1_of_2
  monkeypatch.setattr(_runtime, "_published", {})
  kv.store["jaxflux/tuning_tables/0"] = "aaaa"
  assert _runtime.published("tuning_tables", "bbbb") == {0: "aaaa", 1: "bbbb"}
  assert kv.store["jaxflux/tuning_tables/1"] == "bbbb"
  kv.store["jaxflux/tuning_tables/0"] = "changed"
  assert _runtime.published("tuning_tables", "cccc") == {0: "aaaa", 1: "bbbb"}  # agreed once


def test_workspace_exchange_publishes_ours_and_maps_the_peers(process1_of_2):
  kv, ext = process1_of_2
  _runtime.host_slots()
  kv.store["jaxflux/ws/25/0/0"] = (b"\x07" * 192).hex()  # process 0's export of class 25
  _runtime._exchange_workspace(25, [3])
  assert bytes.fromhex(kv.store["jaxflux/ws/25/0/1"]) == bytes([25, 3]) * 96
  assert ext.imported == [(25, 0, b"\x07" * 192, 3)]
  _runtime._exchange_workspace(25, [3])  # once per class
  assert len(ext.imported) == 1


def test_a_peer_that_never_publishes_fails_with_a_clear_error(process1_of_2):
  kv, _ = process1_of_2
  _runtime.host_slots()
  with pytest.raises(RuntimeError, match=r"the workspace \(size class 22\) of host slot 0 did "
                                         r"not arrive within .* same jaxflux ops in the same "
                                         r"order"):
    _runtime._exchange_workspace(22, [3])


def test_multi_process_reasons():
  one_host = lambda: _runtime.HostSlots(0, {0: 0}, 2, {0: 0, 1: 0}, {0: 0, 1: 1})  # noqa: E731
  two_hosts = lambda: _runtime.HostSlots(0, {0: 0}, 1, {0: 0, 1: 1}, {0: 0, 1: 0})  # noqa: E731
  assert _platform.multi_process_reason(1, one_host, "tp") is None
  assert "one GPU per process; this process drives 2" in _platform.multi_process_reason(
      2, one_host, "tp")
  # Two hosts: a local op (no axis) is fine; a communicating one needs the concrete mesh.
  assert _platform.multi_process_reason(1, two_hosts) is None
  assert "spans 2 hosts" in _platform.multi_process_reason(1, two_hosts, "tp")
  assert "jax.set_mesh" in _platform.multi_process_reason(1, two_hosts, "tp")


def test_processes_of_a_host_must_read_the_same_kernel_tables():
  """Processes 0 and 1 share host 0, process 2 is on host 1: a different table on host 1 is no
  conflict; one on host 0 is, naming the processes and the fix."""
  host_of = {0: 0, 1: 0, 2: 1}
  mine = tuning.active_tables().digest
  agree = lambda name, value: {0: value, 1: value, 2: "elsewhere"}  # noqa: E731
  assert _platform.tuning_agreement_reason(host_of, agree) is None
  differ = lambda name, value: {0: value, 1: "other", 2: value}  # noqa: E731
  reason = _platform.tuning_agreement_reason(host_of, differ)
  assert f"process 0: {mine}; processes [1] differ" in reason
  assert "JAXFLUX_TUNING_DIR" in reason and "python -m jaxflux.tune --show" in reason


class FakeProcessDevice:
  def __init__(self, device_id, process_index):
    self.id, self.process_index = device_id, process_index


class FakeMesh:
  """What the host check reads of a concrete mesh: devices, axis_names, shape."""
  def __init__(self, devices, names):
    import numpy as np
    self.devices = np.asarray(devices, dtype=object)
    self.axis_names = names
    self.shape = dict(zip(names, self.devices.shape))


def test_multi_host_meshes_keep_each_tp_group_on_one_host():
  """4 processes of one GPU each, processes 0, 2 on host 0 and 1, 3 on host 1 (interleaved, so
  device order alone does not give the hosts): a (dp, tp) mesh with one row per host runs fused;
  one with tp across the hosts, or a tp axis over all four, is refused naming the hosts."""
  four = lambda: _runtime.HostSlots(0, {0: 0}, 2, {0: 0, 1: 1, 2: 0, 3: 1},  # noqa: E731
                                    {0: 0, 1: 0, 2: 1, 3: 1})
  d = [FakeProcessDevice(i, i) for i in range(4)]
  per_host_rows = FakeMesh([[d[0], d[2]], [d[1], d[3]]], ("dp", "tp"))
  assert _platform.multi_process_reason(1, four, "tp", per_host_rows) is None
  # The same mesh seen along dp: each dp group pairs the two hosts.
  assert "mesh axis 'dp' (size 2) spans 2 hosts" in _platform.multi_process_reason(
      1, four, "dp", per_host_rows)
  across = FakeMesh([[d[0], d[1]], [d[2], d[3]]], ("dp", "tp"))
  reason = _platform.multi_process_reason(1, four, "tp", across)
  assert "mesh axis 'tp' (size 2) spans 2 hosts in group 0 (host 0: devices [0]; host 1: " \
         "devices [1])" in reason and "impl='xla'" in reason
  assert "spans 2 hosts" in _platform.multi_process_reason(1, four, "tp", FakeMesh(d, ("tp",)))
  # A mesh without the axis: the check can't be made, so the reason says how to give the mesh.
  assert "jax.set_mesh" in _platform.multi_process_reason(1, four, "tp", FakeMesh(d, ("x",)))


def test_host_check_on_a_real_mesh():
  """The same check on a jax Mesh of 8 CPU devices with 'hosts' of 4 consecutive device ids."""
  from conftest import make_mesh
  host_of = lambda device: device.id // 4  # noqa: E731
  assert _platform.axis_hosts_reason(make_mesh((2, 4), ("dp", "tp")), "tp", host_of) is None
  assert "spans 2 hosts" in _platform.axis_hosts_reason(make_mesh((4, 2), ("tp", "dp")), "tp",
                                                      host_of)
  assert "spans 2 hosts" in _platform.axis_hosts_reason(make_mesh((8,), ("tp",)), "tp", host_of)


def test_rank_info_names_the_group_slots_under_set_mesh(monkeypatch):
  """With one process per GPU and a concrete mesh (jax.set_mesh), rank_info appends the slot
  words of the device's group in rank order, from a constant table: checked per device on a
  (dp=2, tp=4) CPU mesh with slot word = 100 + device id."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import PartitionSpec as P
  from jaxflux.ops import _group_call, _mesh
  from conftest import make_mesh

  class Slots:
    def slot_word(self, device):
      return 100 + device.id

  monkeypatch.setattr(_runtime, "multi_process", lambda: True)
  monkeypatch.setattr(_runtime, "host_slots", lambda: Slots())
  mesh = make_mesh((2, 4), ("dp", "tp"))
  with jax.set_mesh(mesh):
    f = jax.jit(jax.shard_map(lambda: _group_call.rank_info("tp")[0][None], in_specs=(),
                              out_specs=P(("dp", "tp")), axis_names={"dp", "tp"}))
    got = np.asarray(f()).reshape(2, 4, 6)
  expected = _mesh.expected_rank_info(mesh, "tp")
  for (i, j), device in np.ndenumerate(mesh.devices):
    rank, group = expected[device.id]
    peers = [d.id for d in mesh.devices[i]]  # the devices of this dp row, in tp order
    assert list(got[i, j]) == [rank, group] + [100 + d for d in peers]


@pytest.fixture
def native():
  """The CUDA build's extension (its host-side runtime needs no GPU); slots reset afterwards."""
  if not _runtime.cuda_built():
    pytest.skip("needs the CUDA build of the extension")
  ext = _runtime._ext
  yield ext
  ext.set_slot(0, -1)  # back to slot = ordinal
  ext.set_host_index(0)


def test_peers_and_channel_from_slot_words(native):
  """GPU ordinal 0 of this process is host slot 5 on host 2; its group is slots 3 and 5."""
  native.set_slot(0, 5)
  native.set_host_index(2)
  words = [native.slot_word(2, 3), native.slot_word(2, 5)]
  rank, group, channel, slot, *peers = native._group_from_slot_words(0, words, 1, 0)
  assert (rank, group, slot, peers) == (1, 0, 5, [3, 5])
  assert channel == (1 << 3) | (1 << 5)  # the slot set's bitmask: alike in every process
  # The same set in the other rank order: the same channel.
  assert native._group_from_slot_words(0, words[::-1], 0, 0)[2] == channel


@pytest.mark.parametrize("gpus, rank, match", [  # gpus: (host, slot) of each rank
    ([(2, 3), (1, 5)], 1, r"rank 1 of the tp group of GPU 0 is on host 1, this GPU on "
                          r"host 2: the fused ops need the tp axis inside one host"),
    ([(2, 3), (2, 4)], 1, r"GPU 0 is host slot 5 but its group names slot 4 at its rank 1"),
    ([(2, 5), (2, 5)], 1, r"names host slot 5 twice"),
])
def test_bad_slot_words_are_rejected(native, gpus, rank, match):
  native.set_slot(0, 5)
  native.set_host_index(2)
  with pytest.raises(RuntimeError, match=match):
    native._group_from_slot_words(0, [native.slot_word(*gpu) for gpu in gpus], rank, 0)


def test_slot_words_are_the_native_modules():
  """The rank operand's slot words come from the module (both builds): one int32 per (host,
  slot), distinct and non-negative, and a pair that does not fit is refused by name."""
  words = {(host, slot): _runtime.slot_word(host, slot)
           for host in (0, 1, 5, (1 << 22) - 1) for slot in (0, 7, 255)}
  assert len(set(words.values())) == len(words)
  assert all(0 <= w < 2 ** 31 for w in words.values())
  for host, slot in ((0, 256), (0, -1), (1 << 22, 0), (-1, 0)):
    with pytest.raises(ValueError, match=f"host {host}, slot {slot} do not fit a slot word"):
      _runtime.slot_word(host, slot)
