"""Tuning choices -> the int64 attributes of the kernels' FFI targets (the C++ contract:
xla_ffi/ffi/ag_gemm.cc, gemm_rs.cc, gemm.cc, gemm_ar.cc, grouped_gemm.cc, moe_gemm.cc). Enum
attributes are encoded by the names the native module exports (xla_ffi/ffi/attribute_names.h).
A fused call's plan holds them (ops/_config.py); the targets' callers pass them on as they are."""
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


# The kernels of the GEMM-only target (jaxflux_gemm's `kernel` attribute; ops/gemm.py).
GEMM_KERNELS = {"cutlass": 0, "all_gather_matmul": 1, "own_rows": 2, "matmul_all_reduce": 0}
# The one an op runs at tp=1: GEMM+AllReduce's GEMM is a plain GEMM tuned by rows.
TP1_KERNEL = "matmul_all_reduce"


def gemm(kernel: str, choice) -> dict:
  """The jaxflux_gemm attributes of `kernel` run with `choice` (its op's tuning choice)."""
  attrs = {"kernel": GEMM_KERNELS[kernel], "tile": 0, "own_rows_schedule": 0, "push_chunks": 0}
  if kernel == "all_gather_matmul":
    attrs.update(tile=encode("ag_tile", choice.tile), swizzle=choice.swizzle)
  elif kernel == "matmul_all_reduce":
    attrs.update(tile=encode("gemm_tile", choice.tile), swizzle=choice.swizzle)
  elif kernel == "cutlass":
    attrs.update(swizzle=choice.peer_rows_swizzle)
  else:
    attrs.update(own_rows_schedule=encode("own_rows_schedule", choice.own_rows_schedule),
                 push_chunks=int(choice.push == "chunked"), swizzle=choice.own_rows_swizzle)
  attrs["grid_sms"] = choice.grid_sms
  return attrs


def of_call(target: str, choice, *, shard_rows: int, transpose_w: bool) -> dict:
  """The kernel attributes of a fused call of `target` ("all_gather_matmul",
  "matmul_reduce_scatter", "matmul_all_reduce", or "gemm": an op at tp=1, GEMM+AllReduce's
  GEMM alone) run with `choice`, its weight given [N, K] with transpose_w."""
  if target == "gemm":
    attrs = gemm(TP1_KERNEL, choice)
  elif target == "all_gather_matmul":
    attrs = all_gather_matmul(choice, shard_rows)
  elif target == "matmul_reduce_scatter":
    attrs = matmul_reduce_scatter(choice)
  else:
    attrs = matmul_all_reduce(choice)
  return {**attrs, "transpose_w": int(transpose_w)}
