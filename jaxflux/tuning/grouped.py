"""Tile choice of the grouped GEMM (jaxflux_grouped_gemm, GroupedGemmTiles in
xla_ffi/kernels/grouped_gemm_sm90.h).

One tile for every shape: cooperative 128x256. In h200_grouped_gemm.json (four MoE layers at
16,384 routed rows, even and Dirichlet(0.5) routing, both tiles side by side) ping-pong 128x128
is faster on three rows, by 3% at most (deepseek-v2-lite even), and slower on the other five,
by up to 13% (mixtral-fc2 dirichlet). The choice keeps its inputs (the tile's M extent per
group, N) so that a measured class can take another tile.
"""
from __future__ import annotations

from jaxflux.tuning.fields import GROUPED_TILES

EVIDENCE = "h200_grouped_gemm.json"


def choose_grouped_matmul(group_rows: float, n: int) -> str:
  """The tile for groups of `group_rows` rows on average on the tile's M side (the forward and
  dx: routed rows per group; dw: K) and n output columns."""
  del group_rows, n
  return GROUPED_TILES[0]
