"""The variants of an op: one `Variant` (a function and its inputs) per name, and the Pallas
collective matmul's configs."""
from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxflux.bench import gemm_table, tuning_sweep
from jaxflux.bench.config import AXIS, OP_VARIANTS
from jaxflux.bench.machine import is_gpu
from jaxflux.bench.rows import Row


@dataclasses.dataclass
class Variant:
  """A per-device function under shard_map (or, with `gspmd`, a global function under jit)."""
  name: str
  fn: Callable
  inputs: tuple[str, ...]
  check_vma: bool = True
  gspmd_out_spec: P | None = None  # set for global (GSPMD) programs
  note: str | None = None
  reference: Callable | None = None  # --op gemm: the same product by XLA in float32
  # --op gemm: the inputs `reference` takes (default: the variant's own), and a function of its
  # result giving this variant's expected output; variants that share both share one result.
  reference_inputs: tuple[str, ...] | None = None
  reference_view: Callable | None = None


class Unavailable(Exception):
  """A variant that cannot run here (reason recorded, not a failure of the harness)."""


def _jaxflux_op(op: str, impl: str) -> Callable:
  if op == "all_gather":
    try:
      module = importlib.import_module("jaxflux.ops.all_gather")
    except ImportError as e:
      raise Unavailable(f"jaxflux.ops.all_gather is not importable: {e}") from e
    return lambda x: module.all_gather(x, AXIS, impl=impl)
  import jaxflux
  if op == "ag_gemm":
    return lambda x, w: jaxflux.all_gather_matmul(x, w, AXIS, impl=impl)
  return lambda x, w: jaxflux.matmul_reduce_scatter(x, w, AXIS, impl=impl)


def make_variant(name: str, row: Row) -> Variant:
  """The variant `name` for `row`; raises Unavailable with a reason where it cannot run."""
  op = row.op
  if name not in OP_VARIANTS[op] and not (op == "gemm" and tuning_sweep.is_candidate(name)):
    raise Unavailable(f"not applicable to --op {op}")
  if op == "gemm":
    spec = gemm_table.variant_spec(name, row)
    if isinstance(spec, str):
      raise Unavailable(spec)
    if isinstance(spec, dict):  # an FP8 row's variant (fp8_table.py)
      return Variant(name, **spec)
    fn, inputs, reference = spec
    return Variant(name, fn, inputs, reference=reference)
  if op == "all_gather":
    if name == "xla":
      return Variant(name, lambda x: lax.all_gather(x, AXIS, axis=0, tiled=True), ("x",))
    return Variant(name, _jaxflux_op(op, "fused"), ("x",))
  if name == "gemm":
    return Variant(name, jnp.dot, ("x_full", "w") if op == "ag_gemm" else ("x", "w"))
  if name == "gemm_only":  # the fused kernels' own GEMM work with communication off
    if op == "ag_gemm":
      return Variant(name, gemm_table.ag_gemm_only, ("x_full", "w"))
    if row.tp != 2:
      raise Unavailable(f"the GEMM+RS GEMM-only composition is defined at tp=2, not tp={row.tp}")
    return Variant(name, gemm_table.rs_gemm_only, ("x_peer", "x_own", "w"))
  if name == "comm":
    if op == "ag_gemm":
      return Variant(name, lambda x: lax.all_gather(x, AXIS, axis=0, tiled=True), ("x",))
    return Variant(name, lambda p: lax.psum_scatter(p, AXIS, scatter_dimension=0, tiled=True),
                   ("partial",))
  if name in ("xla", "jaxflux", "auto"):
    impl = {"xla": "xla", "jaxflux": "fused", "auto": "auto"}[name]
    return Variant(name, _jaxflux_op(op, impl), ("x", "w"))
  if name == "jaxflux_wt":  # the fused kernel reading the weight K-major, as backward passes do
    module = importlib.import_module("jaxflux.ops.all_gather_matmul" if op == "ag_gemm"
                                     else "jaxflux.ops.matmul_reduce_scatter")
    if op == "ag_gemm":
      fn = lambda x, wt: module.apply(x, wt, AXIS, False, "fused", None, None,  # noqa: E731
                                      transpose_w=True)
    else:
      fn = lambda x, wt: module.apply(x, wt, AXIS, "fused", None, None,  # noqa: E731
                                      transpose_w=True)
    return Variant(name, fn, ("x", "wt"))
  if name in ("xla_windowed", "xla_gspmd"):
    out_spec = P(None, AXIS) if op == "ag_gemm" else P(AXIS, None)
    return Variant(name, jnp.dot, ("x", "w"), gspmd_out_spec=out_spec)
  raise Unavailable(f"unknown variant {name!r}")  # pallas is built per config


# A few configs around what the module's own sweep explores: CTA tiles 128x256, 256x128,
# 128x128 with different rasterization. Failures (shared memory, divisibility) are recorded.
PALLAS_CONFIGS = (
    dict(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, wg_dimension="N",
         grid_minor_dim="M", grid_tile_width=8),
    dict(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, wg_dimension="M",
         grid_minor_dim="N", grid_tile_width=8),
    dict(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=3, wg_dimension="N",
         grid_minor_dim="N", grid_tile_width=16),
    dict(tile_m=128, tile_n=64, tile_k=64, max_concurrent_steps=4, wg_dimension="N",
         grid_minor_dim="M", grid_tile_width=8),
    dict(tile_m=64, tile_n=128, tile_k=64, max_concurrent_steps=4, wg_dimension="M",
         grid_minor_dim="M", grid_tile_width=4),
)


def pallas_config_name(cfg: dict) -> str:
  return (f"tm{cfg['tile_m']}_tn{cfg['tile_n']}_tk{cfg['tile_k']}_s{cfg['max_concurrent_steps']}"
          f"_wg{cfg['wg_dimension']}_minor{cfg['grid_minor_dim']}_w{cfg['grid_tile_width']}")


def _pallas_module():
  try:
    return importlib.import_module("jax.experimental.pallas.ops.gpu.collective_matmul_mgpu")
  except Exception as e:  # noqa: BLE001 - any import failure means "not here"
    raise Unavailable(f"cannot import collective_matmul_mgpu: {type(e).__name__}: {e}") from e


def pallas_variants(row: Row) -> list[Variant]:
  """One Variant per TuningConfig; raises Unavailable where the kernel cannot run at all."""
  if row.op != "ag_gemm":
    raise Unavailable(f"not applicable to --op {row.op}")
  if not is_gpu():
    raise Unavailable(f"needs a GPU (platform is {jax.default_backend()})")
  if jnp.dtype(row.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise Unavailable(f"the Pallas kernel takes bfloat16/float16 only, not {row.dtype}")
  if row.tp != jax.device_count():
    raise Unavailable(f"the Pallas kernel needs the axis to span all {jax.device_count()} "
                      f"devices; --tp is {row.tp}")
  cm = _pallas_module()
  dims = cm.MatmulDimension
  dtype = jnp.dtype(row.dtype)
  out = []
  for cfg in PALLAS_CONFIGS:
    config = cm.TuningConfig(**{k: (dims[v] if k in ("wg_dimension", "grid_minor_dim") else v)
                                for k, v in cfg.items()})
    fn = functools.partial(cm.all_gather_lhs_matmul, axis_name=AXIS, config=config, dtype=dtype)
    out.append(Variant("pallas", fn, ("x", "w"), check_vma=False, note=pallas_config_name(cfg)))
  return out
