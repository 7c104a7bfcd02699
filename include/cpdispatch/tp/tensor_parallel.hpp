#pragma once
// Tensor parallelism: everything but the CBLAS backend,
// which needs cpdispatch::blas (include cpdispatch/gemm/gemm_cblas.hpp).
//
//   gemm/gemm.hpp       GemmBackend concept, ReferenceGemm (host loops)
//   tp/collectives.hpp  all_reduce_sum, broadcast_tensor, synchronize_across_ranks, TP_DEBUG
//   tp/config.hpp       init_tensor_parallel, get_tensor_parallel_config
//   tp/linear.hpp       RowParallelLinear (out_features split), ColumnParallelLinear (in_features split)
//   tp/model.hpp        Sequential (unsharded reference), DistributedModelWrapper, mse_loss
//   tp/single_rank.hpp  SingleRankTransport (world size 1, no dependency)

#include "cpdispatch/tp/collectives.hpp"
#include "cpdispatch/tp/config.hpp"
#include "cpdispatch/gemm/gemm.hpp"
#include "cpdispatch/tp/linear.hpp"
#include "cpdispatch/tp/model.hpp"
#include "cpdispatch/tp/single_rank.hpp"
