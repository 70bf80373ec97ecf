"""A fused call's kernel choice: its shape class, the sm90 defaults' entry for it, the fields
the device's tables give it, and the active overrides, each replacing fields of the one before
(the layers jaxflux.tuning's docstring lists). Every op's chooser classifies, looks up and
overrides here, in one place; the device tables are read below it (tables.py)."""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import NamedTuple

from jaxflux.tuning import device as _device
from jaxflux.tuning import tables
from jaxflux.tuning.device import Device
from jaxflux.tuning.fields import (OVERRIDE_OPS, TILE_ROWS, AllGatherMatmulChoice,
                                   MatmulAllReduceChoice, MatmulReduceScatterChoice,
                                   check_fields, check_op)
from jaxflux.tuning.table import ENTRIES, Entry

ARCH = "sm90"  # the fused kernels' one target (Hopper)
LOCAL = "local"  # `device=` of the choosers: this process's first GPU (no GPU: the defaults)


def resolve_device(device) -> Device | None:
  return _device.current() if device == LOCAL else device


# --- overrides ---------------------------------------------------------------------------------

_local = threading.local()


def _stack() -> list:
  if not hasattr(_local, "stack"):
    _local.stack = []
  return _local.stack


@contextlib.contextmanager
def override(op: str, **fields):
  """Replaces fields of `op`'s choice in calls traced inside the block (checked at once). `op`:
  one of OVERRIDE_OPS; "grouped_matmul" sets the tile of every grouped GEMM a
  `jaxflux.grouped_matmul` or MoE op (`all_gather_grouped_matmul`,
  `grouped_matmul_reduce_scatter`) traced in the block runs, forward and backward."""
  check_op(op, OVERRIDE_OPS)
  check_fields(op, fields)
  stack = _stack()
  stack.append((op, dict(fields)))
  try:
    yield
  finally:
    stack.pop()


def overrides(op: str) -> dict:
  """The fields the active override blocks set for `op`, inner blocks winning."""
  merged: dict = {}
  for name, fields in _stack():
    if name == op:
      merged.update(fields)
  return merged


# --- shape classes: what the tables are keyed by, from a call's per-device GEMM ----------------

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


# --- the choosers ------------------------------------------------------------------------------

def lookup(op: str, dtype: str, tp: int, shape_class: str, arch: str = ARCH) -> Entry:
  """The table's entry for these keys: the first matching, exact values before "*"."""
  matches = [e for e in ENTRIES if e.op == op and e.arch == arch and e.dtype in (dtype, "*")
             and e.tp in (tp, "*") and e.shape_class == shape_class]
  if not matches:
    raise LookupError(
        f"jaxflux.tuning: no table entry for {op} on {arch}, dtype {dtype}, tp={tp}, shape "
        f"class {shape_class!r}. Add one to jaxflux/tuning/table.py (ENTRIES), with the "
        "measurement that backs it, or run the op with impl='xla'.")
  return min(matches, key=lambda e: (e.dtype == "*", e.tp == "*"))  # min is stable


class Tuned(NamedTuple):
  choice: AllGatherMatmulChoice | MatmulReduceScatterChoice | MatmulAllReduceChoice
  shape_class: str


def _device_fields(device, op: str, dtype: str, tp: int, shape_class: str,
                   problem: tuple | None, band_rows: int) -> dict:
  """The GEMM fields the device's tables give this call (the first table that has its exact
  shape or its class), or {}."""
  for table in tables.active(device).tables:
    fields = table.fields(op, dtype, tp, shape_class, problem, band_rows)
    if fields is not None:
      return fields
  return {}


def choose_all_gather_matmul(*, dtype: str, tp: int, rows: int, k: int, n: int, sms: int,
                             shard_rows: int = 0, device=LOCAL) -> Tuned:
  """The all-gather GEMM's choice for `rows` computed rows (batch * tp * m), K k, local N `n`
  and shards of `shard_rows` rows (m; 0: unknown), on `device` (a Device, None for the sm90
  defaults alone, LOCAL for this process's GPU). A device table's exact shapes are keyed by
  (rows, k, n) of an unbatched x (rows == tp * shard_rows)."""
  op = "all_gather_matmul"
  shape_class = all_gather_matmul_class(rows, n, sms, shard_rows)
  entry = lookup(op, str(dtype), tp, shape_class)
  problem = (rows, k, n) if rows == tp * shard_rows else None
  tuned = _device_fields(resolve_device(device), op, str(dtype), tp, shape_class, problem,
                         shard_rows)
  fields = {**entry.choice, **tuned, **overrides(op)}
  return Tuned(AllGatherMatmulChoice(**fields), shape_class)


def choose_matmul_reduce_scatter(*, dtype: str, tp: int, batch: int, m: int, k: int, n: int,
                                 itemsize: int, device=LOCAL) -> Tuned:
  """GEMM+RS's choice for m own rows per batch entry, K_local k and N n on `device` (as for
  `choose_all_gather_matmul`), normalized (see `normalize_matmul_reduce_scatter`). A device
  table's own-rows fields apply where the own-rows GEMM sums the peer's partial in its epilogue;
  its exact shapes are keyed by (m, k, n) of an unbatched x."""
  op = "matmul_reduce_scatter"
  shape_class = matmul_reduce_scatter_class(tp, batch, m, k, n, itemsize)
  entry = lookup(op, str(dtype), tp, shape_class)
  tuned = {}
  if entry.choice["reduce"] == "epilogue":
    problem = (m, k, n) if batch == 1 else None
    tuned = _device_fields(resolve_device(device), op, str(dtype), tp, shape_class, problem,
                           m)
  forced = overrides(op)
  choice = MatmulReduceScatterChoice(**{**entry.choice, **tuned, **forced})
  return Tuned(normalize_matmul_reduce_scatter(choice, forced, tp=tp, batch=batch), shape_class)


def normalize_matmul_reduce_scatter(choice: MatmulReduceScatterChoice, forced: dict, *,
                                    tp: int, batch: int) -> MatmulReduceScatterChoice:
  """What the kernel can run: the pass reduction takes the whole push (a chunked push serves
  the epilogue only); chunks need an unbatched x; the epilogue needs tp=2. `forced`: the
  overridden fields (a conflict among them is an error, never silently resolved)."""
  op = "matmul_reduce_scatter"
  if choice.reduce == "pass" and choice.push == "chunked":
    if forced.get("push") == "chunked":
      raise ValueError(f"{op}: push='chunked' needs reduce='epilogue' (the pass sums whole "
                       "partials); got reduce='pass'. Override reduce='epilogue' too, or drop "
                       "the push override.")
    choice = dataclasses.replace(choice, push="whole")
  if choice.push == "chunked" and batch > 1:
    raise ValueError(f"{op}: push='chunked' needs an unbatched x (a batched partial's row chunks "
                     f"are not contiguous); here x has {batch} batch entries. Override "
                     "push='whole', or fold the batch into the token axis.")
  if choice.reduce == "epilogue" and tp != 2:
    raise ValueError(f"{op}: reduce='epilogue' needs tp=2 (here tp={tp}): the epilogue sums one "
                     "peer's partial. Override reduce='pass', or drop the reduce override.")
  return choice


def choose_matmul_all_reduce(*, dtype: str, tp: int, batch: int, m: int, k: int, n: int,
                             itemsize: int) -> Tuned:
  """GEMM+AllReduce's choice for x [batch, m, k] and N n, classified by its rows (batch * m).
  A chunked push needs an unbatched x (a batched output's row chunks are not contiguous): the
  table's chunked push turns whole for a batched x; an overridden one raises. k, n and itemsize
  complete the problem like the other ops' choosers take it; the classes split by rows alone,
  and no device table tunes this op yet (the sm90 defaults)."""
  del k, n, itemsize
  op = "matmul_all_reduce"
  shape_class = matmul_all_reduce_class(batch * m)
  entry = lookup(op, str(dtype), tp, shape_class)
  forced = overrides(op)
  choice = MatmulAllReduceChoice(**{**entry.choice, **forced})
  if choice.push == "chunked" and batch > 1:
    if forced.get("push") == "chunked":
      raise ValueError(f"{op}: push='chunked' needs an unbatched x (a batched output's row "
                       f"chunks are not contiguous); here x has {batch} batch entries. Override "
                       "push='whole', or fold the batch into the token axis.")
    choice = dataclasses.replace(choice, push="whole")
  return Tuned(choice, shape_class)


def choose_own_rows_gemm(*, dtype: str, rows: int, k: int, n: int, itemsize: int,
                         device=LOCAL) -> Tuned:
  """GEMM-only own-rows kernel: tuned as GEMM+RS at tp=2 tunes an own-rows GEMM of `rows` rows
  (batch 1)."""
  return choose_matmul_reduce_scatter(dtype=dtype, tp=2, batch=1, m=rows, k=k, n=n,
                                      itemsize=itemsize, device=device)


def choose_tp1_gemm(*, dtype: str, rows: int, k: int, n: int, itemsize: int) -> Tuned:
  """The GEMM an op runs at tp=1 (GEMM+AllReduce's GEMM with nothing to reduce): tuned as
  GEMM+AllReduce at tp=2 tunes an unbatched x of `rows` rows."""
  return choose_matmul_all_reduce(dtype=dtype, tp=2, batch=1, m=rows, k=k, n=n,
                                  itemsize=itemsize)
