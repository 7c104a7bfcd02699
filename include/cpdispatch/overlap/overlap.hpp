#pragma once
// Communication-GEMM overlap. Host memory; the GEMM
// backends are those of tp/gemm.hpp (CBLAS: include cpdispatch/gemm/gemm_cblas.hpp).
//
//   overlap/comm_overlap.hpp    CommOverlapType, CommOverlapMethod, ScalingMode, CommOverlapBuffer,
//                               CommOverlapRegistry and the id-based create / destroy / destroy_all
//   overlap/comm_gemm.hpp       comm_gemm: the overlapped GEMM over any Transport and GEMM backend
//   overlap/simulated_link.hpp  SimulatedLinkTransport: latency + bytes / bandwidth per message, sleeping

#include "cpdispatch/overlap/comm_gemm.hpp"
#include "cpdispatch/overlap/comm_overlap.hpp"
#include "cpdispatch/overlap/simulated_link.hpp"
