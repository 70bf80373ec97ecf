#!/usr/bin/env bash
# Builds jaxflux with CUDA, then runs the selected stages on the local GPUs. From the repository
# root on a Hopper machine, with the CUTLASS wheel in .whl/:
#   STAGES="tests tables train" bash benchmarks/gpu_check.sh [OUTDIR]   (OUTDIR: $OUT, else
#   /tmp/jaxflux_gpu; every result and log goes there; result files are named after the GPU,
#   h100_* or h200_*)
# Stages (default: tests, tables and train; keep each call under the machine's time limit by
# picking stages):
#   tests   the GPU-marked tests of the tiers in GPU_TIERS (default: quick), one pytest run each:
#             quick    -m "gpu and not slow": every kernel family once, each fused op once with
#                      2 and with 4 processes sharing a GPU, the layers' fused path training on
#                      one GPU.
#                      Meant to take under 3 minutes on one H100 (benchmarks/README.md); run
#                      it for every change to GPU code.
#             full     all of the chunks below, each under 8 minutes on one H100 (one device
#                      call each; benchmarks/README.md has their times): kernels (the 16-bit GEMM-only and grouped kernels in
#                      full, and the tp=1 shape fuzz), fp8_ag and fp8_rest (the FP8 GEMM-only
#                      kernels on AG+GEMM's shapes, then on the others), ops (the fused ops
#                      sharing one GPU at tp=2: each op in full, FP8, the MoE ops and layer,
#                      the shape fuzz, the MLP, the dead peer; the training example), matrix and
#                      matrix_pingpong (the 16-bit shape matrix, GEMM+RS's own-rows schedule as
#                      chosen and forced to ping-pong), tp4 and tp8 (every shared-GPU test but
#                      the matrix and the fuzz with 4 and 8 processes on one GPU), fuzz_tp4 (the
#                      shape fuzz at tp=4), rest (the tests that need two GPUs).
#           PYTEST_K replaces the tier's -k (e.g. GPU_TIERS=ops PYTEST_K=fuzz_across).
#           gpu_tests_<tier>.xml (JUnit) holds what tests record, e.g. test_fp8_gpu.py's error
#           per case.
#   tune    python -m jaxflux.tune on this GPU (about 5 minutes on an H100): its table and sweep
#           as <gpu>_tune_table.json and <gpu>_tune_table.sweep.json, for
#           jaxflux/tuning/tables/ and benchmarks/results/
#   tables  the benchmark tables: the single-GPU GEMM tables (<gpu>_gemm_table.json,
#           <gpu>_gemm_all_reduce.json, <gpu>_gemm_decode.json, and the FP8 one,
#           <gpu>_fp8_gemm.json), the grouped GEMM's (<gpu>_grouped_gemm.json, against tokamax
#           where .whl/tokamax holds its wheels); with two or more
#           GPUs also both fused ops and the all-gather against XLA at tp=2. TABLES narrows
#           them by output name (e.g. TABLES=h100_fp8_gemm).
#   generate  the generation example at the llama70b-8l preset (batch 16, bfloat16), jaxflux.Dense
#           against flax.linen.Dense with each decode step's GPU time split by the profiler:
#           --impl fused, --impl auto, fused at batch 1, fused with --fp8 (GENERATE_RUNS picks:
#           fused auto fused_b1 fp8, or fp8_auto, auto with --fp8; each as
#           <gpu>_generate_<run>.json; an FP8 run adds a calibration pass and a third model: give
#           it a call of its own). XLA's GEMM autotuning results go to OUTDIR/xla_autotune;
#           XLA_AUTOTUNE_CACHE=DIR (such a folder from an earlier call, carried) starts from
#           them, so a later call need not autotune the same FP8 shapes again
#   train   the training example (llama70b-8l preset, $TRAIN_STEPS steps, default 60) in modes
#           jaxflux, xla and windowed; needs two GPUs
#   wheel   build once, install everywhere: `pip wheel` here (into OUTDIR/wheel), then a fresh
#           venv with neither the CUTLASS wheel nor nvcc on its PATH installs it and runs the
#           quick tier from a copy of the tests without the source package (WHEEL_PYTEST narrows
#           that run); runs before, and without, the editable build of the other stages
# PREBUILT=1 skips the build and runs the extension module already in jaxflux/ (built by an
# earlier call of this script on the same kind of machine, carried over). A call that builds
# (the wheel stage, or any stage without PREBUILT) leaves its module in OUTDIR to carry.
set -uo pipefail
OUTDIR=${1:-${OUT:-/tmp/jaxflux_gpu}}
STAGES=${STAGES:-tests tables train}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=16 JAXFLUX_CUDA=ON
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on shared machines
status=0
T0=$(date +%s)
stage() { [[ " $STAGES " == *" $1 "* ]] && echo "== $1 (at $(( $(date +%s) - T0 )) s)"; }

if stage wheel; then
  s=$(date +%s)
  cutlass=/tmp/jaxflux_cutlass run_env=/tmp/jaxflux_wheel_run tree=/tmp/jaxflux_wheel_tests
  rm -rf "$cutlass" "$run_env" "$tree" "$OUTDIR/wheel"
  # The CUTLASS headers reach the build alone, never the environment that installs the wheel.
  python3 -m pip install -q --no-deps --no-index --target "$cutlass" .whl/*.whl \
    && PYTHONPATH="$cutlass" python3 -m pip wheel -q --no-deps --no-build-isolation \
      -w "$OUTDIR/wheel" . > "$OUTDIR/wheel_build.log" 2>&1 \
    || { tail -40 "$OUTDIR/wheel_build.log"; exit 1; }
  echo "wheel built in $(( $(date +%s) - s )) s: $(cd "$OUTDIR/wheel" && ls -s --block-size=K)"
  python3 -c "import glob, sys, zipfile
wheel = zipfile.ZipFile(glob.glob(sys.argv[1] + '/wheel/*.whl')[0])
for name in wheel.namelist():
  if name.startswith('jaxflux/_jaxflux'):
    open(sys.argv[1] + '/' + name.split('/')[-1], 'wb').write(wheel.read(name))" "$OUTDIR"
  # The tests, examples and shapes without jaxflux/: `import jaxflux` finds the installed wheel.
  mkdir -p "$tree" && tar --exclude=./jaxflux --exclude=./build --exclude=./.whl --exclude=./.git \
    -cf - . | tar -C "$tree" -xf -
  no_nvcc=$(tr : '\n' <<< "$PATH" | while read -r d; do [[ -x "$d/nvcc" ]] || echo "$d"; done \
            | paste -sd:)
  # A fresh venv that sees the packages python3 has (jax, flax, pytest; python3 may itself be a
  # venv's, whose packages --system-site-packages would not reach), but not the CUTLASS headers.
  python3 -m venv "$run_env"
  purelib="import sysconfig; print(sysconfig.get_path('purelib'))"
  python3 -c "$purelib" > "$("$run_env/bin/python" -c "$purelib")/base.pth"
  (cd "$tree" && export PATH="$run_env/bin:$no_nvcc" && unset PYTHONPATH CUDA_HOME \
    && ! command -v nvcc && python -m pip install -q --no-deps --no-index "$OUTDIR"/wheel/*.whl \
    && python -c "import importlib.util as u, jaxflux; assert not u.find_spec('cutlass_library')
assert jaxflux.has_cuda(); print('installed:', jaxflux.__file__)" \
    && s=$(date +%s) && python -m pytest -q -rs -m "gpu and not slow" ${WHEEL_PYTEST:-tests} \
      -p no:cacheprovider --durations=5 > "$OUTDIR/wheel_tests.log" 2>&1; code=$?
    echo "== wheel: quick tier from the wheel: $(( $(date +%s) - s )) s"; tail -8 \
      "$OUTDIR/wheel_tests.log"; exit $code) || status=1
  if [[ "$STAGES" == wheel ]]; then echo "end at $(( $(date +%s) - T0 )) s, status $status"
                                    exit $status; fi
fi

if [[ "${PREBUILT:-0}" == 1 ]]; then
  ls jaxflux/_jaxflux*.so > /dev/null || { echo "PREBUILT=1 but no jaxflux/_jaxflux*.so"; exit 1; }
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  python3 -m pip install -q --no-deps --no-index .whl/*.whl || exit 1
  if ! python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUTDIR/build.log" 2>&1
  then
    tail -60 "$OUTDIR/build.log"; exit 1
  fi
  echo "built at $(( $(date +%s) - T0 )) s"
  cp "$(python3 -c 'import jaxflux._jaxflux as m; print(m.__file__)')" "$OUTDIR/"
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
GPUS=$(python3 -c "import jax, jaxflux; assert jaxflux.has_cuda(); print(jax.device_count())") \
  || { echo "no CUDA build of jaxflux or no GPU"; exit 1; }
echo "GPUs: $GPUS"
GPU_NAME=$(python3 -c "
import jax
kind = jax.devices()[0].device_kind
print(next((n for n in ('h100', 'h200') if n in kind.lower()), 'gpu'))")

tier() {  # the pytest selection of a test tier, as arguments
  local gpu=(-m gpu) kernels=(tests/test_gemm_gpu.py tests/test_fuzz_gpu.py
                          tests/test_grouped_matmul_gpu.py) fp8=(tests/test_fp8_gpu.py)
  local ops=(tests/test_multiprocess_gpu.py tests/test_example_gpu.py)
  case $1 in
    quick) TIER_ARGS=(-m "gpu and not slow" tests) ;;
    kernels) TIER_ARGS=("${gpu[@]}" "${kernels[@]}") ;;
    # The FP8 kernels over every benchmark shape took more than one 10-minute call on an H200:
    # AG+GEMM's shapes, then the rest (GEMM+RS's, odd shapes, decode rows).
    fp8_ag) TIER_ARGS=("${gpu[@]}" "${fp8[@]}" -k ag_gemm) ;;
    fp8_rest) TIER_ARGS=("${gpu[@]}" "${fp8[@]}" -k "not ag_gemm") ;;
    ops) TIER_ARGS=("${gpu[@]}" "${ops[@]}" -k "not matrix and not tp4 and not tp8 and not once") ;;
    matrix) TIER_ARGS=("${gpu[@]}" tests/test_multiprocess_gpu.py -k "matrix and not pingpong") ;;
    matrix_pingpong) TIER_ARGS=("${gpu[@]}" tests/test_multiprocess_gpu.py -k matrix_pingpong) ;;
    tp4) TIER_ARGS=("${gpu[@]}" tests/test_multiprocess_gpu.py
                    -k "tp4 and not fuzz and not once") ;;
    tp8) TIER_ARGS=("${gpu[@]}" tests/test_multiprocess_gpu.py -k tp8) ;;
    fuzz_tp4) TIER_ARGS=("${gpu[@]}" tests/test_multiprocess_gpu.py -k "fuzz and tp4") ;;
    rest) TIER_ARGS=("${gpu[@]}" tests)
          for f in "${kernels[@]}" "${fp8[@]}" "${ops[@]}"; do TIER_ARGS+=("--ignore=$f"); done ;;
    *) echo "unknown test tier $1 (quick, full, kernels, fp8_ag, fp8_rest, ops, matrix,"\
            "matrix_pingpong, tp4, tp8, fuzz_tp4, rest)"
       return 1 ;;
  esac
}

if stage tests; then
  tiers=${GPU_TIERS:-quick}
  tiers=${tiers/full/kernels fp8_ag fp8_rest ops matrix matrix_pingpong tp4 tp8 fuzz_tp4 rest}
  for t in $tiers; do
    tier "$t" || { status=1; continue; }
    s=$(date +%s)
    timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -rs "${TIER_ARGS[@]}" \
      ${PYTEST_K:+-k "$PYTEST_K"} -p no:cacheprovider --durations=10 -o faulthandler_timeout=300 \
      --junitxml "$OUTDIR/gpu_tests_$t.xml" -o junit_family=xunit1 \
      > "$OUTDIR/gpu_tests_$t.log" 2>&1 \
      || status=1
    echo "== tier $t: $(( $(date +%s) - s )) s"
    tail -25 "$OUTDIR/gpu_tests_$t.log"
  done
fi

bench() {  # output name, then the benchmark's arguments; prints the table's lines
  local name=$1; shift
  [[ -z "${TABLES:-}" || " $TABLES " == *" $name "* ]] || return 0
  timeout "${BENCH_TIMEOUT:-540}" python3 -m jaxflux.bench "$@" --timing device \
    --out "$OUTDIR/$name.json" > "$OUTDIR/$name.log" 2>&1 || status=1
  sed -n '/^\(of \|name\)/,$p' "$OUTDIR/$name.log"
}

if stage tune; then
  timeout "${TUNE_TIMEOUT:-540}" python3 -m jaxflux.tune --out "$OUTDIR/${GPU_NAME}_tune_table.json" \
    > "$OUTDIR/tune.log" 2> "$OUTDIR/tune.err" || status=1
  tail -4 "$OUTDIR/tune.log"; tail -c 300 "$OUTDIR/tune.err"; echo
fi

if stage tables; then
  bench ${GPU_NAME}_gemm_table --op gemm --of ag_gemm,gemm_rs
  bench ${GPU_NAME}_gemm_all_reduce --op gemm --of gemm_ar
  bench ${GPU_NAME}_gemm_decode --op gemm --of gemm_ar --M 1,8,16,32,64,128
  # XLA compiles and autotunes each new FP8 shape for 10-40 s: the 32 rows need more than one
  # call's time on a fresh machine; FP8_OF / FP8_M narrow them (e.g. FP8_OF=ag_gemm FP8_M=2048,4096).
  bench ${GPU_NAME}_fp8_gemm --op gemm --of "${FP8_OF:-ag_gemm,gemm_rs}" ${FP8_M:+--M "$FP8_M"} \
    --dtype float8_e4m3fn --variants xla_fp8_fast,fp8_gemm_only,quantize
  # The grouped GEMM (forward and backward, with its roofline), against tokamax.ragged_dot where
  # tokamax's wheels are in .whl/tokamax (`pip download` tokamax and its dependencies there for
  # Python 3.12: the GPU machine has no network); GROUPED_ARGS narrows the rows.
  if [[ -z "${TABLES:-}" || " $TABLES " == *" ${GPU_NAME}_grouped_gemm "* ]] && [[ -d .whl/tokamax ]]
  then
    python3 -m pip install -q --no-index --find-links .whl/tokamax tokamax || status=1
  fi
  bench ${GPU_NAME}_grouped_gemm --op grouped_gemm --backward --iters 30 --repeats 3 \
    ${GROUPED_ARGS:-}
  if (( GPUS >= 2 )); then
    for op in ag_gemm gemm_rs; do
      bench "${GPU_NAME}x2_${op}_tp2" --op $op --tp 2 --M 2048,4096,8192 \
        --variants gemm,gemm_only,xla,jaxflux,auto
    done
    bench ${GPU_NAME}x2_all_gather_tp2 --op all_gather --tp 2 --sizes-mib 16,32,64,128,256
  fi
fi

if stage generate; then
  # The generation example at the llama70b-8l preset against flax.linen.Dense, each decode step's
  # GPU time split by the profiler (GEMM kernels, other kernels, idle); GENERATE_RUNS picks runs.
  autotune="$OUTDIR/xla_autotune"
  mkdir -p "$autotune"
  if [[ -n "${XLA_AUTOTUNE_CACHE:-}" ]]; then cp -r "$XLA_AUTOTUNE_CACHE"/. "$autotune"/; fi
  for run in ${GENERATE_RUNS:-fused auto fused_b1 fp8}; do
    case $run in
      fused) flags=(--impl fused) ;;  auto) flags=(--impl auto) ;;
      fused_b1) flags=(--impl fused --batch 1) ;;  fp8) flags=(--impl fused --fp8) ;;
      fp8_auto) flags=(--impl auto --fp8) ;;
      *) echo "generate: unknown run $run (fused, auto, fused_b1, fp8, fp8_auto)"; status=1
         continue ;;
    esac
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_per_fusion_autotune_cache_dir=$autotune" \
      timeout "${GENERATE_TIMEOUT:-540}" python3 examples/generate.py --preset llama70b-8l \
      --dtype bfloat16 --new-tokens 32 --profile 8 "${flags[@]}" \
      --out "$OUTDIR/${GPU_NAME}_generate_$run.json" > "$OUTDIR/generate_$run.log" 2>&1 || status=1
    grep -E "decode|profile|outside" "$OUTDIR/generate_$run.log" | cut -c1-220
  done
fi

if stage train; then
  if (( GPUS < 2 )); then
    echo "train: needs two GPUs (tp=2), skipped"
  else
    for mode in jaxflux xla windowed; do
      timeout "${TRAIN_TIMEOUT:-180}" python3 examples/train_tp_transformer.py --preset llama70b-8l \
        --mode $mode --steps "${TRAIN_STEPS:-60}" --no-compare --quiet \
        --out "$OUTDIR/train_llama70b-8l_$mode.json" > "$OUTDIR/train_$mode.log" 2>&1 || status=1
      tail -3 "$OUTDIR/train_$mode.log"
    done
  fi
fi

echo "end at $(( $(date +%s) - T0 )) s, status $status"
exit $status
