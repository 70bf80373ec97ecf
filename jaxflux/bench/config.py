"""Constants of the benchmark: ops, variants, flags, sanity limits, what the JSON fields mean,
and where the repository is."""
from __future__ import annotations

import pathlib

OPS = ("all_gather", "ag_gemm", "gemm_rs", "gemm")
AXIS = "tp"
DEFAULT_VARIANTS = ("gemm", "gemm_only", "comm", "xla", "xla_windowed", "pallas", "jaxflux", "auto")
EXTRA_VARIANTS = ("xla_gspmd", "jaxflux_wt")
# Variants that apply to each op, in the order they run (xla first: it is the reference output).
OP_VARIANTS = {
    "all_gather": ("xla", "jaxflux"),
    "ag_gemm": ("xla", "gemm", "gemm_only", "comm", "pallas", "jaxflux", "jaxflux_wt", "auto",
                "xla_windowed", "xla_gspmd"),
    "gemm_rs": ("xla", "gemm", "gemm_only", "comm", "jaxflux", "jaxflux_wt", "auto",
                "xla_windowed", "xla_gspmd"),
    # One device: each row is one GEMM a device runs in the fused op at tp=2 (see gemm_table.py).
    "gemm": ("xla", "gemm_only", "cutlass", "streamk", "xla_own_rows", "own_rows"),
}
GEMM_VARIANTS = OP_VARIANTS["gemm"]
# --op gemm's row families: the per-device GEMM of each fused op at tp=2.
GEMM_FAMILIES = ("ag_gemm", "gemm_rs", "gemm_ar")
# --op gemm's default token counts: where impl="auto" takes the fused kernels at tp=2; for
# GEMM+AllReduce (gemm_ar rows) decode sizes too, where the GEMM is a read of the weight.
GEMM_TABLE_M = (2048, 4096, 8192, 16384)
GEMM_AR_TABLE_M = (1, 8, 32, 128, 512, 2048, 8192)
# Variants whose output is the op's output (checked against `xla`).
OUTPUT_VARIANTS = ("xla", "pallas", "jaxflux", "jaxflux_wt", "auto", "xla_windowed", "xla_gspmd")
WINDOWED_FLAGS = ("--xla_gpu_threshold_for_windowed_einsum_mib=0",
                  "--xla_gpu_multi_streamed_windowed_einsum=true")
DISPLAY_ORDER = ("gemm", "gemm_only", "comm", "xla", "xla_windowed", "pallas", "jaxflux",
                 "jaxflux_wt", "auto", "xla_gspmd")
CHILD_MARKER = "jaxflux.bench child result: "
# Above any device memory's bandwidth today (H200: 4.8 TB/s): a sanity floor, see `_floor_ms`.
FLOOR_BANDWIDTH = 10e12
# A config that computes wrong values must not win the Pallas sweep.
PALLAS_MAX_REL_ERR = 5e-2

DEFINITIONS = {
    "ms": "median over repeats of (wall time of one timed run) / (op calls in it), milliseconds",
    "spread_ms": "[min, max] over repeats of the same per-call time",
    "tflops": "per-device TFLOP/s: 2*M*K*N/tp / time (the GEMM each device does)",
    "gbps": ("bytes each device receives per second, GB/s (1e9): (tp-1)*shard_bytes / time; "
             "shard_bytes is the [M/tp, K] shard for all-gather, the [M/tp, N] output chunk for "
             "reduce-scatter. Equals NCCL's bus bandwidth; algbw = gbps*tp/(tp-1)"),
    "speedup_vs_xla": "ms['xla'] / ms['jaxflux']",
    "speedup_vs_xla_all": ("ms['xla'] / ms[v]; for xla_windowed, the child process's own xla "
                           "time over its windowed time (same process, same clocks); for gemm "
                           "it is the ceiling a perfect overlap would reach"),
    "overlap_efficiency": ("FLUX's E = (T_gemm + T_comm - T_v) / T_comm for v = jaxflux; "
                           "overlap_efficiency_all for every fused or unfused variant. 1 = the "
                           "collective fully hidden, 0 = no overlap, < 0 = slower than serial"),
    "rel_err": ("||y_v - y_xla||_F / ||y_xla||_F on one call's output, computed in float32; "
                "--op gemm: against the variant's own product computed by XLA in float32"),
    "gemm_only_vs_xla": ("--op gemm: ms['gemm_only'] / ms['xla'] (> 1: the fused kernels' GEMM "
                         "work is slower than XLA's dot, i.e. cuBLAS, on the same operands)"),
    "streamk_vs_xla": "--op gemm, gemm_ar rows: ms['streamk'] / ms['xla']",
    "cutlass_vs_xla": ("--op gemm: ms['cutlass'] / ms['xla'] (CUTLASS's stock persistent GEMM "
                       "against cuBLAS: how much of gemm_only_vs_xla is CUTLASS itself)"),
    "weight_tbps": ("--op gemm, gemm_ar rows: bytes of the per-device weight [K/tp, N] / time, "
                    "TB/s (1e12): the rate the GEMM reads the weight, its bound at decode sizes"),
    "own_rows_vs_xla_own_rows": ("--op gemm, gemm_rs rows: ms['own_rows'] / ms['xla_own_rows'] "
                                 "(the own-rows kernel reading C against XLA's dot without C)"),
}


def repo_root() -> pathlib.Path:
  return pathlib.Path(__file__).resolve().parent.parent.parent
