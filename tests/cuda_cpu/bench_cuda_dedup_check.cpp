// benchmarks/bench_cuda_dedup.cu compiled against the CUDA runtime double,
// run as `--check`: the deduplicated step is byte-identical to the host
// paths (cuda-cpu harness).
#include "../../benchmarks/bench_cuda_dedup.cu"
