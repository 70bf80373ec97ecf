#!/usr/bin/env bash
# Issue 7: the training example in its three modes (jaxflux fused, xla, XLA windowed einsum) on
# all local GPUs, same seed and batches; one JSON per mode (loss curve, step times, MFU, HLO
# counts). On the GPU machine, after building (see gpu_check.sh):
#   bash benchmarks/train_modes.sh [OUTDIR] [STEPS]
# (env: PRESET=llama70b-8l, MODES="jaxflux xla windowed" by default)
# then, anywhere with matplotlib:
#   python benchmarks/plot_losses.py OUTDIR/train_*_jaxflux_*.json OUTDIR/train_*_xla_*.json
set -uo pipefail
OUTDIR=${1:-${OUT:-benchmarks/results}}
STEPS=${2:-40}
PRESET=${PRESET:-llama70b-8l}
mkdir -p "$OUTDIR"
status=0
for mode in ${MODES:-jaxflux xla windowed}; do
  # Run as a script: --mode windowed must set XLA_FLAGS before JAX starts.
  timeout "${MODE_TIMEOUT_S:-300}" python3 examples/train_tp_transformer.py --preset "$PRESET" \
    --mode "$mode" --steps "$STEPS" --no-compare --print-hlo-collectives --quiet \
    --out "$OUTDIR/train_${PRESET}_${mode}_$(date -u +%F).json" 2>&1 | tail -6 || status=1
done
exit $status
