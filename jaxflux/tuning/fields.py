"""The fields of a kernel choice: what each op's kernels can be told, and the checks of a value.

Every table (the sm90 defaults, device tables) and every override goes through `check_fields`.
"""
from __future__ import annotations

import dataclasses

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
DTYPES = ("bfloat16", "float16")
SWIZZLES = (1, 2, 4, 8)
AG_TILES = ("cooperative_128x256_cluster2x1", "pingpong_128x128_cluster1x2")
OWN_ROWS_SCHEDULES = ("cooperative", "pingpong")
# GEMM+AllReduce's tiles (GemmTiles, xla_ffi/kernels/gemm_sm90.h): CUTLASS's stock persistent
# GEMM; stream-K, which splits the K loop of few output tiles over more SMs; and the decode GEMM,
# swap-AB (the weight's N on the tile's 128-row side, the few rows on its 16-64-wide side) with
# stream-K. FP8 runs the first and the last.
AR_TILES = ("cooperative_128x256_cluster2x1", "cooperative_128x128_streamk", "swap_ab_streamk")
TILE_ROWS = 128  # both all-gather tiles and both own-rows schedules are 128 rows high
# The grouped GEMM's tiles (GroupedGemmTiles, xla_ffi/kernels/grouped_gemm_sm90.h).
GROUPED_TILES = ("cooperative_128x256", "pingpong_128x128")
# What `override` takes: the fused ops, and the grouped GEMM (grouped_matmul and the MoE ops).
OVERRIDE_OPS = OPS + ("grouped_matmul",)


@dataclasses.dataclass(frozen=True)
class AllGatherMatmulChoice:
  tile: str
  swizzle: int
  local_read: str      # "direct": the GEMM reads the own rows from x; "copy": copied first
  grid_sms: int = 0    # 0: every SM; n > 0: the persistent grid sized for min(n, SMs)


@dataclasses.dataclass(frozen=True)
class MatmulReduceScatterChoice:
  reduce: str          # "epilogue": the own-rows GEMM sums the peer's partial; "pass": a kernel
  push: str            # "chunked": the peer's partial in flagged row chunks; "whole": one push
  own_rows_schedule: str
  own_rows_swizzle: int
  peer_rows_swizzle: int
  grid_sms: int = 0


@dataclasses.dataclass(frozen=True)
class MatmulAllReduceChoice:
  tile: str            # one of AR_TILES
  push: str            # "chunked": the partial in row chunks, each flagged as it lands; "whole"
  swizzle: int
  grid_sms: int = 0


_CHOICE_TYPES = {"all_gather_matmul": AllGatherMatmulChoice,
                 "matmul_reduce_scatter": MatmulReduceScatterChoice,
                 "matmul_all_reduce": MatmulAllReduceChoice}


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


# field -> (check, what it takes), per op.
_GRID = (lambda v: _is_int(v) and v >= 0, "an int >= 0 (0: every SM)")
_SWIZZLE = (lambda v: _is_int(v) and v in SWIZZLES, "1, 2, 4 or 8")
_PUSH = (lambda v: v in ("chunked", "whole"), "'chunked' or 'whole'")
FIELDS = {
    "all_gather_matmul": {
        "tile": (lambda v: v in AG_TILES, " or ".join(map(repr, AG_TILES))),
        "swizzle": _SWIZZLE,
        "local_read": (lambda v: v in ("direct", "copy"), "'direct' or 'copy'"),
        "grid_sms": _GRID,
    },
    "matmul_reduce_scatter": {
        "reduce": (lambda v: v in ("epilogue", "pass"), "'epilogue' or 'pass'"),
        "push": _PUSH,
        "own_rows_schedule": (lambda v: v in OWN_ROWS_SCHEDULES,
                              " or ".join(map(repr, OWN_ROWS_SCHEDULES))),
        "own_rows_swizzle": _SWIZZLE,
        "peer_rows_swizzle": _SWIZZLE,
        "grid_sms": _GRID,
    },
    "matmul_all_reduce": {
        "tile": (lambda v: v in AR_TILES, " or ".join(map(repr, AR_TILES))),
        "push": _PUSH,
        "swizzle": _SWIZZLE,
        "grid_sms": _GRID,
    },
    "grouped_matmul": {
        "tile": (lambda v: v in GROUPED_TILES, " or ".join(map(repr, GROUPED_TILES))),
    },
}


def check_op(op: str, ops: tuple = OPS) -> None:
  if op not in ops:
    raise ValueError(f"jaxflux.tuning: op={op!r} is not one of {ops}.")


def check_fields(op: str, fields: dict) -> None:
  for name, value in fields.items():
    if name not in FIELDS[op]:
      raise ValueError(f"jaxflux.tuning.override({op!r}): unknown field {name!r}; the fields "
                       f"are {tuple(FIELDS[op])}.")
    check, takes = FIELDS[op][name]
    try:
      ok = check(value)
    except TypeError:  # unhashable values
      ok = False
    if not ok:
      raise ValueError(f"jaxflux.tuning.override({op!r}): {name}={value!r} is not valid; "
                       f"{name} takes {takes}.")


def shape_classes(op: str) -> tuple:
  """Every shape class of `op`: the names its classifier (jaxflux.tuning.chooser) returns and
  the tables are keyed by."""
  check_op(op)
  if op == "all_gather_matmul":
    return ("few_waves", "many_waves", "many_waves.wide_bands")
  if op == "matmul_all_reduce":
    return ("decode", "prefill.rows_lt_2048", "prefill.rows_ge_2048")
  return ("tp_not_2", "batched") + tuple(
      f"{base}.{rows}" for base in ("whole_epilogue", "chunked", "chunked_long_k")
      for rows in ("rows_lt_2048", "rows_ge_2048"))
