#pragma once
// Tensor parallelism: everything but the CBLAS backend,
// which needs cpdispatch::blas (include cpdispatch/gemm/gemm_cblas.hpp).
//
//   gemm/gemm.hpp       gemm::GemmBackend concept, gemm::ReferenceGemm (host loops)
//   tp/collectives.hpp  all_reduce_sum, broadcast_tensor, synchronize_across_ranks, TP_DEBUG
//   tp/config.hpp       init_tensor_parallel, get_tensor_parallel_config
//   tp/linear.hpp       RowParallelLinear (out_features split), ColumnParallelLinear (in_features split)
//   tp/model.hpp        Sequential (unsharded reference), DistributedModelWrapper, mse_loss
//
// The world-size-1 transport that makes a layer behave as the unsharded model,
// SingleRankTransport, is a transport: cpdispatch/transports/single_rank.hpp (cpdispatch::sim).

#include "cpdispatch/tp/collectives.hpp"
#include "cpdispatch/tp/config.hpp"
#include "cpdispatch/gemm/gemm.hpp"
#include "cpdispatch/tp/linear.hpp"
#include "cpdispatch/tp/model.hpp"
