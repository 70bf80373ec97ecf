"""Tuning choices -> the int64 attributes of the kernels' FFI targets (the C++ contract:
xla_ffi/ffi/ag_gemm.cc, gemm_rs.cc, gemm.cc, and the GEMM+AllReduce handler)."""
from __future__ import annotations

from jaxflux import tuning


def all_gather_matmul(choice: tuning.AllGatherMatmulChoice, m: int) -> dict:
  """The AG+GEMM kernel's attributes for shards of m rows. The GEMM reads its own rows straight
  from x only when a shard is a whole number of tiles (no tile mixes x's rows with a peer's)."""
  return {"tile": tuning.AG_TILES.index(choice.tile),
          "swizzle": choice.swizzle,
          "local_read": int(choice.local_read == "direct" and m % tuning.TILE_ROWS == 0),
          "grid_sms": choice.grid_sms}


def matmul_reduce_scatter(choice: tuning.MatmulReduceScatterChoice) -> dict:
  return {"reduce": int(choice.reduce == "epilogue"),
          "push_chunks": int(choice.push == "chunked"),
          "own_rows_schedule": tuning.OWN_ROWS_SCHEDULES.index(choice.own_rows_schedule),
          "own_rows_swizzle": choice.own_rows_swizzle,
          "peer_rows_swizzle": choice.peer_rows_swizzle,
          "grid_sms": choice.grid_sms}


def matmul_all_reduce(choice: tuning.MatmulAllReduceChoice) -> dict:
  """tile: 0 CUTLASS's stock persistent 128x256 GEMM, 1 stream-K 128x128; push_chunks: 1 when
  the partial goes in row chunks, each flagged as it lands."""
  return {"tile": tuning.AR_TILES.index(choice.tile),
          "push_chunks": int(choice.push == "chunked"),
          "swizzle": choice.swizzle,
          "grid_sms": choice.grid_sms}
