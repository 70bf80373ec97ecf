"""Kernel choices of the fused ops: shape classification, table lookup and overrides.

The fused ops ask `choose_all_gather_matmul` / `choose_matmul_reduce_scatter` /
`choose_matmul_all_reduce` once per call, at trace time, and hand the choice to the kernel as FFI
attributes. The choices come from the measured table (jaxflux/tuning/table.py) unless an
`override` block replaces fields:

  with jaxflux.tuning.override("matmul_reduce_scatter", reduce="pass", grid_sms=100):
    f = jax.jit(...)   # jit caches traces: build and trace the function inside the block

Overrides live on a per-thread stack (tracing runs in the calling thread); nested blocks compose,
the inner one winning per field. Every value is checked when the block is entered.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import NamedTuple

from jaxflux.tuning.grouped import GROUPED_TILES, choose_grouped_matmul
from jaxflux.tuning.table import AUTO_RULES, ENTRIES, AutoRule, Entry

ARCH = "sm90"  # the fused kernels' one target (Hopper)
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

__all__ = ["AUTO_RULES", "ENTRIES", "GROUPED_TILES", "AllGatherMatmulChoice", "AutoRule", "Entry",
           "MatmulAllReduceChoice", "MatmulReduceScatterChoice", "Tuned",
           "all_gather_matmul_class", "auto_prefers_fused", "choose_all_gather_matmul",
           "choose_grouped_matmul", "choose_matmul_all_reduce", "choose_matmul_reduce_scatter",
           "choose_own_rows_gemm", "candidates",
           "lookup", "matmul_all_reduce_class", "matmul_reduce_scatter_class", "override",
           "shape_classes"]


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
}


def _check_op(op: str) -> None:
  if op not in OPS:
    raise ValueError(f"jaxflux.tuning: op={op!r} is not one of {OPS}.")


def _check_fields(op: str, fields: dict) -> None:
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


_local = threading.local()


def _stack() -> list:
  if not hasattr(_local, "stack"):
    _local.stack = []
  return _local.stack


@contextlib.contextmanager
def override(op: str, **fields):
  """Replaces fields of `op`'s choice in calls traced inside the block (checked at once)."""
  _check_op(op)
  _check_fields(op, fields)
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


# --------------------------------------------------------------------------------------------
# Shape classes (what the table is keyed by).

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
  _check_op(op)
  if op == "all_gather_matmul":
    return ("few_waves", "many_waves", "many_waves.wide_bands")
  if op == "matmul_all_reduce":
    return ("decode", "prefill.rows_lt_2048", "prefill.rows_ge_2048")
  return ("tp_not_2", "batched") + tuple(
      f"{base}.{rows}" for base in ("whole_epilogue", "chunked", "chunked_long_k")
      for rows in ("rows_lt_2048", "rows_ge_2048"))


def candidates(op: str) -> tuple[dict, ...]:
  """The choices the tuning sweep (`python -m jaxflux.bench --op gemm --candidates`) times for
  `op`'s GEMM, as override fields: every tile (all_gather_matmul) or own-rows schedule
  (matmul_reduce_scatter) with every swizzle. The table's entries are picked from these."""
  _check_op(op)
  if op == "all_gather_matmul":
    return tuple({"tile": t, "swizzle": s} for t in AG_TILES for s in SWIZZLES)
  if op == "matmul_reduce_scatter":
    return tuple({"own_rows_schedule": o, "own_rows_swizzle": s}
                 for o in OWN_ROWS_SCHEDULES for s in SWIZZLES)
  raise ValueError(f"jaxflux.tuning.candidates: no sweep for {op!r}; the sweep covers "
                   "'all_gather_matmul' and 'matmul_reduce_scatter'.")


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


def choose_all_gather_matmul(*, dtype: str, tp: int, rows: int, n: int, sms: int,
                             shard_rows: int = 0, arch: str = ARCH) -> Tuned:
  """The all-gather GEMM's choice for `rows` computed rows (batch * tp * m), local N `n` and
  shards of `shard_rows` rows (m; 0: unknown)."""
  shape_class = all_gather_matmul_class(rows, n, sms, shard_rows)
  entry = lookup("all_gather_matmul", str(dtype), tp, shape_class, arch)
  fields = {**entry.choice, **overrides("all_gather_matmul")}
  return Tuned(AllGatherMatmulChoice(**fields), shape_class)


def choose_matmul_reduce_scatter(*, dtype: str, tp: int, batch: int, m: int, k: int, n: int,
                                 itemsize: int, arch: str = ARCH) -> Tuned:
  """GEMM+RS's choice for m own rows per batch entry, K_local k and N n, normalized (see
  `normalize_matmul_reduce_scatter`)."""
  shape_class = matmul_reduce_scatter_class(tp, batch, m, k, n, itemsize)
  entry = lookup("matmul_reduce_scatter", str(dtype), tp, shape_class, arch)
  forced = overrides("matmul_reduce_scatter")
  choice = MatmulReduceScatterChoice(**{**entry.choice, **forced})
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
                             itemsize: int, arch: str = ARCH) -> Tuned:
  """GEMM+AllReduce's choice for x [batch, m, k] and N n, classified by its rows (batch * m).
  A chunked push needs an unbatched x (a batched output's row chunks are not contiguous): the
  table's chunked push turns whole for a batched x; an overridden one raises. k, n and itemsize
  complete the problem like the other ops' choosers take it; the classes split by rows alone."""
  del k, n, itemsize
  op = "matmul_all_reduce"
  shape_class = matmul_all_reduce_class(batch * m)
  entry = lookup(op, str(dtype), tp, shape_class, arch)
  forced = overrides(op)
  choice = MatmulAllReduceChoice(**{**entry.choice, **forced})
  if choice.push == "chunked" and batch > 1:
    if forced.get("push") == "chunked":
      raise ValueError(f"{op}: push='chunked' needs an unbatched x (a batched output's row "
                       f"chunks are not contiguous); here x has {batch} batch entries. Override "
                       "push='whole', or fold the batch into the token axis.")
    choice = dataclasses.replace(choice, push="whole")
  return Tuned(choice, shape_class)


def choose_own_rows_gemm(*, dtype: str, rows: int, k: int, n: int, itemsize: int) -> Tuned:
  """GEMM-only own-rows kernel: tuned as GEMM+RS at tp=2 tunes an own-rows GEMM of `rows` rows
  (batch 1)."""
  return choose_matmul_reduce_scatter(dtype=dtype, tp=2, batch=1, m=rows, k=k, n=n,
                                      itemsize=itemsize)


def auto_prefers_fused(op: str, tp: int, rows: int, k: int, arch: str = ARCH) -> bool:
  """impl="auto": whether an AUTO_RULES rule says the fused kernel wins for `rows` rows (the
  GEMM's: gathered rows for all_gather_matmul, x's rows for matmul_reduce_scatter) and K_local
  `k`. No rule for (op, arch, tp): XLA."""
  for rule in AUTO_RULES:
    if (rule.op, rule.arch, rule.tp) == (op, arch, tp):
      return rows >= rule.min_rows and (rule.max_rows_times_k is None
                                        or rows * k <= rule.max_rows_times_k)
  return False
