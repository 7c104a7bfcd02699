#pragma once
// The core of cpdispatch: planning, metadata, generators and the memcpy
// simulation. Standard library and Boost headers only.

#include "cpdispatch/error.hpp"
#include "cpdispatch/float16.hpp"
#include "cpdispatch/generate.hpp"
#include "cpdispatch/metadata.hpp"
#include "cpdispatch/plan.hpp"
#include "cpdispatch/simulate.hpp"
#include "cpdispatch/tensor.hpp"
#include "cpdispatch/version.hpp"
