#pragma once
// Communication-GEMM overlap. Host memory; the GEMM
// backends are those of gemm/gemm.hpp (CBLAS: include cpdispatch/gemm/gemm_cblas.hpp).
//
//   overlap/comm_overlap.hpp    CommOverlapType, CommOverlapMethod, ScalingMode, CommOverlapBuffer,
//                               CommOverlapRegistry and the id-based create / destroy / destroy_all
//   overlap/comm_gemm.hpp       comm_gemm: the overlapped GEMM over any Transport and GEMM backend
//
// The simulated slow network the benchmarks run it over, SimulatedLinkTransport,
// is a transport: cpdispatch/adapters/simulated_link.hpp (cpdispatch::sim).

#include "cpdispatch/overlap/comm_gemm.hpp"
#include "cpdispatch/overlap/comm_overlap.hpp"
