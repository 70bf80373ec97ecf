"""The symmetric workspace a communicating call needs comes from the native module
(xla_ffi/ffi/workspace_layout.h), the layout its handlers check and address: two epoch-parity
halves, each of 256-byte aligned slots. The sizes below are the layouts written out by hand."""
import pytest

from jaxflux import _runtime


def slot(nbytes: int) -> int:
  return -(-nbytes // 256) * 256


@pytest.fixture(autouse=True)
def native_module():
  if _runtime._ext is None:
    pytest.skip("needs the native module (pip install -e .)")


@pytest.mark.parametrize("op, tp, item, scales, want", [
    # Receive slots [source rank], one shard or partial each.
    ("all_gather", 4, 1000, 0, 2 * 4 * slot(1000)),
    ("matmul_all_reduce", 8, 256, 0, 2 * 8 * 256),
    ("all_gather_grouped_matmul", 2, 257, 0, 2 * 2 * 512),
    # Receive slots, then the staged partials [destination rank].
    ("matmul_reduce_scatter", 4, 1000, 0, 2 * 2 * 4 * slot(1000)),
    ("grouped_matmul_reduce_scatter", 2, 1, 0, 2 * 2 * 2 * 256),
    # The gathered shards as one aligned region, then every shard's FP8 row scales.
    ("all_gather_matmul", 4, 1000, 0, 2 * slot(4 * 1000)),
    ("all_gather_matmul", 4, 1000, 40, 2 * (slot(4 * 1000) + 4 * 40)),
    ("all_gather_matmul", 2, 256, 0, 2 * 512),
])
def test_each_ops_workspace_is_its_slot_layout(op, tp, item, scales, want):
  assert _runtime.group_workspace_bytes(op, tp, item, scales) == want


def test_refuses_an_op_without_a_layout_and_negative_sizes():
  with pytest.raises(ValueError, match="no workspace layout for op gemm"):
    _runtime.group_workspace_bytes("gemm", 2, 1024)
  with pytest.raises(ValueError, match="tp >= 1"):
    _runtime.group_workspace_bytes("all_gather", 2, -1)
