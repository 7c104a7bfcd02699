#pragma once
// The core of cpdispatch, everything the target cpdispatch::cpdispatch compiles
// alone (the standard library only): the vocabulary, planning
// (plan/: both plan forms, masks, per-rank planning, balancing, deduplicated
// and node-level KV wire planning, topology, memory limits, the step-time
// model, coverage verification), host execution (execute/: the Dispatcher,
// KvWireDispatcher, NodeWireDispatcher, QkvDispatch and gather_plan, the
// combine, token indices, checksums, the reference simulation) and the
// transport concepts.
//
// Not included, because each needs another target or compiler: the
// transports (cpdispatch/transports/sim.hpp, mpi.hpp, nccl.hpp), JSON
// (io/json.hpp, io/balance_json.hpp), the CBLAS GEMM backend
// (gemm/gemm_cblas.hpp), the CUDA data path (cuda/), the test doubles
// (testing/), and the layers on top, which have umbrellas of their own
// (attention.hpp, tp/tensor_parallel.hpp, overlap/overlap.hpp).

#include "cpdispatch/bytes.hpp"
#include "cpdispatch/crc32c.hpp"
#include "cpdispatch/element_type.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/adapters/checksummed.hpp"
#include "cpdispatch/execute/combine.hpp"
#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/execute/gather_plan.hpp"
#include "cpdispatch/execute/node_wire.hpp"
#include "cpdispatch/execute/qkv_dispatch.hpp"
#include "cpdispatch/execute/simulate.hpp"
#include "cpdispatch/execute/token_indices.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/plan/any_plan.hpp"
#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/check/coverage.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/limits.hpp"
#include "cpdispatch/plan/mask.hpp"
#include "cpdispatch/plan/metadata.hpp"
#include "cpdispatch/plan/node_wire.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "cpdispatch/model/step_model.hpp"
#include "cpdispatch/io/svg.hpp"
#include "cpdispatch/plan/topology.hpp"
#include "cpdispatch/balance/topology_balance.hpp"
#include "cpdispatch/workload/workload.hpp"
#include "cpdispatch/tensor.hpp"
#include "cpdispatch/transport.hpp"
#include "cpdispatch/version.hpp"
