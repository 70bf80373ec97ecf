"""Random cases of the three fused ops for a reliability fuzz: their data, the float64 reference
of each rank's output, and the check of an output against it.

Drawing, data, references and checks are NumPy alone (ml_dtypes for bfloat16 and the FP8
formats), importable without a GPU; the few functions at the end that run a case import JAX
when called. tests/multiprocess_gpu_worker.py (MODE=fuzz, two processes sharing a GPU),
tests/test_fuzz_gpu.py (tp=1 on one GPU) and tests/test_fuzz_cases.py (the XLA path on CPU)
draw the same cases from it.

A case is drawn from its own generator, seeded by (run seed, op, index), so any case can be
replayed alone from (seed, op, index) (Case.replay) and narrowing the count does not change the
others; its data comes from a per-case seed it carries. At tp >= 2 half the cases also force
the op's kernel choices (tile, schedule, reduction, push, swizzle) through
jaxflux.tuning.override. Every case is one per-rank problem of one op at a group size tp:

  all_gather_matmul      x [*b, m, K] (this rank's tokens), w [K, n] ([n, K] with
                         transpose_w): y [*b, tp*m, n], and x_full [*b, tp*m, K] with
                         return_gathered
  matmul_reduce_scatter  x [*b, tp*m, k], w [k, N] ([N, k]): z [*b, m, N], this rank's rows of
                         the sum over the ranks
  matmul_all_reduce      x [*b, m, k], w [k, N] ([N, k]): y [*b, m, N], the sum over the
                         ranks, on every rank

So `m` is always the per-rank token rows the op is about, `k` the contraction one rank holds and
`n` the output columns one rank writes.

Tolerances. Inputs are exactly representable in their dtype and the reference multiplies those
same values in float64, so only what the kernels round is measured:
  - the output, rounded once to bfloat16 / float16 (round to nearest: at most u|y| per element,
    u = 2^-8 and 2^-11, or half the subnormal step where |y| is below the smallest normal, as
    gradients of tiny values can be);
  - GEMM+RS's and GEMM+AR's partial products, pushed between ranks in the output dtype and
    summed in fp32 (reduce_kernels.cu, the RS epilogue's C): at most u|p_r| per element each;
  - accumulation: fp32 for bf16/fp16 (error ~2^-24 sqrt(K) of the products' scale, negligible
    next to the output's rounding); the FP8 kernels' fast accumulation keeps a narrower running
    sum, whose error test_fp8_gpu.py measured under 6e-3 relative Frobenius, output rounding
    included, for every K up to 24576: FP8_ACCUMULATION below leaves it 5e-3.
The relative Frobenius bound adds the roundings in quadrature (they are independent) at their
worst case u, which is 2.4x their RMS (about 0.42u for values spread over a binade): bf16 3.9e-3
without partials and about 5.5e-3 with two, fp16 4.9e-4 / 6.9e-4, FP8 about 6.3e-3 / 7.4e-3.
Every element is checked too, against the worst case of each rounding added up, plus the
accumulation error scaled by the element's own magnitude sqrt(sum_k (x_ik w_kj)^2); a
non-finite element fails the case. tests/test_fuzz_cases.py rounds every case's reference as a
correct kernel rounds it and checks that it passes, with room to spare (err/bound <= ~0.55).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re

import ml_dtypes
import numpy as np

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
SHORT = {"all_gather_matmul": "ag", "matmul_reduce_scatter": "rs", "matmul_all_reduce": "ar"}
DEFAULT_SEED = 20250611
CASES_PER_OP = 150  # at tp=2
# At tp 4 and 8 (cases_per_op): the ranks take turns on one GPU, so a case costs about tp/2 more.
CASES_PER_OP_MORE_RANKS = 100
TILE_ROWS = 128  # jaxflux.tuning.TILE_ROWS: the kernels' row tile (a test keeps them equal)
# The largest GEMM a case runs (rows * K * N on one rank) and the most elements of all ranks'
# x, w and output together: each case is a fresh compile, so the fuzz lives on many small cases.
MAX_WORK = 2 ** 31
MAX_ELEMENTS = 2 ** 23
MAX_DIM = 4096

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.dtype(np.float16),
          "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
FP8_W_DTYPE = "float8_e4m3fn"  # the fused FP8 kernels take an e4m3 weight only
# Unit roundoff of the output dtype (FP8 calls write bfloat16).
ROUNDING = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
# Below the smallest normal the rounding is absolute: half the subnormal step (float16 2^-24).
SUBNORMAL_ROUNDING = {"bfloat16": 2.0 ** -134, "float16": 2.0 ** -25}
FP32_ACCUMULATION = 2.0 ** -14  # far above fp32 summation's ~2^-24 sqrt(K): a safe allowance
FP8_ACCUMULATION = 5e-3  # fast accumulation, relative Frobenius (module docstring)
# The same per element, relative to its magnitude: 12x the Frobenius allowance, for the tail
# of the elements' errors.
FP8_ACCUMULATION_ELEMENT = 2.0 ** -4


@dataclasses.dataclass(frozen=True)
class Case:
  op: str
  index: int           # position among this op's cases of the run
  seed: int            # the run's seed
  data_seed: int       # this case's data (make_shards)
  tp: int
  dtype: str           # x's dtype (w's too, but e4m3 for FP8)
  batch: tuple         # leading batch dims of x
  m: int               # per-rank token rows (module docstring)
  k: int               # the contraction one rank holds
  n: int               # the output columns one rank writes
  transpose_w: bool    # w given [n, k]
  return_gathered: bool  # all_gather_matmul also returns x_full
  x_scale: str | None = None  # FP8: "tensor" or "row"
  w_scale: str | None = None  # FP8: "tensor" or "column"
  scalar_scales: bool = False  # FP8: per-tensor scales of shape () instead of (1,)
  tuning: tuple = ()   # (field, value) pairs forced with jaxflux.tuning.override; () the table's

  @property
  def fp8(self) -> bool:
    return self.dtype.startswith("float8")

  @property
  def w_dtype(self) -> str:
    return FP8_W_DTYPE if self.fp8 else self.dtype

  @property
  def out_dtype(self) -> str:
    return "bfloat16" if self.fp8 else self.dtype

  @property
  def x_rows(self) -> int:
    """Rows of x on one rank."""
    return self.tp * self.m if self.op == "matmul_reduce_scatter" else self.m

  @property
  def x_shape(self) -> tuple:
    return self.batch + (self.x_rows, self.k)

  @property
  def w_shape(self) -> tuple:
    return (self.n, self.k) if self.transpose_w else (self.k, self.n)

  @property
  def out_shape(self) -> tuple:
    rows = self.tp * self.m if self.op == "all_gather_matmul" else self.m
    return self.batch + (rows, self.n)

  @property
  def work(self) -> int:
    """rows * K * N of the GEMM one rank runs."""
    rows = self.m if self.op == "matmul_all_reduce" else self.tp * self.m
    return math.prod(self.batch) * rows * self.k * self.n

  @property
  def elements(self) -> int:
    """Elements of every rank's x, w and output."""
    return self.tp * (math.prod(self.x_shape) + self.k * self.n + math.prod(self.out_shape))

  def describe(self) -> str:
    kind = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "e4m3",
            "float8_e5m2": "e5m2"}[self.dtype]
    text = (f"{kind} b={'x'.join(map(str, self.batch)) or '-'} m={self.m} k={self.k} "
            f"n={self.n} tw={int(self.transpose_w)}")
    if self.op == "all_gather_matmul":
      text += f" rg={int(self.return_gathered)}"
    if self.fp8:
      text += f" xs={self.x_scale} ws={self.w_scale}{' scalar' if self.scalar_scales else ''}"
    if self.tuning:
      text += " tuning=" + ",".join(f"{k}:{v}" for k, v in self.tuning)
    return text

  def replay(self) -> str:
    """The environment that reruns this case alone (tests/multiprocess_gpu_worker.py)."""
    return f"JAXFLUX_FUZZ_SEED={self.seed} JAXFLUX_FUZZ_CASES={SHORT[self.op]}:{self.index}"


# --- drawing cases ----------------------------------------------------------------------------

def draw_cases(seed: int = DEFAULT_SEED, tp: int = 2, per_op: int = CASES_PER_OP,
               ops=OPS) -> list:
  """per_op cases of each op, op by op."""
  return [draw_case(seed, op, i, tp) for op in ops for i in range(per_op)]


def draw_case(seed: int, op: str, index: int, tp: int) -> Case:
  """Case `index` of `op`, from its own generator: the same case whatever else is drawn."""
  rng = np.random.default_rng([seed, OPS.index(op), index])
  # The dtype cycles with the index, so any few consecutive cases cover every kind.
  kinds = ("bfloat16", "float16", "fp8")
  dtype = kinds[index % len(kinds)]
  if dtype == "fp8":
    dtype = ("float8_e4m3fn", "float8_e5m2")[int(rng.integers(2))]
  fp8 = dtype.startswith("float8")
  granule = 16 if fp8 else 8  # 16-byte rows for the kernels' TMA loads
  while True:  # redrawn until within the budget (most draws are)
    batch = _batch(rng)
    m, k, n = _rows(rng), _dim(rng, granule), _dim(rng, granule)
    case = Case(
        op=op, index=index, seed=seed, data_seed=int(rng.integers(2 ** 63)), tp=tp, dtype=dtype,
        batch=batch, m=m, k=k, n=n,
        transpose_w=fp8 or bool(rng.random() < 0.5),
        return_gathered=op == "all_gather_matmul" and bool(rng.random() < 0.5),
        x_scale=("tensor", "row")[int(rng.integers(2))] if fp8 else None,
        w_scale=("tensor", "column")[int(rng.integers(2))] if fp8 else None,
        scalar_scales=fp8 and bool(rng.random() < 0.5))
    if case.work <= MAX_WORK and case.elements <= MAX_ELEMENTS:
      return dataclasses.replace(case, tuning=_tuning(rng, case))


# The kernel choices a case may force (jaxflux.tuning.FIELDS), so that the fuzz runs the kernels
# the table picks only for shapes past its budget too: the fuzz's all-gather GEMMs all fill
# under 4 waves, where the table always takes the ping-pong tile.
AG_TILES = ("cooperative_128x256_cluster2x1", "pingpong_128x128_cluster1x2")
AR_TILES = ("cooperative_128x256_cluster2x1", "cooperative_128x128_streamk",
            "swap_ab_streamk")
AR_FP8_TILES = ("cooperative_128x256_cluster2x1", "swap_ab_streamk")  # no FP8 stream-K 128x128
SWIZZLES = (1, 2, 4, 8)


def _tuning(rng, case: Case) -> tuple:
  """Half the cases at tp >= 2 force the op's kernel choices; the others keep the table's. Only
  combinations the override takes: a chunked push needs an unbatched x (and, in GEMM+RS, the
  epilogue reduction, which needs tp=2)."""
  if case.tp < 2 or rng.random() < 0.5:
    return ()
  pick = lambda options: options[int(rng.integers(len(options)))]  # noqa: E731
  unbatched = not case.batch
  if case.op == "all_gather_matmul":
    return (("tile", pick(AG_TILES)), ("swizzle", pick(SWIZZLES)),
            ("local_read", pick(("direct", "copy"))))
  if case.op == "matmul_reduce_scatter":
    reduce = pick(("epilogue", "pass")) if case.tp == 2 else "pass"
    chunked = unbatched and reduce == "epilogue" and rng.random() < 0.5
    return (("reduce", reduce), ("push", "chunked" if chunked else "whole"),
            ("own_rows_schedule", pick(("cooperative", "pingpong"))),
            ("own_rows_swizzle", pick(SWIZZLES)))
  chunked = unbatched and rng.random() < 0.5
  tiles = AR_FP8_TILES if case.fp8 else AR_TILES
  return (("tile", pick(tiles)), ("push", "chunked" if chunked else "whole"),
          ("swizzle", pick(SWIZZLES)))


def _log_uniform(rng, lo: float, hi: float) -> float:
  return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _rows(rng) -> int:
  """Per-rank token rows: whole 128-row tiles (the AG kernel then reads its own rows straight
  from x), odd counts (every op takes them: a tile then holds rows of two ranks, or a partial
  last tile), a few rows (decode), or anything up to 2048."""
  u = rng.random()
  if u < 0.3:
    return TILE_ROWS * int(rng.integers(1, 17))
  if u < 0.6:
    return int(_log_uniform(rng, 1, 2048)) | 1
  if u < 0.8:
    return int(rng.integers(1, 17))
  return int(_log_uniform(rng, 1, 2048))


def _dim(rng, granule: int) -> int:
  """K or N: a multiple of `granule`, thinner than a tile (8, 16, 24, ...), whole 128-wide tiles,
  or anything up to MAX_DIM."""
  u = rng.random()
  if u < 0.35:
    return granule * int(rng.integers(1, 5))
  if u < 0.6:
    return 128 * int(rng.integers(1, MAX_DIM // 128 + 1))
  return granule * max(1, round(_log_uniform(rng, granule, MAX_DIM) / granule))


def _batch(rng) -> tuple:
  u = rng.random()
  if u < 0.6:
    return ()
  if u < 0.85:
    return (int(rng.integers(1, 5)),)
  return (int(rng.integers(1, 4)), int(rng.integers(1, 4)))


def select(cases: list, spec: str | None) -> list:
  """The cases a JAXFLUX_FUZZ_CASES value names: comma-separated items, each `N` (the first N
  cases of every op), `OP:I` or `OP:I-J` (OP an op's name or its short name ag/rs/ar). None or
  empty: every case."""
  if not spec:
    return list(cases)
  names = {**{op: op for op in OPS}, **{s: op for op, s in SHORT.items()}}
  keep = set()
  for item in spec.split(","):
    item = item.strip()
    if re.fullmatch(r"\d+", item):
      keep |= {(c.op, c.index) for c in cases if c.index < int(item)}
      continue
    match = re.fullmatch(r"(\w+):(\d+)(?:-(\d+))?", item)
    if not match or match.group(1) not in names:
      raise ValueError(f"JAXFLUX_FUZZ_CASES item {item!r}: expected N, OP:I or OP:I-J with OP "
                       f"in {sorted(names)}")
    lo = int(match.group(2))
    hi = int(match.group(3) or lo)
    keep |= {(names[match.group(1)], i) for i in range(lo, hi + 1)}
  return [c for c in cases if (c.op, c.index) in keep]


def cases_per_op(tp: int) -> int:
  """The shared-GPU fuzz's cases per op at tp ranks."""
  return CASES_PER_OP if tp <= 2 else CASES_PER_OP_MORE_RANKS


def from_env(tp: int, environ=None, per_op: int | None = None) -> tuple:
  """(seed, cases) as JAXFLUX_FUZZ_SEED and JAXFLUX_FUZZ_CASES set them (defaults: DEFAULT_SEED,
  every case of cases_per_op(tp) per op). JAXFLUX_FUZZ_FORCE_CHOICES=0 runs every case with the
  table's kernel choices (whether a failing case with forced choices fails with the table's
  too)."""
  environ = os.environ if environ is None else environ
  seed = int(environ.get("JAXFLUX_FUZZ_SEED") or DEFAULT_SEED)
  per_op = cases_per_op(tp) if per_op is None else per_op
  cases = select(draw_cases(seed, tp, per_op), environ.get("JAXFLUX_FUZZ_CASES"))
  if environ.get("JAXFLUX_FUZZ_FORCE_CHOICES") == "0":
    cases = [dataclasses.replace(c, tuning=()) for c in cases]
  return seed, cases


# --- data -------------------------------------------------------------------------------------

def _normal(rng, shape) -> np.ndarray:
  return rng.standard_normal(shape, dtype=np.float32)


def make_shards(case: Case) -> list:
  """Every rank's operands, as the op takes them on that rank: dicts of x, w (and, FP8,
  x_scale, w_scale), NumPy arrays in their dtypes.

  The global x and w are normal (w / sqrt of the whole contraction, so outputs are O(1)); each
  rank's shard is its slice. FP8: rank r's x is first scaled by its own 2^U(-3, 3), so the
  ranks' per-tensor scales differ; with row / column scales every row of x and column of w is
  scaled by 2^U(-4, 4) too, so a scale applied to the wrong row or column shows. Each scale puts
  the largest magnitude it covers within the format's range, with up to 2 bits of headroom."""
  rng = np.random.default_rng(case.data_seed)
  tp, b, m, k, n = case.tp, case.batch, case.m, case.k, case.n
  if case.op == "all_gather_matmul":
    x = _normal(rng, b + (tp * m, k))
    w = _normal(rng, (k, tp * n)) / np.float32(math.sqrt(k))
    xs = [x[..., r * m:(r + 1) * m, :] for r in range(tp)]
    ws = [w[:, r * n:(r + 1) * n] for r in range(tp)]
  else:
    x = _normal(rng, b + (case.x_rows, tp * k))
    w = _normal(rng, (tp * k, n)) / np.float32(math.sqrt(tp * k))
    xs = [x[..., r * k:(r + 1) * k] for r in range(tp)]
    ws = [w[r * k:(r + 1) * k, :] for r in range(tp)]
  shards = []
  for r in range(tp):
    xr, wr = xs[r], ws[r]
    if case.fp8:
      shards.append(_quantized(case, rng, xr, wr))
      continue
    shards.append({"x": np.ascontiguousarray(xr.astype(DTYPES[case.dtype])),
                   "w": np.ascontiguousarray((wr.T if case.transpose_w else wr)
                                             .astype(DTYPES[case.dtype]))})
  return shards


def _quantized(case: Case, rng, x, w) -> dict:
  x = x * np.float32(2.0 ** rng.uniform(-3, 3))
  if case.x_scale == "row":
    x = x * np.exp2(rng.uniform(-4, 4, x.shape[:-1] + (1,))).astype(np.float32)
  if case.w_scale == "column":
    w = w * np.exp2(rng.uniform(-4, 4, (1, w.shape[1]))).astype(np.float32)
  x_dtype, w_dtype = DTYPES[case.dtype], DTYPES[case.w_dtype]
  x_amax = np.abs(x).max(-1, keepdims=True) if case.x_scale == "row" else np.abs(x).max()
  w_amax = np.abs(w).max(0, keepdims=True) if case.w_scale == "column" else np.abs(w).max()
  x_scale = _scale(rng, x_amax, x_dtype)
  w_scale = _scale(rng, w_amax, w_dtype)
  x8 = _quantize(x, x_scale, x_dtype)
  w8 = _quantize(w, w_scale, w_dtype)
  per_tensor = () if case.scalar_scales else (1,)
  if case.x_scale == "tensor":
    x_scale = x_scale.reshape(per_tensor)
  if case.w_scale == "tensor":
    w_scale = w_scale.reshape(per_tensor)
  return {"x": x8, "w": np.ascontiguousarray(w8.T), "x_scale": x_scale, "w_scale": w_scale}


def _scale(rng, amax, dtype) -> np.ndarray:
  headroom = np.exp2(rng.uniform(0, 2, np.shape(amax)))
  return np.asarray(amax * headroom / float(ml_dtypes.finfo(dtype).max), np.float32)


def _quantize(a, scale, dtype) -> np.ndarray:
  fmax = float(ml_dtypes.finfo(dtype).max)
  return np.clip(a / scale, -fmax, fmax).astype(dtype)


# --- reference --------------------------------------------------------------------------------

@dataclasses.dataclass
class Expected:
  """One rank's expected output and what bounds the error of a correct kernel."""
  y: np.ndarray          # float64
  terms: tuple           # float64 parts rounded to the output dtype before being summed into y
  magnitude: np.ndarray  # float32 sqrt(sum_k (x_ik w_kj)^2): each element's accumulation scale
  out_dtype: str
  fp8: bool
  x_full: np.ndarray | None = None  # all_gather_matmul with return_gathered: x_full's bits


def dequantized(case: Case, shard: dict) -> tuple:
  """(x, w) of one rank in float64, w as [k, n]: the values the op multiplies, scales applied."""
  x = shard["x"].astype(np.float64)
  w = shard["w"].astype(np.float64)
  if case.fp8:  # w_scale is per output column, i.e. per row of the [n, k] w
    x = x * shard["x_scale"].astype(np.float64)
    w = w * shard["w_scale"].astype(np.float64).reshape(-1, 1)
  return x, (w.T if case.transpose_w else w)


def reference(case: Case, shards: list, rank: int) -> Expected:
  """Rank `rank`'s output of `case` on every rank's `shards`, in float64."""
  tp, m = case.tp, case.m
  values = [dequantized(case, s) for s in shards]
  x_full = None
  if case.op == "all_gather_matmul":
    x = np.concatenate([x for x, _ in values], axis=-2)
    w = values[rank][1]
    parts = [(x, w)]
    if case.return_gathered:
      x_full = np.concatenate([s["x"] for s in shards], axis=-2)
  elif case.op == "matmul_reduce_scatter":  # this rank's rows of every rank's partial
    parts = [(x[..., rank * m:(rank + 1) * m, :], w) for x, w in values]
  else:
    parts = values
  products = [x @ w for x, w in parts]
  magnitude = _magnitude(parts)
  # Partial products cross between ranks in the output dtype: each is rounded once.
  pushed = case.op != "all_gather_matmul" and tp > 1
  return Expected(y=sum(products), terms=tuple(products) if pushed else (),
                  magnitude=magnitude, out_dtype=case.out_dtype, fp8=case.fp8, x_full=x_full)


def matmul_expected(x, w, out_dtype: str) -> Expected:
  """x @ w in float64 (leading axes of x batch), rounded once to `out_dtype` by a correct
  kernel (gradients)."""
  x = np.asarray(x, np.float64)
  w = np.asarray(w, np.float64)
  return Expected(y=x @ w, terms=(), magnitude=_magnitude([(x, w)]), out_dtype=out_dtype,
                  fp8=False)


def _magnitude(parts) -> np.ndarray:
  """sqrt(sum over the contraction of (x_ik w_kj)^2) of the summed parts' products: the scale of
  an element's accumulation error (float32 is plenty for a bound)."""
  square = lambda a: np.square(a.astype(np.float32))  # noqa: E731
  return np.sqrt(sum(square(x) @ square(w) for x, w in parts))


# --- the check --------------------------------------------------------------------------------

@dataclasses.dataclass
class Verdict:
  ok: bool
  err: float    # relative Frobenius error (nan if not measured)
  bound: float  # its bound
  detail: str   # what failed, empty when ok

  def __str__(self) -> str:
    text = f"err={self.err:.3e} bound={self.bound:.3e}"
    return f"{text} {self.detail}" if self.detail else text


def bounds(expected: Expected) -> tuple:
  """(relative Frobenius bound, per-element bound array) of a correct kernel (module
  docstring)."""
  u = ROUNDING[expected.out_dtype]
  y_norm = np.linalg.norm(expected.y)
  terms_sq = sum(float(np.linalg.norm(t)) ** 2 for t in expected.terms)
  # Each rounding (the output's and every pushed partial's) may also be a subnormal one.
  roundings = 1 + len(expected.terms)
  subnormal = SUBNORMAL_ROUNDING[expected.out_dtype] * roundings
  rounding = math.sqrt(u ** 2 * (1.0 + terms_sq / y_norm ** 2)
                       + subnormal ** 2 * expected.y.size / y_norm ** 2)
  acc = FP8_ACCUMULATION if expected.fp8 else FP32_ACCUMULATION
  accumulation = acc * float(np.linalg.norm(expected.magnitude)) / y_norm
  frobenius = math.sqrt(rounding ** 2 + accumulation ** 2)
  acc_element = FP8_ACCUMULATION_ELEMENT if expected.fp8 else FP32_ACCUMULATION
  # float32 is plenty for a bound, and halves the memory traffic of large outputs.
  element = np.abs(expected.y, dtype=np.float32)
  for t in expected.terms:
    element += np.abs(t, dtype=np.float32)
  element *= np.float32(u * (1 + 2.0 ** -6))
  element += np.float32(acc_element) * expected.magnitude
  element += np.float32(subnormal)
  return frobenius, element


def check(expected: Expected, got) -> Verdict:
  """`got` (any float dtype) against `expected`: shape, every element finite and within its
  bound, and the relative Frobenius error within the bound; with expected.x_full, got is
  (y, x_full) and x_full must hold its bits exactly."""
  x_full = None
  if expected.x_full is not None:
    got, x_full = got
  got = np.asarray(got)
  if got.shape != expected.y.shape:
    return Verdict(False, math.nan, math.nan, f"shape {got.shape}, expected {expected.y.shape}")
  got = got.astype(np.float64)
  frobenius, element = bounds(expected)
  finite = np.isfinite(got)
  if not finite.all():
    where = np.argwhere(~finite)[0].tolist()
    return Verdict(False, math.nan, frobenius,
                   f"{int((~finite).sum())} non-finite elements, first at {where}")
  diff = got
  diff -= expected.y
  np.abs(diff, out=diff)
  err = float(np.linalg.norm(diff) / np.linalg.norm(expected.y))
  over = ~(diff <= element)
  if over.any():
    got = diff + expected.y  # for the message: |got - y| + y, exact enough
    i = np.unravel_index(np.argmax(np.where(over, diff / element, 0)), diff.shape)
    return Verdict(False, err, frobenius,
                   f"{int(over.sum())} elements over their bound, worst at {list(map(int, i))}: "
                   f"got {got[i]:.6g}, expected {expected.y[i]:.6g}, bound {element[i]:.3g}")
  if not err <= frobenius:
    return Verdict(False, err, frobenius, "relative Frobenius error over its bound")
  if x_full is not None:
    x_full = np.asarray(x_full)
    want = expected.x_full
    if (x_full.shape != want.shape or x_full.dtype != want.dtype
        or not np.array_equal(_bits(x_full), _bits(want))):
      return Verdict(False, err, frobenius,
                     f"x_full is not the gathered x bit for bit ({x_full.dtype}{x_full.shape}, "
                     f"expected {want.dtype}{want.shape})")
  return Verdict(True, err, frobenius, "")


def _bits(a) -> np.ndarray:
  return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


# --- the tensor-parallel MLP ------------------------------------------------------------------
# Column-parallel all_gather_matmul, GELU (tanh form, jax.nn.gelu's default) computed in
# float32 on the rounded pre-activation, row-parallel matmul_reduce_scatter; no bias.

MLP_SHAPES = (  # (batch, per-rank token rows m, model dim D, hidden H at tp=2: H*tp/2)
    ((), 256, 512, 1024),
    ((), 1, 8, 32),
    ((2,), 7, 64, 96),
    ((2, 3), 33, 128, 256),
    ((), 1024, 1024, 2048),
)
# Error allowed against float64 per output (z, dx, dw1, dw2), which goes through a chain of
# roundings in the output dtype (the pre-activation, the activation, the pushed partials and
# the output; in the backward the same again with GELU's derivative). JAX's XLA path, which
# rounds at the same points, measures at most 0.95u relative Frobenius on MLP_SHAPES and 3.4u
# per element relative to |z| + RMS(z): these leave about four times that.
MLP_TOL = {"bfloat16": 4 * ROUNDING["bfloat16"], "float16": 4 * ROUNDING["float16"]}
MLP_ELEMENT_TOL = {"bfloat16": 16 * ROUNDING["bfloat16"], "float16": 16 * ROUNDING["float16"]}

_GELU_C = math.sqrt(2.0 / math.pi)


def gelu(a):
  """GELU's tanh form in float64 (jax.nn.gelu(approximate=True))."""
  return 0.5 * a * (1.0 + np.tanh(_GELU_C * (a + 0.044715 * a ** 3)))


def gelu_grad(a):
  t = np.tanh(_GELU_C * (a + 0.044715 * a ** 3))
  return 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t ** 2) * _GELU_C * (1.0 + 3 * 0.044715 * a ** 2)


def mlp_data(seed: int, batch: tuple, tokens: int, d: int, h: int, dtype: str) -> dict:
  """Global x [*batch, tokens, D], w1 [D, H], w2 [H, D] and a cotangent of the output, normal
  (weights / sqrt(fan-in)), as float64 arrays of values exact in `dtype`."""
  rng = np.random.default_rng(seed)
  cast = lambda a: a.astype(DTYPES[dtype]).astype(np.float64)  # noqa: E731
  return {"x": cast(_normal(rng, batch + (tokens, d))),
          "w1": cast(_normal(rng, (d, h)) / np.float32(math.sqrt(d))),
          "w2": cast(_normal(rng, (h, d)) / np.float32(math.sqrt(h))),
          "ct": cast(_normal(rng, batch + (tokens, d)))}


def mlp_reference(x, w1, w2, ct) -> dict:
  """z = gelu(x @ w1) @ w2 and the gradients of sum(z * ct), float64, global arrays."""
  a = x @ w1
  h = gelu(a)
  z = h @ w2
  dh = ct @ w2.T
  da = dh * gelu_grad(a)
  lead = tuple(range(x.ndim - 1))
  return {"z": z, "dx": da @ w1.T, "dw1": np.tensordot(x, da, axes=(lead, lead)),
          "dw2": np.tensordot(h, ct, axes=(lead, lead))}


def relative_error(got, want) -> float:
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def mlp_check(got, want, dtype: str) -> Verdict:
  """An MLP output or gradient (this process's slice) against its float64 reference: every
  element finite and within MLP_ELEMENT_TOL of |want| + RMS(want), and the relative Frobenius
  error within MLP_TOL."""
  got = np.asarray(got).astype(np.float64)
  bound = MLP_TOL[dtype]
  if got.shape != want.shape:
    return Verdict(False, math.nan, bound, f"shape {got.shape}, expected {want.shape}")
  if not np.isfinite(got).all():
    return Verdict(False, math.nan, bound, f"{int((~np.isfinite(got)).sum())} non-finite elements")
  err = relative_error(got, want)
  element = MLP_ELEMENT_TOL[dtype] * (np.abs(want) + np.sqrt(np.mean(np.square(want))))
  over = ~(np.abs(got - want) <= element)
  if over.any():
    return Verdict(False, err, bound, f"{int(over.sum())} elements over their bound")
  if not err <= bound:
    return Verdict(False, err, bound, "relative Frobenius error over its bound")
  return Verdict(True, err, bound, "")


# --- running cases with JAX (imported here only: the rest of this module needs NumPy alone) --

def call_op(case: Case, a: dict, impl: str):
  """The public op of `case` on one rank's operands `a` (x, w and FP8's x_scale, w_scale),
  inside shard_map over the mesh axis 'tp'."""
  import jaxflux
  kwargs = {"transpose_w": case.transpose_w}
  if case.op == "all_gather_matmul":
    kwargs["return_gathered"] = case.return_gathered
  if case.fp8:
    kwargs.update(x_scale=a["x_scale"], w_scale=a["w_scale"])
  return getattr(jaxflux, case.op)(a["x"], a["w"], "tp", impl=impl, **kwargs)


def run_case(case: Case, shards: list, mesh, impl: str = "fused") -> dict:
  """Runs `case` on `mesh`, a ('tp',) mesh of case.tp devices (possibly over several
  processes), with its kernel choices forced. Every rank's operands are stacked on a new leading
  axis split over 'tp', so each device gets exactly its rank's shards, per-tensor scales
  included. Returns {rank: output} for
  the devices this process holds, as NumPy arrays ((y, x_full) with return_gathered)."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jaxflux import tuning

  names = sorted(shards[0])

  def body(*stacked):
    out = call_op(case, {name: v[0] for name, v in zip(names, stacked)}, impl)
    return jax.tree.map(lambda o: o[None], out)

  out_specs = (P("tp"), P("tp")) if case.return_gathered else P("tp")
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * len(names),
                            out_specs=out_specs))
  sharding = NamedSharding(mesh, P("tp"))
  args = []
  for name in names:
    host = np.stack([s[name] for s in shards])
    args.append(jax.make_array_from_callback(host.shape, sharding, lambda i, h=host: h[i]))
  with tuning.override(case.op, **dict(case.tuning)):  # traced in the block
    outs = f(*args)
  outs = outs if isinstance(outs, tuple) else (outs,)
  by_device = [{s.device: s for s in o.addressable_shards} for o in outs]
  result = {}
  for device, shard in by_device[0].items():
    rank = shard.index[0].start or 0
    data = tuple(np.asarray(d[device].data)[0] for d in by_device)
    result[rank] = data if len(data) > 1 else data[0]
  return result


def run_grads(case: Case, shards: list, mesh, impl: str = "fused") -> list:
  """[("dx", Verdict), ("dw", Verdict)]: jax.grad of sum(y * ct) (plus sum(x_full * ct_full)
  with return_gathered) through a tp=1 case of bf16 or fp16 (FP8 calls are forward-only) on a
  1-device ('tp',) mesh, against float64 gradients. At tp=1 every op is x @ w, so one
  reference serves all three."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  assert case.tp == 1 and not case.fp8
  (shard,) = shards
  x, w = shard["x"], shard["w"]
  dtype = DTYPES[case.dtype]
  rng = np.random.default_rng(case.data_seed + 1)
  # Cotangents exact in the dtype: the cast of the cotangent back to it is then exact too.
  ct = rng.standard_normal(case.out_shape, np.float32).astype(dtype)
  ct_full = rng.standard_normal(case.x_shape, np.float32).astype(dtype)

  def loss(x, w, ct, ct_full):
    out = call_op(case, {"x": x, "w": w}, impl)
    if case.return_gathered:
      y, x_full = out
      return (jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32))
              + jnp.sum(x_full.astype(jnp.float32) * ct_full.astype(jnp.float32)))
    return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))

  def body(*stacked):
    grads = jax.grad(loss, argnums=(0, 1))(*(a[0] for a in stacked))
    return tuple(g[None] for g in grads)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * 4,
                            out_specs=(P("tp"), P("tp"))))
  put = lambda a: jax.device_put(a[None], NamedSharding(mesh, P("tp")))  # noqa: E731
  dx, dw = (np.asarray(g)[0] for g in f(put(x), put(w), put(ct), put(ct_full)))

  w_kn = w.astype(np.float64)
  w_kn = w_kn.T if case.transpose_w else w_kn
  want_dx = matmul_expected(ct, w_kn.T, case.dtype)
  if case.return_gathered:  # dx = ct @ wᵀ + ct_full, each part in the dtype, then their sum
    full = ct_full.astype(np.float64)
    want_dx.terms = (want_dx.y, full)
    want_dx.y = want_dx.y + full
  rows_x = x.astype(np.float64).reshape(-1, case.k)
  rows_ct = ct.astype(np.float64).reshape(-1, case.n)
  # dw laid out like w: [K, N], or [N, K] with transpose_w.
  want_dw = (matmul_expected(rows_ct.T, rows_x, case.dtype) if case.transpose_w
             else matmul_expected(rows_x.T, rows_ct, case.dtype))
  return [("dx", check(want_dx, dx)), ("dw", check(want_dw, dw))]


def mlp(x, w1, w2, impl: str):
  """The tensor-parallel MLP on one rank's shards (inside shard_map over 'tp'): x [..., m, D]
  tokens, w1 [D, H/tp] columns, w2 [H/tp, D] rows; returns this rank's tokens [..., m, D]."""
  import jax
  import jax.numpy as jnp
  import jaxflux
  a = jaxflux.all_gather_matmul(x, w1, "tp", impl=impl)
  h = jax.nn.gelu(a.astype(jnp.float32)).astype(a.dtype)
  return jaxflux.matmul_reduce_scatter(h, w2, "tp", impl=impl)


def mlp_with_grads(x, w1, w2, ct, impl: str):
  """(z, dx, dw1, dw2): the MLP and, through jax.vjp in the same program, the gradients of
  sum(z * ct); no collective outside the ops' own."""
  import jax
  z, vjp = jax.vjp(lambda x, w1, w2: mlp(x, w1, w2, impl), x, w1, w2)
  return (z,) + tuple(vjp(ct))
