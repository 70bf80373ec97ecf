#!/usr/bin/env bash
# Times the fused AllGather+GEMM with each compiled tile config (JAXFLUX_AG_GEMM_CONFIG=0..3,
# xla_ffi/kernels/ag_gemm_sm90.h) on every ag_gemm shape, to choose a config per shape.
# On the GPU machine, after building (see gpu_check.sh):
#   bash benchmarks/sweep_ag_gemm_configs.sh [OUTDIR] [M list] [SHAPES_FILE]
# e.g. the training step's shapes: ... $OUT 4096 benchmarks/shapes_llama70b_8l_train.json
set -uo pipefail
OUTDIR=${1:-${OUT:-/tmp/jaxflux_gpu}}
MS=${2:-2048,8192}
SHAPES=()
[ -n "${3:-}" ] && SHAPES=(--shapes-file "$3")
mkdir -p "$OUTDIR"
for c in 0 1 2 3; do
  variants=gemm_only,jaxflux
  [ "$c" = 0 ] && variants=gemm,gemm_only,comm,xla,jaxflux
  JAXFLUX_AG_GEMM_CONFIG=$c timeout 240 python3 -m jaxflux.bench --op ag_gemm --M "$MS" \
    "${SHAPES[@]}" --variants "$variants" --iters 50 --repeats 3 --warmup 5 \
    --out "$OUTDIR/ag_gemm_config$c.json" 2>&1 | grep -A12 "^name" | sed "s/^/config$c /"
done
