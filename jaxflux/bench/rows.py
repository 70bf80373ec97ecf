"""Benchmark rows: the `Row` of one shape, the shapes file, and the rows a command line asks for."""
from __future__ import annotations

import dataclasses
import pathlib

import jax.numpy as jnp

from jaxflux.bench.config import (FP8_DEFAULT_FAMILIES, FP8_DTYPES, GEMM_AR_TABLE_M, GEMM_FAMILIES,
                                  GEMM_TABLE_M, repo_root)


@dataclasses.dataclass(frozen=True)
class Row:
  """One benchmark row. M, K, N are the global GEMM shape y[M, N] = x[M, K] @ w[K, N]
  (for all_gather: the gathered array is [M, K] and N is unused, 0). For op "gemm", `of` names
  the fused op ("ag_gemm", "gemm_rs" or "gemm_ar") whose per-device GEMM at `tp` the row runs on
  one device. An FP8 `dtype` (op "gemm" only) is x's format: the weight is e4m3, given as its
  transpose [N, K] (fp8_table.py)."""
  op: str
  name: str
  M: int
  K: int
  N: int
  tp: int
  dtype: str
  of: str = ""

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.dtype).itemsize

  @property
  def fp8(self) -> bool:
    return self.dtype in FP8_DTYPES

  @property
  def flops_per_device(self) -> int:
    return 0 if self.op == "all_gather" else 2 * self.M * self.K * self.N // self.tp

  @property
  def comm_bytes_per_device(self) -> int:
    """Bytes each device receives in the collective ((tp-1) chunks)."""
    if self.op == "gemm":
      return 0
    chunk = self.M // self.tp * (self.N if self.op == "gemm_rs" else self.K)
    return (self.tp - 1) * chunk * self.itemsize

  @property
  def per_device_shapes(self) -> dict:
    shapes = self._per_device_shapes()
    if self.fp8:  # the weight given transposed, [N, K]
      shapes = {("wt" if key == "w" else key): (value[::-1] if key == "w" else value)
                for key, value in shapes.items()}
    return shapes

  def _per_device_shapes(self) -> dict:
    m, k, n = self.M // self.tp, self.K // self.tp, self.N // self.tp
    if self.op == "gemm" and self.of == "ag_gemm":
      return {"x": [self.M, self.K], "w": [self.K, n], "out": [self.M, n]}
    if self.op == "gemm" and self.of == "gemm_ar":
      return {"x": [self.M, k], "w": [k, self.N], "out": [self.M, self.N]}
    if self.op == "gemm":
      return {"x": [self.M, k], "w": [k, self.N], "out": [self.M, self.N],
              "own_rows": {"x": [m, k], "c": [m, self.N], "out": [m, self.N]}}
    if self.op == "all_gather":
      return {"x": [m, self.K], "out": [self.M, self.K]}
    if self.op == "ag_gemm":
      return {"x": [m, self.K], "w": [self.K, n], "out": [self.M, n]}
    return {"x": [self.M, k], "w": [k, self.N], "out": [m, self.N]}

  def key(self) -> list:
    key = [self.op, self.name, self.M, self.K, self.N, self.tp, self.dtype]
    return key + [self.of] if self.of else key


def find_shapes_file(explicit: str | None) -> pathlib.Path:
  """--shapes-file, else the repository's benchmarks/shapes.json (a source checkout)."""
  if explicit:
    path = pathlib.Path(explicit)
    if not path.is_file():
      raise FileNotFoundError(f"--shapes-file {explicit}: no such file")
    return path
  path = repo_root() / "benchmarks" / "shapes.json"
  if path.is_file():
    return path.resolve()
  raise FileNotFoundError(f"{path} not found (jaxflux is not run from a source checkout); pass "
                          "--shapes-file PATH.")


def _all_gather_width(elements: int) -> int:
  k = 8192
  while k > 1 and (elements % k or elements < k):
    k //= 2
  return k


def build_rows(args, shapes: dict, tp: int) -> list[Row]:
  """The rows to run, from shapes.json filtered by --shapes/--M, or --sizes-mib for all_gather."""
  ms = args.M or list(shapes.get("M", []))
  if args.op == "all_gather" and args.sizes_mib:
    rows = []
    itemsize = jnp.dtype(args.dtype).itemsize
    for mib in args.sizes_mib:
      elements = int(round(mib * 2**20 / itemsize))
      k = _all_gather_width(elements)
      rows.append(Row("all_gather", f"{mib:g}MiB", elements // k * tp, k, 0, tp, args.dtype))
    return rows
  if args.op == "gemm":
    return _gemm_rows(args, shapes, tp)
  table = shapes.get("ag_gemm" if args.op == "all_gather" else args.op, [])
  if args.shapes:
    known = {s["name"] for s in table}
    missing = [n for n in args.shapes if n not in known]
    if missing:
      raise ValueError(f"--shapes: unknown name(s) {missing}; the shapes file has {sorted(known)}")
    table = [s for s in table if s["name"] in args.shapes]
  rows: list[Row] = []
  if args.op == "all_gather":
    # The AllGather+GEMM shapes' [M/tp, K] shards; shapes that share K share a row.
    names_by_k: dict[int, list[str]] = {}
    for s in table:
      names_by_k.setdefault(int(s["K"]), []).append(s["name"])
    for m in ms:
      for k, names in names_by_k.items():
        rows.append(Row("all_gather", "+".join(names), int(m), k, 0, tp, args.dtype))
  else:
    for s in table:
      for m in ms:
        rows.append(Row(args.op, s["name"], int(m), int(s["K"]), int(s["N"]), tp, args.dtype))
  for row in rows:
    sharded = {"M": row.M, "N": row.N} if row.op == "ag_gemm" else {"M": row.M}
    if row.op == "gemm_rs":
      sharded["K"] = row.K
    for dim, size in sharded.items():
      if size % tp:
        raise ValueError(f"row {row.name}: {dim}={size} is not divisible by tp={tp}; pick "
                         "another --M / --tp.")
  return rows


def _gemm_rows(args, shapes: dict, tp: int) -> list[Row]:
  """--op gemm: every ag_gemm, gemm_rs and gemm_ar shape (gemm_ar: the gemm_rs shapes) at each M,
  as one device runs it at `tp`; --of picks families."""
  fp8 = args.dtype in FP8_DTYPES
  families = getattr(args, "of", None) or (FP8_DEFAULT_FAMILIES if fp8 else GEMM_FAMILIES)
  tables = {of: shapes.get("gemm_rs" if of == "gemm_ar" else of, []) for of in families}
  if args.shapes:
    known = {s["name"] for t in tables.values() for s in t}
    missing = [n for n in args.shapes if n not in known]
    if missing:
      raise ValueError(f"--shapes: unknown name(s) {missing}; the shapes file has {sorted(known)}")
    tables = {of: [s for s in t if s["name"] in args.shapes] for of, t in tables.items()}
  def token_counts(of: str):
    return args.M or list(GEMM_AR_TABLE_M if of == "gemm_ar" else GEMM_TABLE_M)

  rows = [Row("gemm", s["name"], int(m), int(s["K"]), int(s["N"]), tp, args.dtype, of)
          for of, table in tables.items() for s in table for m in token_counts(of)]
  for row in rows:
    dim, size = ("N", row.N) if row.of == "ag_gemm" else ("K", row.K)
    # gemm_ar rows keep every row on each device: any M.
    checks = ((dim, size),) if row.of == "gemm_ar" else ((dim, size), ("M", row.M))
    for d, v in checks:
      if v % tp:
        raise ValueError(f"row {row.name}: {d}={v} is not divisible by tp={tp}; pick another "
                         "--M / --tp.")
  return rows
