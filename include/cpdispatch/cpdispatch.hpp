#pragma once
// The core of cpdispatch: planning (given and load-balanced), metadata,
// generators and the memcpy simulation. Standard library and Boost headers
// only; transports, JSON and the tensor-parallel layers have their own headers.

#include "cpdispatch/balance.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/generate.hpp"
#include "cpdispatch/metadata.hpp"
#include "cpdispatch/plan.hpp"
#include "cpdispatch/simulate.hpp"
#include "cpdispatch/svg.hpp"
#include "cpdispatch/tensor.hpp"
#include "cpdispatch/version.hpp"
#include "cpdispatch/workload.hpp"
