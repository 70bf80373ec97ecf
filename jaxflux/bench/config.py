"""Constants of the benchmark: ops, variants, flags, sanity limits, what the JSON fields mean,
and where the repository is."""
from __future__ import annotations

import pathlib

OPS = ("all_gather", "ag_gemm", "gemm_rs", "gemm", "grouped_gemm", "moe")
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
    # One device: each row is one GEMM a device runs in the fused op at tp=2 (see gemm_table.py;
    # the FP8 variants, fp8_table.py, run on the FP8 rows of --dtype float8_*).
    "gemm": ("xla", "gemm_only", "cutlass", "streamk", "swap_ab", "xla_own_rows",
             "xla_own_rows_c", "own_rows", "xla_fp8_fast", "xla_fp8_promoted", "fp8_gemm_only",
             "cutlass_fp8_fast", "cutlass_fp8_promoted", "quantize"),
    # One device: the MoE grouped GEMM (grouped_table.py); the *_bwd variants with --backward;
    # fused_<tile>: the kernel with each tile config (jaxflux.tuning.GROUPED_TILES) forced;
    # tokamax: tokamax.ragged_dot, autotuned (where tokamax is installed); fused_fp8: the kernel
    # on e4m3 operands (GROUPED_FP8_DTYPE).
    "grouped_gemm": ("fused", "ragged_dot", "dense", "tokamax", "fused_fp8", "fused_bwd",
                     "ragged_dot_bwd", "dense_bwd", "tokamax_bwd", "fused_cooperative_128x256",
                     "fused_pingpong_128x128"),
    # One device: the MoE layer's train step (moe_table.py), impl="fused" and impl="xla", and
    # the fused step's grouped GEMMs alone (what the step spends outside them is the rest).
    "moe": ("fused", "ragged_dot", "fused_gemms"),
}
GEMM_VARIANTS = OP_VARIANTS["gemm"][:8]
FP8_GEMM_VARIANTS = OP_VARIANTS["gemm"][8:]
# --dtype values that make --op gemm the FP8 table: x's format (the weight is always e4m3).
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# --op gemm's row families: the per-device GEMM of each fused op at tp=2.
GEMM_FAMILIES = ("ag_gemm", "gemm_rs", "gemm_ar")
# The FP8 table's default families (prefill); its gemm_ar rows (decode) on request (--of).
FP8_DEFAULT_FAMILIES = ("ag_gemm", "gemm_rs")
GROUPED_VARIANTS = OP_VARIANTS["grouped_gemm"]
GROUPED_BACKWARD = tuple(v for v in GROUPED_VARIANTS if v.endswith("_bwd"))
GROUPED_TILE_VARIANTS = tuple(v for v in GROUPED_VARIANTS if v.startswith("fused_")
                              and v not in GROUPED_BACKWARD and v != "fused_fp8")
GROUPED_FORWARD = tuple(v for v in GROUPED_VARIANTS if v not in GROUPED_BACKWARD)
# The variants whose fraction of the roofline a row records (dense reads one weight, not G).
ROOFLINE_VARIANTS = ("fused", "ragged_dot", "tokamax") + GROUPED_TILE_VARIANTS
# --op grouped_gemm: how routed rows are spread over the experts (--routing), the Dirichlet's
# concentration (0.5: a skewed router, some experts near empty), and the default routed rows.
ROUTINGS = ("even", "dirichlet")
DIRICHLET_ALPHA = 0.5
GROUPED_TABLE_M = (16384,)
GROUPED_FP8_DTYPE = "float8_e4m3fn"  # fused_fp8's x and w
# --op grouped_gemm's roofline (grouped_table.measure_rates): the best dense GEMM rate from one
# large dense GEMM, and the best weight-read rate from a few rows against a weight far larger
# than L2, both through XLA's dot (cuBLAS) in the run's dtype, per platform: (M, K, N).
ROOFLINE_RATE_SHAPES = {"gpu": {"compute": (8192, 8192, 8192), "weight_read": (16, 8192, 28672)},
                        "cpu": {"compute": (512, 512, 512), "weight_read": (16, 512, 2048)}}
# --op moe: the variants, the default tokens, the params' dtype, the weight of the
# load-balancing loss in the step's loss, and the largest relative difference of the fused
# step's loss (its output term) and gradients from ragged_dot's before a warning.
MOE_VARIANTS = OP_VARIANTS["moe"]
MOE_TABLE_M = (4096,)
MOE_PARAM_DTYPE = "float32"
MOE_AUX_WEIGHT = 0.01
MOE_MAX_REL_DIFF = 5e-2
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
    "swap_ab_vs_xla": ("--op gemm, gemm_ar rows: ms['swap_ab'] / ms['xla'] (the swap-AB decode "
                       "GEMM against cuBLAS)"),
    "cutlass_vs_xla": ("--op gemm: ms['cutlass'] / ms['xla'] (CUTLASS's stock persistent GEMM "
                       "against cuBLAS: how much of gemm_only_vs_xla is CUTLASS itself)"),
    "weight_tbps": ("--op gemm, gemm_ar rows: bytes of the per-device weight [K/tp, N] / time, "
                    "TB/s (1e12): the rate the GEMM reads the weight, its bound at decode sizes"),
    "own_rows_vs_xla_own_rows": ("--op gemm, gemm_rs rows: ms['own_rows'] / ms['xla_own_rows'] "
                                 "(the own-rows kernel reading C against XLA's dot without C)"),
    "own_rows_vs_xla_own_rows_c": ("--op gemm, gemm_rs rows: ms['own_rows'] / "
                                   "ms['xla_own_rows_c'] (the own-rows kernel against XLA's dot "
                                   "with the same add of C, which XLA fuses into the GEMM)"),
    "candidate_ratios": ("--op gemm --candidates: per candidate variant "
                         "(<family>:<field>=<value>/...), its time over its family's XLA "
                         "reference (ag_gemm: xla; gemm_rs: xla_own_rows_c); > 1: slower"),
    "fp8_gemm_only_vs_xla_fp8": ("--op gemm, FP8 rows: ms['fp8_gemm_only'] / ms['xla_fp8_<acc>'] "
                                 "with <acc> the row's `accumulate`, the accumulation the fused "
                                 "kernels are built with for x's dtype (> 1: the fused op's FP8 "
                                 "GEMM is slower than XLA's FP8 cuBLASLt GEMM on the same "
                                 "operands, accumulating alike)"),
    "cutlass_fp8_fast_vs_xla_fp8_fast": ("--op gemm, FP8 rows: CUTLASS's FP8 GEMM against "
                                         "cuBLASLt's, both with fast accumulation; likewise "
                                         "cutlass_fp8_promoted_vs_xla_fp8_promoted"),
    "quantize_vs_fp8_gemm_only": ("--op gemm, FP8 rows: ms['quantize'] / ms['fp8_gemm_only'] (the "
                                  "quantizing pass's time beside the GEMM's; in no other ratio)"),
    "quantize_tbps": ("--op gemm, FP8 rows: the quantizing pass's bytes (bf16 x and w read once, "
                      "FP8 x and wᵀ written once) / time, TB/s (1e12)"),
    "rel_err_<variant>": ("--op gemm summary, FP8 rows: mean and worst (largest) rel_err of the "
                          "variant over the rows; each against the float32 product of the same "
                          "FP8 values and scales (precision HIGHEST), so quantization error is "
                          "not in it: accumulation and the bf16 output's rounding are"),
    "xla_fp8_fast_custom_calls": ("--op gemm, FP8 rows: the custom-call targets of the "
                                  "compiled xla_fp8_fast program (an FP8 cuBLASLt GEMM is "
                                  "__cublas$lt$matmul$f8), and `xla_fp8_fast_triton_gemm`: "
                                  "whether XLA emitted a Triton GEMM fusion instead; likewise "
                                  "for xla_fp8_promoted"),
    "group_sizes": ("--op grouped_gemm: rows per expert (the routing's, summing to M), with their "
                    "min, max and the count of empty experts"),
    "tflops_grouped_gemm": ("--op grouped_gemm: 2*M*K*N / time for forward variants, 4*M*K*N "
                            "(dx and dw) for *_bwd ones; the same for every routing"),
    "fused_vs_dense": ("--op grouped_gemm: ms['dense'] / ms['fused'], the fused grouped GEMM's "
                       "TFLOP/s as a fraction of one dense XLA dot of the same FLOPs (cuBLAS); "
                       "likewise ragged_dot_vs_dense, and *_bwd_vs_dense_bwd for the backward"),
    "ragged_over_fused": ("--op grouped_gemm: ms['ragged_dot'] / ms['fused'], the speedup of the "
                          "fused grouped GEMM over XLA's ragged dot; ragged_over_fused_bwd alike; "
                          "--op moe: the same for the MoE layer's train step"),
    "fp8_over_bf16": ("--op grouped_gemm: ms['fused'] / ms['fused_fp8'], the FP8 grouped GEMM's "
                      "speedup over the 16-bit one on the same shapes (forward)"),
    "tokamax_over_fused": ("--op grouped_gemm: ms['tokamax'] / ms['fused'], the fused grouped "
                           "GEMM's speedup over tokamax.ragged_dot autotuned; "
                           "tokamax_over_fused_bwd alike"),
    "roofline": ("--op grouped_gemm: the least time the row's grouped GEMM can take, ms = "
                 "max(2*M*K*N / rates.dense_tflops, bytes / rates.weight_read_tbps), bytes = "
                 "every expert's weight, x and y once; `fraction`: ms over each grouped "
                 "variant's time; `fraction_fwd_bwd`: 3 * ms over its forward + backward time"),
    "rates": ("--op grouped_gemm: the roofline's rates on this device, measured before the rows "
              "through XLA's dot in the run's dtype: dense_tflops from one large GEMM, "
              "weight_read_tbps from a few rows against a weight far past L2 (shapes: M, K, N)"),
    "outside_gemms_share": ("--op moe: 1 - ms['fused_gemms'] / ms['fused'], the share of the "
                            "fused step spent outside its grouped GEMMs (router, sorts, "
                            "permutes, casts, activation, combine); gemm_share the rest"),
    "tflops_moe": ("--op moe: 3 * (2*M*hidden*E + 2*M*k*hidden*I * projections) / time, the "
                   "step's matmul FLOPs (router and expert MLP, forward and backward)"),
    "expert_rows": ("--op moe: (token, expert) pairs the router sends to each expert on the "
                    "first input set (the same for both variants), with their min and max"),
    "loss_moe": ("--op moe: the step's loss per variant, mean(y * ct) + aux_weight * "
                 "load_balancing_loss (settings.moe), on the last warm-up call; loss_terms "
                 "holds the total and both terms"),
    "loss_rel_diff": ("--op moe: |loss_fused - loss_ragged_dot| / |loss_ragged_dot| on the same "
                      "inputs; output_loss_rel_diff the same for the mean(y * ct) term alone"),
    "grad_rel_diff": ("--op moe: per gradient (each param's, and x's), ||g_fused - g_ragged_dot||_F"
                      " / ||g_ragged_dot||_F in float32 on the same inputs; grad_rel_diff_max the "
                      "largest"),
    "accumulate": ("--op gemm, FP8 rows: how the fused kernels accumulate for x's dtype "
                   "(jaxflux.ops.gemm.FP8_ACCUMULATE): 'fast' (the tensor cores' accumulator) or "
                   "'promoted' (into float32 registers every few k-blocks)"),
}


def repo_root() -> pathlib.Path:
  return pathlib.Path(__file__).resolve().parent.parent.parent
