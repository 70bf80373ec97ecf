"""Shape classes: what the tables are keyed by, from a call's per-device GEMM."""
from __future__ import annotations

from jaxflux.tuning.fields import TILE_ROWS, check_op


_MIN_WAVES = 4                  # all-gather tile: ping-pong under 4 waves of 128x256 tiles
# All-gather swizzle 8 sweeps bands of 8 cluster rows (8 x 2 tiles x 128 = 2048 rows) across N.
_WIDE_BAND_ROWS = 2048
_WIDE_BAND_N_TILES = 8
_EPILOGUE_BYTES_PER_K = 6144    # the epilogue's no-stall partial size, bytes per K
_PINGPONG_MAX_K = 16384         # own-rows ping-pong up to this K_local
_SWIZZLE_MIN_ROWS = 2048        # own-rows swizzle 4 from two bands of 4 cluster rows of tiles
_DECODE_MAX_ROWS = 128          # GEMM+AllReduce: up to here a decode GEMM (a read of the weight)


def all_gather_matmul_class(rows: int, n: int, sms: int, shard_rows: int = 0) -> str:
  """"few_waves" when the GEMM's 128x256 tiles (rows = all rows it computes, n = local N) fill
  under 4 waves of `sms` SMs (the SM count known, > 0). Else "many_waves.wide_bands" when bands
  of 2048 rows tile every shard (shard_rows, a batch entry's rows of one rank; 0: unknown) and N
  is whole groups of 8 256-column tiles: swizzle 8's bands then hold no tiles past M or N (CUTLASS
  rounds both tile counts up to the band) and none waits for two ranks' rows. Else
  "many_waves"."""
  tiles_n = -(-n // 256)
  if sms > 0 and -(-rows // 128) * tiles_n < _MIN_WAVES * sms:
    return "few_waves"
  if shard_rows > 0 and shard_rows % _WIDE_BAND_ROWS == 0 and tiles_n % _WIDE_BAND_N_TILES == 0:
    return "many_waves.wide_bands"
  return "many_waves"


def matmul_reduce_scatter_class(tp: int, batch: int, m: int, k: int, n: int,
                                itemsize: int) -> str:
  """The class of GEMM+RS with m own rows per batch entry, K_local k, N n."""
  if tp != 2:
    return "tp_not_2"
  partial = batch * m * n * itemsize
  if partial <= _EPILOGUE_BYTES_PER_K * k or (batch == 1 and m <= TILE_ROWS):
    base = "whole_epilogue"
  elif batch > 1:
    return "batched"
  elif k <= _PINGPONG_MAX_K:
    base = "chunked"
  else:
    base = "chunked_long_k"
  return f"{base}.{'rows_ge_2048' if m >= _SWIZZLE_MIN_ROWS else 'rows_lt_2048'}"


def matmul_all_reduce_class(rows: int) -> str:
  """The class of GEMM+AllReduce computing `rows` = batch * M rows: "decode" up to 128 rows
  (the GEMM reads the weight once: its time is the weight's bytes over the memory's rate), else
  "prefill", suffixed by rows as GEMM+RS's own rows are (the swizzle pays from 2048 rows)."""
  if rows <= _DECODE_MAX_ROWS:
    return "decode"
  return f"prefill.{'rows_ge_2048' if rows >= _SWIZZLE_MIN_ROWS else 'rows_lt_2048'}"


def shape_classes(op: str) -> tuple:
  """Every class the classifier of `op` can return, from the same branches."""
  check_op(op)
  if op == "all_gather_matmul":
    return ("few_waves", "many_waves", "many_waves.wide_bands")
  if op == "matmul_all_reduce":
    return ("decode", "prefill.rows_lt_2048", "prefill.rows_ge_2048")
  return ("tp_not_2", "batched") + tuple(
      f"{base}.{rows}" for base in ("whole_epilogue", "chunked", "chunked_long_k")
      for rows in ("rows_lt_2048", "rows_ge_2048"))
