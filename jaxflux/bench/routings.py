"""`--op grouped_gemm`'s routings: how M routed rows are spread over G experts (--routing; see
grouped_table.py's docstring)."""
from __future__ import annotations

import numpy as np

from jaxflux.bench.config import DIRICHLET_ALPHA, ROUTINGS


def even_sizes(M: int, G: int) -> list[int]:
  """[G] rows per expert: M // G each, one more for each of the first M % G experts."""
  return [M // G + (g < M % G) for g in range(G)]


def round_to_total(shares: np.ndarray, total: int) -> list[int]:
  """[G] non-negative whole numbers summing to `total`, proportional to `shares` (largest
  remainder: floors, then one more for the largest fractional parts, ties to the lower index)."""
  raw = np.asarray(shares, np.float64) / np.sum(shares) * total
  sizes = np.floor(raw).astype(np.int64)
  short = total - int(sizes.sum())
  assert 0 <= short <= len(sizes), (short, total)
  sizes[np.argsort(sizes - raw, kind="stable")[:short]] += 1
  return [int(s) for s in sizes]


def dirichlet_sizes(M: int, G: int, seed: int, alpha: float = DIRICHLET_ALPHA) -> list[int]:
  """[G] rows per expert from shares ~ Dirichlet(alpha, ..., alpha), drawn with numpy's
  default_rng(seed): the same for a seed and G, whatever M."""
  shares = np.random.default_rng(seed).dirichlet(np.full(G, alpha))
  return round_to_total(shares, M)


def group_sizes(routing: str, M: int, G: int, seed: int) -> list[int]:
  if routing == "even":
    return even_sizes(M, G)
  if routing == "dirichlet":
    return dirichlet_sizes(M, G, seed)
  raise ValueError(f"unknown routing {routing!r}; choose from {ROUTINGS}")
