"""Benchmark harness: `python -m jaxflux.bench --op OP`, OP one of all_gather, ag_gemm, gemm_rs,
gemm, grouped_gemm, moe.

Times every variant of one op side by side in one process, on fresh random data, over a 1-D
mesh ('tp',) of the local devices, and writes a JSON record (command, machine, versions, one row
per shape) under benchmarks/results/. benchmarks/README.md says how to run it, how to read the
JSON, and which committed result backs which claim.

Variants (per row; each runs under `jit`, inside `jax.shard_map` except the two GSPMD ones, on
inputs already placed with the sharding the program expects, so no resharding is timed):
  gemm          XLA dot alone on the per-device shape, no collective
                  (ag_gemm: [M, K] @ [K, N/tp]; gemm_rs: [M, K/tp] @ [K/tp, N])
  gemm_only     the fused kernels' GEMM work with communication off, same per-device shape
  comm          the collective alone (lax.all_gather of the [M/tp, K] shard; lax.psum_scatter of
                  the [M, N] partial)
  xla           jaxflux op, impl="xla" (all_gather + dot / dot + psum_scatter)
  xla_windowed  the same matmul written globally (GSPMD) and compiled with XLA's windowed-einsum
                  flags, in a child process (the flags are per process); GPU only
  pallas        jax.experimental.pallas.ops.gpu.collective_matmul_mgpu.all_gather_lhs_matmul,
                  best of a few TuningConfigs (ag_gemm, GPU, bf16/fp16 only)
  jaxflux       jaxflux op, impl="fused"; null with the error where no fused kernel exists
  auto          jaxflux op, impl="auto"
  xla_gspmd     (not run by default) the GSPMD program of xla_windowed without the flags
For --op all_gather: `xla` is lax.all_gather and `jaxflux` the internal copy-engine all-gather
(jaxflux.ops.all_gather.all_gather(x, axis_name, impl="fused")). --op gemm is the single-device
GEMM table (jaxflux/bench/gemm_table.py); with --dtype float8_e4m3fn or float8_e5m2 the FP8 one
(jaxflux/bench/fp8_table.py); with --candidates also the tuning sweep over jaxflux.tuning's
candidates (jaxflux/bench/tuning_sweep.py). --op grouped_gemm is the MoE grouped GEMM on one
device against lax.ragged_dot and a dense GEMM of the same FLOPs (jaxflux/bench/grouped_table.py).
--op moe is the train step (forward + backward) of the MoE layer jaxflux.MoE on one device,
impl="fused" against impl="xla" (lax.ragged_dot), with their losses and gradients compared
(jaxflux/bench/moe_table.py).

Timing (timing.py): on GPU the GPUs' own clocks around queued calls (`--timing device`) or the
host's (`dispatch`); elsewhere one jitted program runs the op `--iters` times in a
`lax.fori_loop` with each call depending on the previous one (`loop`). Small shapes rotate among
several input sets so they don't run from L2. Repeats are interleaved round-robin across
variants (the order rotates each repeat); a row reports the median and the min/max over repeats
of the time per call.
"""
# The public names of the harness, importable from jaxflux.bench as when it was one module; each
# lives in the submodule that does its one job (rows, inputs, variants, timing, measure, summary,
# windowed, machine, table, output, cli; constants in config).
from jaxflux.bench.cli import main, parse_args, run
from jaxflux.bench.config import (AXIS, CHILD_MARKER, DEFAULT_VARIANTS, DEFINITIONS, DISPLAY_ORDER,
                                  EXTRA_VARIANTS, FLOOR_BANDWIDTH, OP_VARIANTS, OPS,
                                  OUTPUT_VARIANTS, PALLAS_MAX_REL_ERR, WINDOWED_FLAGS, repo_root)
from jaxflux.bench.inputs import input_set_count, make_inputs, make_mesh
from jaxflux.bench.machine import machine_info, versions
from jaxflux.bench.measure import bench_row
from jaxflux.bench.rows import Row, build_rows, find_shapes_file
from jaxflux.bench.summary import summarize_row
from jaxflux.bench.table import format_table
from jaxflux.bench.variants import (PALLAS_CONFIGS, Unavailable, Variant, make_variant,
                                    pallas_config_name, pallas_variants)
from jaxflux.bench.windowed import run_windowed_child

__all__ = [
    "AXIS",
    "CHILD_MARKER",
    "DEFAULT_VARIANTS",
    "DEFINITIONS",
    "DISPLAY_ORDER",
    "EXTRA_VARIANTS",
    "FLOOR_BANDWIDTH",
    "OPS",
    "OP_VARIANTS",
    "OUTPUT_VARIANTS",
    "PALLAS_CONFIGS",
    "PALLAS_MAX_REL_ERR",
    "Row",
    "Unavailable",
    "Variant",
    "WINDOWED_FLAGS",
    "bench_row",
    "build_rows",
    "find_shapes_file",
    "format_table",
    "input_set_count",
    "machine_info",
    "main",
    "make_inputs",
    "make_mesh",
    "make_variant",
    "pallas_config_name",
    "pallas_variants",
    "parse_args",
    "repo_root",
    "run",
    "run_windowed_child",
    "summarize_row",
    "versions",
]
