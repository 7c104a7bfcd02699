// benchmarks/bench_cuda_checksum.cu compiled against the CUDA runtime double,
// run as `--check`: the checked exchange delivers the plain one's bytes and
// check() counts every segment (cuda-cpu harness). Also the program that
// valgrind counts instructions of (`--count`, benchmarks/RESULTS.md).
#include "../../benchmarks/bench_cuda_checksum.cu"
