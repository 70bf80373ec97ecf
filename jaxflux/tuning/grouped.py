"""Tile choice of the grouped GEMM (jaxflux_grouped_gemm, GroupedGemmTiles in
xla_ffi/kernels/grouped_gemm_sm90.h): cooperative 128x256 for every shape until the two tiles
are measured side by side.
"""
from __future__ import annotations

# In GroupedGemmTiles order.
GROUPED_TILES = ("cooperative_128x256", "pingpong_128x128")


def choose_grouped_matmul(group_rows: float, n: int) -> str:
  """The tile for groups of `group_rows` rows on average on the tile's M side (the forward and
  dx: routed rows per group; dw: K) and n output columns."""
  del group_rows, n
  return GROUPED_TILES[0]
