// benchmarks/bench_cuda_dispatch.cu compiled against the CUDA runtime double,
// run as `--check`: the benchmark's step is byte-identical to the host
// dispatcher and its baseline copies disjoint regions (cuda-cpu harness).
#include "../../benchmarks/bench_cuda_dispatch.cu"
