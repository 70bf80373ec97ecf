"""Tuning choices -> the int64 attributes of the kernels' FFI targets (the C++ contract:
xla_ffi/ffi/ag_gemm.cc, gemm_rs.cc, gemm.cc, gemm_ar.cc, grouped_gemm.cc, moe_gemm.cc). Enum
attributes are encoded by the names the native module exports (xla_ffi/ffi/attribute_names.h)."""
from __future__ import annotations

from jaxflux import _runtime, tuning


def encode(attribute: str, name: str) -> int:
  """The value the kernels give `name` of their enum attribute `attribute` ("ag_tile",
  "gemm_tile", "own_rows_schedule" or "grouped_tile")."""
  names = _runtime.attribute_names().get(attribute)
  if names is None:
    raise RuntimeError(f"jaxflux: the native module names no {attribute!r} attribute "
                       f"(it names {sorted(_runtime.attribute_names())}); reinstall jaxflux so "
                       "that its Python and C++ sides match.")
  if name not in names:
    raise ValueError(f"jaxflux: the kernels have no {attribute} {name!r}; they take one of "
                     f"{names}.")
  return names.index(name)


def all_gather_matmul(choice: tuning.AllGatherMatmulChoice, m: int) -> dict:
  """The AG+GEMM kernel's attributes for shards of m rows. The GEMM reads its own rows straight
  from x only when a shard is a whole number of tiles (no tile mixes x's rows with a peer's)."""
  return {"tile": encode("ag_tile", choice.tile),
          "swizzle": choice.swizzle,
          "local_read": int(choice.local_read == "direct" and m % tuning.TILE_ROWS == 0),
          "grid_sms": choice.grid_sms}


def matmul_reduce_scatter(choice: tuning.MatmulReduceScatterChoice) -> dict:
  return {"reduce": int(choice.reduce == "epilogue"),
          "push_chunks": int(choice.push == "chunked"),
          "own_rows_schedule": encode("own_rows_schedule", choice.own_rows_schedule),
          "own_rows_swizzle": choice.own_rows_swizzle,
          "peer_rows_swizzle": choice.peer_rows_swizzle,
          "grid_sms": choice.grid_sms}


def matmul_all_reduce(choice: tuning.MatmulAllReduceChoice) -> dict:
  """tile: 0 CUTLASS's stock persistent 128x256 GEMM, 1 stream-K 128x128, 2 the swap-AB decode
  GEMM; push_chunks: 1 when the partial goes in row chunks, each flagged as it lands."""
  return {"tile": encode("gemm_tile", choice.tile),
          "push_chunks": int(choice.push == "chunked"),
          "swizzle": choice.swizzle,
          "grid_sms": choice.grid_sms}
