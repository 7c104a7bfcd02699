#pragma once
// The core of cpdispatch: planning (given and load-balanced), metadata,
// generators and the memcpy simulation. Standard library and Boost headers
// only; transports, JSON and the tensor-parallel layers have their own headers.

#include "cpdispatch/plan/balance.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/plan/generate.hpp"
#include "cpdispatch/plan/metadata.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/execute/simulate.hpp"
#include "cpdispatch/plan/svg.hpp"
#include "cpdispatch/tensor.hpp"
#include "cpdispatch/version.hpp"
#include "cpdispatch/plan/workload.hpp"
