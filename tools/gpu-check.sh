#!/usr/bin/env bash
# Every check that needs a GPU, in two halves, so that a lent GPU machine's
# few minutes go to running, not building:
#
#   tools/gpu-check.sh build   here (nvcc, no GPU): builds the CUDA test and
#                              benchmark programs for sm_90 into BUILD_DIR
#                              (default build-gpu) and copies them, with the
#                              data they read, into BUILD_DIR/carry (small
#                              enough to travel with the working tree)
#   tools/gpu-check.sh run     on the GPU machine, from the repository root
#                              with BUILD_DIR/carry beside it: runs the tests,
#                              compute-sanitizer (memcheck and synccheck) over
#                              the device op and data path, and the
#                              benchmarks; logs into $OUT (or gpu-check-out/)
#                              and a summary on standard output
#
# With the device tool: build here, then run `tools/gpu-check.sh run` there
# with carry = ["build-gpu/carry"] and a time limit of 480 s.
#
# The run half takes about 6 minutes on an H200; each part has its own time
# limit, so one hang cannot eat the lease. It uses the machine's own NCCL and
# cuDNN (libcudnn is too large to carry: where the loader cannot find it, the
# first libcudnn.so.9 under /usr, /opt or PyTorch's wheel is put on
# LD_LIBRARY_PATH; the programs print the version they run with) and, where a
# library is absent, says so and goes on.
set -uo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build-gpu}
carry="$build_dir/carry"
tests=(cuda_device_test cuda_dedup_test cuda_nccl_test cuda_nccl_errors_test cuda_host_test cudnn_attention_test)
benches=(bench_cuda_dispatch bench_cuda_dedup bench_cuda_attention bench_cuda_cp_attention bench_cuda_checksum)

build() {
  set -e
  tools/install-deps.sh
  cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DCPDISPATCH_WITH_CUDA=ON -DCPDISPATCH_WITH_CUDNN=ON \
    -DCMAKE_CUDA_ARCHITECTURES="90-real;90-virtual" -DCPDISPATCH_WITH_PYTHON=OFF \
    -DCPDISPATCH_BUILD_CUDA_PROGRAMS=ON -DCPDISPATCH_BUILD_BENCHMARKS=ON
  cmake --build "$build_dir" -j"$(nproc)" --target "${tests[@]}" "${benches[@]}"
  rm -rf "$carry" && mkdir -p "$carry"
  for program in "${tests[@]}" "${benches[@]}"; do
    strip -o "$carry/$program" "$build_dir/bin/$program"
  done
  du -sh "$carry"
}

# Runs "$@" with a time limit, its output into $out/NAME.log; one summary line.
part() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  local verdict=ok
  [ $rc -eq 124 ] && verdict="TIMED OUT after ${limit}s"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && verdict="FAILED (exit $rc)"
  printf '%-44s %-22s %4ds  %s\n' "$name" "$verdict" $((SECONDS - start)) "$(grep -E '^\[  (PASSED|FAILED)|ERROR SUMMARY|^[0-9]+ tests' "$out/$name.log" | tr '\n' ' ' | cut -c1-90)"
  [ $rc -eq 0 ] || failed=$((failed + 1))
}

sanitize() {
  local tool=$1 program=$2 filter=$3
  if ! command -v compute-sanitizer >/dev/null; then
    echo "compute-sanitizer: not on this machine (PATH=$PATH)" >"$out/sanitizer-$tool-$program.log"
    printf '%-44s %s\n' "sanitizer-$tool-$program" "not run: no compute-sanitizer here"
    return
  fi
  part "sanitizer-$tool-$program" 150 compute-sanitizer --tool "$tool" --error-exitcode 3 \
    "$carry/$program" --gtest_filter="$filter" --gtest_brief=1
  if grep -qiE 'not supported|unable to|cannot be (used|enabled)' "$out/sanitizer-$tool-$program.log" &&
     ! grep -q 'ERROR SUMMARY: [1-9]' "$out/sanitizer-$tool-$program.log"; then
    echo "  (compute-sanitizer refused this device: see the log; not counted as a failure)"
    failed=$((failed - 1))
  fi
}

# Puts a libcudnn.so.9 on the loader's path when the programs cannot find one.
find_cudnn() {
  ldd "$carry/cudnn_attention_test" 2>/dev/null | grep -q 'libcudnn.so.9 => not found' || return 0
  local lib
  lib=$(find /usr /opt /usr/local -name 'libcudnn.so.9' 2>/dev/null | head -1)
  if [ -z "$lib" ] && command -v python3 >/dev/null; then
    lib=$(python3 -c 'import glob, os, torch; print((glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "cudnn", "lib", "libcudnn.so.9")) + [""])[0])' 2>/dev/null)
  fi
  if [ -n "$lib" ]; then
    export LD_LIBRARY_PATH="$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "cuDNN: using $lib"
  else
    echo "cuDNN: no libcudnn.so.9 on this machine; the cuDNN parts will fail to load"
  fi
}

run() {
  out=${OUT:-gpu-check-out}
  mkdir -p "$out"
  failed=0
  export PATH="$PATH:/usr/local/cuda/bin:/usr/local/cuda/compute-sanitizer"
  find_cudnn
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >"$out/gpu.txt" 2>&1
  echo "GPU: $(tail -n +2 "$out/gpu.txt" | head -1)   $(date -u '+%Y-%m-%d %H:%M UTC')"
  for program in "${tests[@]}"; do
    [ -x "$carry/$program" ] && part "$program" 240 "$carry/$program" --gtest_brief=1
  done
  sanitize memcheck cuda_device_test '*CpAttentionDevice*:*DeviceSim*:*Attention*'
  sanitize synccheck cuda_device_test '*CpAttentionDevice*:*Attention*'
  sanitize memcheck cuda_dedup_test '*Sim*'
  sanitize memcheck cudnn_attention_test 'CudnnAttentionGpu.*'
  part bench_cuda_attention-cudnn 120 "$carry/bench_cuda_attention" --cases targets --types bf16 --deterministic both --repeats 10
  if command -v python3 >/dev/null && python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    part bench_torch_sdpa 120 python3 benchmarks/python/bench_torch_sdpa.py --repeats 10
  else
    printf '%-44s %s\n' bench_torch_sdpa "not run: no PyTorch with CUDA here"
  fi
  part bench_cuda_cp_attention 120 "$carry/bench_cuda_cp_attention" --stages 1,2,4 --repeats 5 --seed 0
  part bench_cuda_attention-cuda 90 "$carry/bench_cuda_attention" --kernel cuda --cases quick --repeats 3
  part bench_cuda_dispatch 90 "$carry/bench_cuda_dispatch" 8 8192 20
  part bench_cuda_dedup 90 "$carry/bench_cuda_dedup" 8 16384 20
  part bench_cuda_checksum 60 "$carry/bench_cuda_checksum" 8 1048576 20
  echo "gpu-check: $failed part(s) failed; logs in $out/"
  [ $failed -eq 0 ]
}

case "${1:-}" in
  build) build ;;
  run) run ;;
  *) sed -n '2,19p' "$0"; exit 2 ;;
esac
