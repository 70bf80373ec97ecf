"""One row measured: every variant built, checked against `xla`, warmed up and timed in
interleaved repeats."""
from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxflux.bench.config import OP_VARIANTS, OUTPUT_VARIANTS, PALLAS_MAX_REL_ERR
from jaxflux.bench.gemm_table import ROW_VARIANTS, summarize_gemm_row
from jaxflux.bench.inputs import input_set_count, make_inputs
from jaxflux.bench.rows import Row
from jaxflux.bench.summary import summarize_row
from jaxflux.bench.timing import chain_kind, _Timed
from jaxflux.bench.variants import Unavailable, Variant, make_variant, pallas_variants


@jax.jit
def _rel_err(y, ref):
  y, ref = y.astype(jnp.float32), ref.astype(jnp.float32)
  return jnp.linalg.norm((y - ref).ravel()) / jnp.linalg.norm(ref.ravel())


def _as_stacked(y: jax.Array, row: Row, variant: Variant) -> jax.Array:
  """A GSPMD ag_gemm output [M, N] in the shard_map variants' layout (device outputs stacked)."""
  if variant.gspmd_out_spec is not None and row.op == "ag_gemm":
    n = row.N // row.tp
    return y.reshape(row.M, row.tp, n).transpose(1, 0, 2).reshape(row.tp * row.M, n)
  return y


def _error_text(e: BaseException, limit: int = 600) -> str:
  text = f"{type(e).__name__}: {e}".strip()
  text = re.sub(r"\s+", " ", text)
  return text if len(text) <= limit else text[:limit] + "..."


def _reference_error(variant: Variant, timed: _Timed, y: jax.Array) -> float:
  """rel_err of y against variant.reference on the inputs of the call that produced y (the
  loop's last call takes set 0; dispatched calls cycle through the sets)."""
  last = 0 if timed.mode == "loop" else (timed.calls - 1) % len(timed.args)
  return float(_rel_err(y, jax.jit(variant.reference)(*timed.args[last])))


@dataclasses.dataclass
class _Prepared:
  timed: _Timed
  compile_s: float


def _prepare(variant: Variant, mesh, input_sets, args) -> tuple[_Prepared, jax.Array]:
  """Builds, compiles and warms up a variant; returns it and the last output of the warm-up."""
  t0 = time.perf_counter()
  timed = _Timed(variant, mesh, input_sets, args.iters, args.timing, chain_kind(args))
  y = timed.run()
  y.block_until_ready()
  compile_s = time.perf_counter() - t0
  for _ in range(max(0, math.ceil(args.warmup / timed.calls) - 1)):
    y = timed.run()
  y.block_until_ready()
  return _Prepared(timed, compile_s), y


def bench_row(row: Row, mesh: Mesh, variants: list[str], args, log=print) -> dict:
  """Times the requested variants of one row; returns the row's JSON record."""
  n_sets = input_set_count(row, args.rotate_mib)
  input_sets = make_inputs(row, mesh, n_sets, args.seed)
  applicable = [v for v in OP_VARIANTS[row.op] if v in variants and
                (row.op != "gemm" or v in ROW_VARIANTS[row.of])]
  errors: dict[str, str] = {}
  prepared: dict[str, _Prepared] = {}
  rel_err: dict[str, float] = {}
  extra: dict[str, Any] = {}
  reference = None

  def check(variant, y):
    if reference is None:
      return None
    return float(_rel_err(_as_stacked(y, row, variant), reference))

  for name in applicable:
    if name == "xla_windowed" and not args._windowed_child:
      continue  # timed in the child process (merged later)
    if name == "pallas":
      try:
        candidates = pallas_variants(row)
      except Unavailable as e:
        errors[name] = str(e)
        continue
      sweep, best = {}, None
      for variant in candidates:
        try:
          prep, y = _prepare(variant, mesh, input_sets, args)
          err = check(variant, y)
          del y
          if err is not None and not err <= PALLAS_MAX_REL_ERR:
            raise RuntimeError(f"wrong result: rel_err {err:.3g} vs xla")
          ms = min(prep.timed.time_ms() for _ in range(2))
          sweep[variant.note] = {"ms": ms, "rel_err": err}
          if best is None or ms < best[1]:
            best = (prep, ms, variant.note, err)
        except Exception as e:  # noqa: BLE001 - record every config's failure and go on
          sweep[variant.note] = {"error": _error_text(e)}
      extra["pallas_sweep"] = sweep
      if best is None:
        errors[name] = "every TuningConfig failed (see pallas_sweep)"
        continue
      prepared[name], _, extra["pallas_config"], rel_err[name] = best
      continue
    try:
      variant = make_variant(name, row)
      prep, y = _prepare(variant, mesh, input_sets, args)
    except Exception as e:  # noqa: BLE001 - a variant that fails is recorded, never substituted
      errors[name] = _error_text(e)
      continue
    if variant.reference is not None:  # --op gemm: against the product in float32
      rel_err[name] = _reference_error(variant, prep.timed, y)
    elif name == "xla":
      reference = y
    elif name in OUTPUT_VARIANTS:
      err = check(variant, y)
      if err is not None:
        rel_err[name] = err
    del y
    prepared[name] = prep
    if name == "xla_windowed":
      try:
        extra["windowed_loop_in_hlo"] = "windowed_dot_general" in prep.timed.hlo_text()
      except Exception as e:  # noqa: BLE001
        extra["windowed_loop_in_hlo"] = None
        errors["windowed_hlo"] = _error_text(e)
  del reference

  samples: dict[str, list[float]] = {n: [] for n in prepared}
  order = list(prepared)
  for r in range(args.repeats):
    shift = r % max(1, len(order))
    for name in order[shift:] + order[:shift]:
      if name not in prepared:
        continue
      try:
        samples[name].append(prepared[name].timed.time_ms())
      except Exception as e:  # noqa: BLE001
        errors[name] = "failed while timing: " + _error_text(e)
        del prepared[name]
        samples.pop(name)

  if args.timing == "device":
    extra["device_queue_filled"] = {n: p.timed.queue_filled for n, p in prepared.items()}
  calls = {n: p.timed.calls for n, p in prepared.items()}
  compile_s = {n: round(p.compile_s, 3) for n, p in prepared.items()}
  if row.op == "gemm":
    record = summarize_gemm_row(row, samples, errors, rel_err, calls, compile_s, n_sets)
  else:
    record = summarize_row(row, variants, samples, errors, rel_err, calls, compile_s, n_sets)
  record.update(extra)
  del prepared, input_sets
  return record
