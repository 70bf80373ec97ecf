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
from jaxflux.bench import tuning_sweep
from jaxflux.bench.gemm_table import row_variants, summarize_gemm_row
from jaxflux.bench.inputs import input_set_count, make_inputs
from jaxflux.bench.machine import is_gpu
from jaxflux.bench.rows import Row
from jaxflux.bench.summary import summarize_row
from jaxflux.bench.timing import chain_kind, Timed
from jaxflux.bench.variants import Unavailable, Variant, make_variant, pallas_variants


@jax.jit
def relative_error(y, ref):
  y, ref = y.astype(jnp.float32), ref.astype(jnp.float32)
  return jnp.linalg.norm((y - ref).ravel()) / jnp.linalg.norm(ref.ravel())


def _as_stacked(y: jax.Array, row: Row, variant: Variant) -> jax.Array:
  """A GSPMD ag_gemm output [M, N] in the shard_map variants' layout (device outputs stacked)."""
  if variant.gspmd_out_spec is not None and row.op == "ag_gemm":
    n = row.N // row.tp
    return y.reshape(row.M, row.tp, n).transpose(1, 0, 2).reshape(row.tp * row.M, n)
  return y


def error_text(e: BaseException, limit: int = 600) -> str:
  text = f"{type(e).__name__}: {e}".strip()
  text = re.sub(r"\s+", " ", text)
  return text if len(text) <= limit else text[:limit] + "..."


def _reference_error(variant: Variant, timed: Timed, y: jax.Array, input_sets: list[dict],
                     cache: dict) -> float:
  """rel_err of y against variant.reference on the inputs of the call that produced y (the
  loop's last call takes set 0; dispatched calls cycle through the sets). A reference result is
  computed once per row and shared by the variants with the same reference and inputs."""
  last = 0 if timed.mode == "loop" else (timed.calls - 1) % len(timed.args)
  names = variant.reference_inputs or variant.inputs
  key = (variant.reference, names, last)
  if key not in cache:
    cache[key] = jax.jit(variant.reference)(*(input_sets[last][n] for n in names))
  want = cache[key]
  if variant.reference_view is not None:
    want = variant.reference_view(want)
  return float(relative_error(y, want))


def _gemm_calls(timed: Timed) -> tuple[list[str], bool]:
  """The custom-call targets of a variant's compiled program, and whether it has a GEMM fusion
  XLA emits with Triton (which XLA may pick over cuBLAS)."""
  hlo = timed.hlo_text()
  return sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo))), "__triton_gemm" in hlo


@dataclasses.dataclass
class _Prepared:
  timed: Timed
  compile_s: float


def prepare(variant: Variant, mesh, input_sets, args) -> tuple[_Prepared, jax.Array]:
  """Builds, compiles and warms up a variant; returns it and the last output of the warm-up."""
  t0 = time.perf_counter()
  timed = Timed(variant, mesh, input_sets, args.iters, args.timing, chain_kind(args))
  y = jax.block_until_ready(timed.run())
  compile_s = time.perf_counter() - t0
  for _ in range(max(0, math.ceil(args.warmup / timed.calls) - 1)):
    y = timed.run()
  jax.block_until_ready(y)
  return _Prepared(timed, compile_s), y


def bench_row(row: Row, mesh: Mesh, variants: list[str], args, log=print) -> dict:
  """Times the requested variants of one row; returns the row's JSON record."""
  n_sets = input_set_count(row, args.rotate_mib)
  input_sets = make_inputs(row, mesh, n_sets, args.seed)
  applicable = [v for v in OP_VARIANTS[row.op] if v in variants and
                (row.op != "gemm" or v in row_variants(row))]
  if row.op == "gemm":  # --candidates: the tuning sweep's variants, after the others
    applicable += [v for v in variants if tuning_sweep.applies(v, row)]
  errors: dict[str, str] = {}
  warnings: list[str] = []
  references: dict = {}  # --op gemm: float32 reference results of this row
  prepared: dict[str, _Prepared] = {}
  rel_err: dict[str, float] = {}
  extra: dict[str, Any] = {}
  reference = None

  def check(variant, y):
    if reference is None:
      return None
    return float(relative_error(_as_stacked(y, row, variant), reference))

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
          prep, y = prepare(variant, mesh, input_sets, args)
          err = check(variant, y)
          del y
          if err is not None and not err <= PALLAS_MAX_REL_ERR:
            raise RuntimeError(f"wrong result: rel_err {err:.3g} vs xla")
          ms = min(prep.timed.time_ms() for _ in range(2))
          sweep[variant.note] = {"ms": ms, "rel_err": err}
          if best is None or ms < best[1]:
            best = (prep, ms, variant.note, err)
        except Exception as e:  # noqa: BLE001 - record every config's failure and go on
          sweep[variant.note] = {"error": error_text(e)}
      extra["pallas_sweep"] = sweep
      if best is None:
        errors[name] = "every TuningConfig failed (see pallas_sweep)"
        continue
      prepared[name], _, extra["pallas_config"], rel_err[name] = best
      continue
    try:
      variant = make_variant(name, row)
      prep, y = prepare(variant, mesh, input_sets, args)
    except Exception as e:  # noqa: BLE001 - a variant that fails is recorded, never substituted
      errors[name] = error_text(e)
      continue
    if variant.reference is not None:  # --op gemm: against the product in float32
      rel_err[name] = _reference_error(variant, prep.timed, y, input_sets, references)
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
        errors["windowed_hlo"] = error_text(e)
    if name in ("xla_fp8_fast", "xla_fp8_promoted"):
      _check_fp8_gemm(name, prep.timed, extra, errors, warnings)
  del reference, references

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
        errors[name] = "failed while timing: " + error_text(e)
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
  record["warnings"] = record["warnings"] + warnings
  del prepared, input_sets
  return record


def _check_fp8_gemm(name: str, timed: Timed, extra: dict, errors: dict, warnings: list) -> None:
  """Records how XLA ran its FP8 variant (custom calls, a Triton GEMM fusion); on GPU, warns
  when it is neither cuBLASLt's FP8 matmul nor a Triton GEMM: XLA then did not see the
  dequantize -> dot as one FP8 GEMM, and the variant times something else."""
  try:
    targets, triton = _gemm_calls(timed)
  except Exception as e:  # noqa: BLE001
    errors[f"{name}_hlo"] = error_text(e)
    return
  extra[f"{name}_custom_calls"] = targets
  extra[f"{name}_triton_gemm"] = triton
  if is_gpu() and not triton and not any("f8" in t.lower() for t in targets):
    warnings.append(f"{name}: neither an FP8 cuBLASLt matmul nor a Triton GEMM among the "
                    f"compiled program's calls {targets}; XLA did not rewrite the dequantize -> "
                    "dot into one FP8 GEMM")
