#!/usr/bin/env bash
# The one command for GPU sessions: build jaxflux with CUDA, run the GPU tests, the benchmarks and
# the training example on all local GPUs. From the repository root on the GPU machine:
#   bash benchmarks/gpu_check.sh [OUTDIR]      (OUTDIR defaults to $OUT, else /tmp/jaxflux_gpu)
# Needs .whl/ with the CUTLASS wheel (pip download --no-deps -d .whl nvidia-cutlass==4.2.0.0),
# carried to the machine. Stages are bounded by timeouts so one slow stage can't eat the lease.
set -uo pipefail
OUTDIR=${1:-${OUT:-/tmp/jaxflux_gpu}}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=16 JAXFLUX_CUDA=ON
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on shared machines
status=0

python3 -m pip install -q --no-deps --no-index .whl/*.whl || exit 1
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUTDIR/build.log" 2>&1; then
  tail -60 "$OUTDIR/build.log"; exit 1
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax, jaxflux; print('jax', jax.__version__, 'has_cuda', jaxflux.has_cuda(), jax.devices())"

echo "== GPU tests"
timeout 400 python3 -m pytest -q -rs -m gpu tests -p no:cacheprovider 2>&1 \
  | tee "$OUTDIR/gpu_tests.log" | tail -8
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== all-gather bandwidth (in-graph loop: no host dispatch in the timing)"
for chunks in 4 1; do
  JAXFLUX_AG_MAX_CHUNKS=$chunks timeout 100 python3 -m jaxflux.bench --op all_gather \
    --sizes-mib 16,64,256 --timing loop --chain perturb \
    --out "$OUTDIR/all_gather_loop_chunks$chunks.json" 2>&1 | tail -4 || status=1
done
echo "== all-gather bandwidth (100 jitted calls queued from Python)"
timeout 100 python3 -m jaxflux.bench --op all_gather --sizes-mib 16,64,256 --timing dispatch \
  --out "$OUTDIR/all_gather_dispatch.json" 2>&1 | tail -4 || status=1

echo "== fused AllGather+GEMM vs XLA (every ag_gemm shape at M=2048,8192)"
timeout 240 python3 -m jaxflux.bench --op ag_gemm --M 2048,8192 \
  --variants gemm,gemm_only,comm,xla,jaxflux,auto --timing dispatch --iters 50 --repeats 3 \
  --warmup 5 --out "$OUTDIR/ag_gemm_fused.json" 2>&1 | grep -A12 "^name" || status=1

echo "== fused GEMM+ReduceScatter vs XLA (every gemm_rs shape at M=2048,8192)"
timeout 200 python3 -m jaxflux.bench --op gemm_rs --M 2048,8192 \
  --variants gemm,comm,xla,jaxflux,auto --timing dispatch --iters 30 --repeats 3 --warmup 3 \
  --out "$OUTDIR/gemm_rs_fused.json" 2>&1 | grep -A12 "^name" || status=1

echo "== training example on all GPUs (bf16)"
timeout 120 python3 examples/train_tp_transformer.py --dtype bfloat16 --steps 20 2>&1 \
  | tee "$OUTDIR/example.log" | tail -4 || status=1
exit $status
