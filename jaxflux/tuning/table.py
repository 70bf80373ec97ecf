"""The sm90 defaults of the fused ops' kernel choices, as data: ENTRIES (which tile, schedule,
swizzle and reduction each shape class runs) and AUTO_RULES (where impl="auto" takes the fused
kernel).

These are the choices for every sm90 GPU: where a GEMM choice was measured on more than one kind
of GPU, the one best on all of them (the H100 SXM and H200 tuning sweeps). A device table
(tables.py, tables/) replaces the GEMM fields with what was fastest on its own kind. Each record
names the result files under benchmarks/results/ that back it (`evidence`) and says why in a
sentence or two (`why`). jaxflux.tuning classifies shapes and looks records up here.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Entry:
  op: str            # "all_gather_matmul" | "matmul_reduce_scatter" | "matmul_all_reduce"
  arch: str          # "sm90"
  dtype: str         # "bfloat16" | "float16" | "*"
  tp: int | str      # a group size or "*"
  shape_class: str   # what jaxflux.tuning's classifier of `op` returns
  choice: dict       # the choice's fields (grid_sms is never in the table)
  evidence: tuple    # files under benchmarks/results/ that back the choice
  why: str


@dataclasses.dataclass(frozen=True)
class AutoRule:
  op: str                         # any op family: dense, grouped or MoE
  arch: str
  tp: int | str                   # a group size or "*"
  min_rows: int                   # rows the GEMM computes (all_gather_matmul: gathered rows)
  max_rows_times_k: int | None    # rows * K of the per-device GEMM, None: no cap
  evidence: tuple
  why: str
  operands: str = "16-bit"        # "16-bit" or "fp8": the calls the rule speaks for
  max_rows: int | None = None     # None: no cap
  device: str = "*"               # a shipped device table's name (tuning/device.py), or "*"


_AG = "all_gather_matmul"
_RS = "matmul_reduce_scatter"
_AR = "matmul_all_reduce"

# FP8 calls take the same entries. In the FP8 sweep (e4m3, run `table` of h200_fp8_gemm.json)
# the 16-bit choices were within 1.1% of the fastest candidate on 27 of the 32 rows and within
# 3.3% on 30; one config measured twice in that run differed by up to 7% (gpt3-qkv M=8192). The
# one row where another choice was clearly faster, llama70b-fc2 M=16384 (cooperative own rows
# 5.5% ahead of ping-pong), now runs cooperative own rows too.
_FP8 = "h200_fp8_gemm.json"
_SWEEPS = ("h200_gemm_candidates.json", "h100_gemm_candidates.json")

# The all-gather GEMM's choices other than the tile: swizzle 4 and the own rows read from x.
_AG_REST = {"swizzle": 4, "local_read": "direct"}
_AG_REST_WHY = (" Swizzle 4 (bands of 4 cluster rows sweep B's columns together in L2) was the "
                "fastest on llama70b-fc1 at 2048 tokens and within 1% of 8 at 8192; reading the "
                "own rows straight from x, not copying them first, was 1-5% faster on 15 of 16 "
                "row measurements (the other level).")

# GEMM+RS: the own-rows GEMM's swizzle by its rows. With 4, bands of 4 cluster rows of tiles
# share B's columns in L2: 1.3-4.0% faster at 8192 tokens on 3 of 4 shapes, but level to 1.6%
# slower at 2048, where the own rows are a single band and the swizzle turns the landing-order
# sweep into column order; so 4 from two bands (2 * 4 * 256 = 2048 rows) up.
_ROWS_WHY = {
    "rows_lt_2048": " Own-rows swizzle 1: under two bands of 4 cluster rows, a swizzle turns the "
                    "sweep in landing order into column order and measured level to 1.6% slower.",
    "rows_ge_2048": " Own-rows swizzle 4: bands of 4 cluster rows share B's columns in L2, "
                    "1.3-4.0% faster at 8192 tokens on 3 of 4 shapes.",
}
_ROWS_SWIZZLE = {"rows_lt_2048": 1, "rows_ge_2048": 4}

# The three epilogue classes at tp=2: (reduce, push, own-rows schedule, evidence, why).
_EPILOGUE_CLASSES = {
    "whole_epilogue": (
        "whole", "cooperative", "h200x2_gemm_rs_reduce_and_push.json",
        "The peer's partial is small for K (<= 6144 bytes per K) or one tile of rows: the "
        "own-rows GEMM's epilogue sums it without stalling, saving the reduction pass; picked "
        "the faster mode in 15 of 16 measured cases, the other within 0.5%."),
    "chunked": (
        "chunked", "cooperative", "h200_gemm_rs_own_rows_schedule.json",
        "The partial goes in 4 flagged row chunks, so the epilogue waits for a quarter of the "
        "push (5-7% faster than one push on llama70b-out from 4096 tokens). Cooperative "
        "128x256 own-rows tiles: the tuning sweeps measured ping-pong 128x128 slower on every "
        "such row, by 1.8-7.6% on H200 and by 11-27% on H100 SXM (an earlier host-clock run "
        "on H200 had it 1-10% ahead; the device-clock sweeps time both side by side)."),
    "chunked_long_k": (
        "chunked", "cooperative", "h200_gemm_rs_own_rows_schedule.json",
        "Chunked push as for K_local <= 16384, but at K_local 24576 ping-pong measured "
        "1.01-1.05x cooperative's time, so the cooperative 128x256 tiles."),
}


def _rs_epilogue_entries():
  """One entry per epilogue class and own-rows band. Evidence: the class's file, and for the
  bands from 2048 rows up also the own-rows swizzle runs."""
  for base, (push, schedule, evidence, why) in _EPILOGUE_CLASSES.items():
    for rows, swizzle in _ROWS_SWIZZLE.items():
      files = (evidence,) + (("h200x2_gemm_rs_own_rows_swizzle.json",)
                             if rows == "rows_ge_2048" else ()) + _SWEEPS + (_FP8,)
      yield Entry(_RS, "sm90", "*", 2, f"{base}.{rows}",
                  {"reduce": "epilogue", "push": push, "own_rows_schedule": schedule,
                   "own_rows_swizzle": swizzle, "peer_rows_swizzle": 1},
                  files, why + _ROWS_WHY[rows])


_PASS = {"reduce": "pass", "push": "whole", "own_rows_schedule": "cooperative",
         "own_rows_swizzle": 1, "peer_rows_swizzle": 1}

ENTRIES = (
    Entry(_AG, "sm90", "*", "*", "few_waves",
          {"tile": "cooperative_128x256_cluster2x1", **_AG_REST},
          ("h200x2_ag_gemm_tile_configs.json", "h200x2_ag_gemm_swizzle_and_local_read.json",
           *_SWEEPS, _FP8),
          "Under 4 waves of 128x256 tiles the last, partly empty wave costs more than the big "
          "tile saves, and the 128x128 ping-pong tile (twice the tiles, a smaller last wave) "
          "won on H200 (llama70b-qkv at 2048 tokens, 320 tiles on 132 SMs: 1.13x cuBLAS against "
          "1.16x) but lost on H100 SXM (1.29x against 1.17x): the cooperative tile is the better "
          "of the two on both, and the H200 table keeps ping-pong." + _AG_REST_WHY),
    Entry(_AG, "sm90", "*", "*", "many_waves",
          {"tile": "cooperative_128x256_cluster2x1", **_AG_REST},
          ("h200x2_ag_gemm_tile_configs.json", "h200x2_ag_gemm_swizzle_and_local_read.json",
           *_SWEEPS, _FP8),
          "With the cooperative 128x256 tile and a 2x1 cluster the fused op was the fastest "
          "of the tile configs on every benchmark row with 4 or more waves of tiles." +
          _AG_REST_WHY),
    Entry(_AG, "sm90", "*", "*", "many_waves.wide_bands",
          {"tile": "cooperative_128x256_cluster2x1", "swizzle": 8, "local_read": "direct"},
          ("h200_gemm_candidates.json", "h200x2_ag_gemm_tile_configs.json", _FP8),
          "Cooperative 128x256 as for many_waves. Swizzle 8 where its bands of 2048 rows tile "
          "every shard and N is whole groups of 8 tiles: the GEMM-only sweep on one H200 "
          "measured it the fastest whole-tile candidate on 8 of the 9 such rows (M 4096-16384 "
          "of llama70b-fc1, gpt3-qkv and gpt3-fc1), 0.4-4.5% faster than swizzle 4 there and "
          "0.7% slower on the ninth (gpt3-qkv M=4096); elsewhere "
          "swizzle 8 pads the grid (llama70b-qkv's 20 N tiles: 1.34-1.38x cuBLAS) or, at 2048 "
          "tokens, makes a band span both shards (swizzle 4 measured fastest there in the "
          "fused op)."),
    Entry(_RS, "sm90", "*", 2, "batched", dict(_PASS),
          ("h200x2_gemm_rs_reduce_and_push.json",),
          "A batched partial is one [b, m, N] slot whose row chunks are not contiguous, so it "
          "goes in one push; past the epilogue's no-stall size (6144 bytes per K) the first "
          "wave would wait for all of it, and the separate reduction pass is faster."),
    *_rs_epilogue_entries(),
    Entry(_RS, "sm90", "*", "*", "tp_not_2", dict(_PASS),
          ("h200x2_gemm_rs_reduce_and_push.json",),
          "The epilogue reduction sums one peer's partial, so it serves tp=2 only; other group "
          "sizes sum every peer's partial in the separate wait+reduce pass."),
    Entry(_AR, "sm90", "*", "*", "decode",
          {"tile": "swap_ab_streamk", "push": "whole", "swizzle": 1},
          ("h200_gemm_decode.json", "h200_gemm_all_reduce.json"),
          "Up to 128 rows the GEMM is a read of the weight. The swap-AB decode GEMM (the weight's "
          "N on the tile's 128-row side, the rows padded to 16, 32 or 64) took 1.10x cuBLAS's "
          "time on average over 24 rows at M 1-128, 1.01-1.10x on the 224-576 MiB weights, "
          "against 1.38x for CUTLASS's stream-K 128x128 GEMM and 1.77x for the persistent "
          "128x256 one in the same run; it trails cuBLAS most on llama70b-out's 64 MiB (up to "
          "1.38x, where every kernel's time is mostly fixed cost). One push: a few rows."),
    Entry(_AR, "sm90", "*", "*", "prefill.rows_lt_2048",
          {"tile": "cooperative_128x256_cluster2x1", "push": "chunked", "swizzle": 1},
          ("h200_gemm_all_reduce.json",),
          "At 512 rows the persistent 128x256 GEMM without swizzle took 1.03-1.24x cuBLAS's time "
          "in both runs, stream-K 1.03-1.56x (ahead of it on 1 of 4 shapes in one run, 3 of 4 in "
          "the other), the persistent GEMM with swizzle 4 about twice cuBLAS's. The chunked push "
          "lets a chunk's copy overlap the next chunk's GEMM, as GEMM+RS's push does; not yet "
          "timed for this op on two GPUs."),
    Entry(_AR, "sm90", "*", "*", "prefill.rows_ge_2048",
          {"tile": "cooperative_128x256_cluster2x1", "push": "chunked", "swizzle": 4},
          ("h200_gemm_all_reduce.json",),
          "From 2048 rows swizzle 4 (bands of tile rows sharing B in L2) took 1.015x and 1.019x "
          "cuBLAS's time on average in two runs (1.00-1.04) against 1.027x and 1.030x (0.97-1.08) "
          "without: ahead on 8 of 8 measurements at 8192 rows (1-5%), level or behind on 6 of 8 "
          "at 2048 (up to 4%). Chunked push as below 2048 rows."),
)

# GEMM+AllReduce has no rule at tp >= 2, so impl="auto" takes XLA's psum for it: no two-GPU
# timing of the fused op against XLA exists yet to say where it wins. At tp=1 the op is its GEMM
# alone. With 16-bit operands no op has a rule there: the GEMM-only tables put it behind cuBLAS
# on average (decode
# GEMM at M <= 128: 1.10x on H200, h200_gemm_decode.json; 1.079x on H100, h100_gemm_decode.json,
# 1.04-1.25x at one row; persistent GEMM 1.075x above, h200_gemm_all_reduce.json). In the
# generation example on one H100 the fused layers decoded at most a little ahead of Flax's
# (0.96-0.98x at batch 1, h100_generate_llama70b_8l_batch1.json; 0.905x at batch 16,
# h100_generate_llama70b_8l.json, where auto, Flax's own program, took 1.03x: the spread of
# timing the models one after the other), and no table says which rows the kernel wins, so no
# rule yet.
# With FP8 operands the decode rows of an H100 have one (below): every dense op at tp=1 runs the
# same GEMM (GEMM+AllReduce's, tuned by rows), so the rule covers all three.
#
# The grouped and MoE ops: their XLA path multiplies with lax.ragged_dot, which the grouped
# table puts 7-72x behind the kernel on one H200. For the MoE ops at tp >= 2 no two-GPU timing
# exists, but their XLA path does the same collectives around ragged_dot: the fused op would
# have to move its tokens several times slower than NCCL to lose, so the rule takes the kernel
# at any tp.
# Both tables were measured at 4,096-16,384 rows; fewer rows are not timed.
_GROUPED = ("h200_grouped_gemm.json", "h200_moe_layer.json")
_MOE_WHY = ("Its XLA path is ragged_dot per segment, which on one H200 ran 6.9-72x slower than "
            "the grouped GEMM kernel (grouped table) and made the MoE layer's step 5.3-33x "
            "slower; no two-GPU timing of the fused communication exists, and it would have to "
            "be several times slower than NCCL's to lose.")
_FP8_DECODE_H100 = ("h100_fp8_gemm_decode.json",)
_FP8_DECODE_WHY = (
    "On one H100 the FP8 decode GEMM (e4m3, row-wise scales, fast accumulation) took 0.926x the "
    "time of XLA's FP8 dot on average over the 11 rows measured (llama70b-out M 1-128 and "
    "llama70b-fc2 M 1-64, per-device shapes at tp=2), 0.85-0.98x on 10 of them and 1.047x on "
    "llama70b-out M=16. The other 13 decode rows (GPT-3's shapes, llama70b-fc2 M=128) are not "
    "measured; the H200 has no FP8 decode table, so it keeps XLA.")
AUTO_RULES = (
    AutoRule(_AG, "sm90", 2, 2048, None, ("h200x2_ag_gemm_tp2.json",),
             "On 2xH200 the fused kernel was at least level with XLA on every benchmark shape "
             "from 2048 gathered rows, in every run of the file (1.00-1.29x); fewer rows and "
             "other group sizes stay with XLA."),
    AutoRule(_RS, "sm90", 2, 2048, 2**27, ("h200x2_gemm_rs_tp2.json",),
             "On 2xH200 every row from 2048 tokens won by >= 1.05x, except where rows * K_local "
             "passes 2**27: there the hidden communication is a few percent of the GEMM and the "
             "kernel measured 0.99-1.04x XLA (gpt3-fc2 from 8192 tokens, llama70b-fc2 at 16384)."),
    *(AutoRule(op, "sm90", 1, 1, None, _FP8_DECODE_H100, _FP8_DECODE_WHY, operands="fp8",
               max_rows=128, device="h100_sxm") for op in (_AG, _RS, _AR)),
    AutoRule("grouped_matmul", "sm90", 1, 0, None, _GROUPED,
             "On one H200 the grouped GEMM kernel was 7.2-72x faster than lax.ragged_dot, XLA's "
             "path, on every row of the grouped table (four MoE layers, 16,384 routed rows, even "
             "and skewed routing; backward 6.9-64x), and the MoE layer's step 5.3-33x."),
    AutoRule("all_gather_grouped_matmul", "sm90", "*", 0, None, _GROUPED, _MOE_WHY),
    AutoRule("grouped_matmul_reduce_scatter", "sm90", "*", 0, None, _GROUPED, _MOE_WHY),
)
