#pragma once
// RAII over cuDNN backend descriptors, a GraphSpec turned into a finalized
// operation graph and execution plan, and one execution through a variant
// pack. Every cuDNN call goes through the Api table (cudnn/detail/api.hpp).

#include <cudnn_graph.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cpdispatch/cudnn/detail/api.hpp"
#include "cpdispatch/cudnn/detail/graph.hpp"

namespace cpdispatch::cudnn::detail {

/// One backend descriptor, destroyed with its owner. Set attributes, then
/// finalize; every failure throws cudnn_error naming the attribute.
class Descriptor {
 public:
  Descriptor() = default;
  Descriptor(const Api& api, cudnnBackendDescriptorType_t type) : api_(&api) {
    check(api, api.create_descriptor(type, &desc_), "cudnnBackendCreateDescriptor",
          cpdispatch::detail::concat("descriptor type ", static_cast<int>(type)));
  }
  Descriptor(Descriptor&& o) noexcept : api_(o.api_), desc_(std::exchange(o.desc_, nullptr)) {}
  Descriptor& operator=(Descriptor&& o) noexcept {
    if (this != &o) {
      reset();
      api_ = o.api_;
      desc_ = std::exchange(o.desc_, nullptr);
    }
    return *this;
  }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  ~Descriptor() { reset(); }

  cudnnBackendDescriptor_t get() const noexcept { return desc_; }

  Descriptor& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, std::int64_t count,
                  const void* values) {
    check(*api_, api_->set_attribute(desc_, name, type, count, values), "cudnnBackendSetAttribute",
          cpdispatch::detail::concat("attribute ", static_cast<int>(name)));
    return *this;
  }
  Descriptor& set_int64(cudnnBackendAttributeName_t name, std::int64_t v) { return set(name, CUDNN_TYPE_INT64, 1, &v); }
  Descriptor& set_int64s(cudnnBackendAttributeName_t name, std::span<const std::int64_t> v) {
    return set(name, CUDNN_TYPE_INT64, static_cast<std::int64_t>(v.size()), v.data());
  }
  Descriptor& set_bool(cudnnBackendAttributeName_t name, bool b) { return set(name, CUDNN_TYPE_BOOLEAN, 1, &b); }
  Descriptor& set_type(cudnnBackendAttributeName_t name, cudnnDataType_t t) { return set(name, CUDNN_TYPE_DATA_TYPE, 1, &t); }
  Descriptor& set_desc(cudnnBackendAttributeName_t name, const Descriptor& d) {
    cudnnBackendDescriptor_t raw = d.get();
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &raw);
  }
  Descriptor& finalize(const char* what) {
    check(*api_, api_->finalize(desc_), "cudnnBackendFinalize", what);
    return *this;
  }

 private:
  void reset() noexcept {
    if (desc_) (void)api_->destroy_descriptor(desc_);
    desc_ = nullptr;
  }
  const Api* api_ = nullptr;
  cudnnBackendDescriptor_t desc_ = nullptr;
};

/// A finalized execution plan and everything it was built from.
struct ExecutionPlan {
  GraphSpec spec;
  std::vector<Descriptor> tensors, parts, ops;  // parts: the pointwise / matmul / reduction descriptors
  std::vector<Descriptor> configs;  // before the plan: destroyed after the plan that refers to one
  Descriptor graph, plan;
  std::int64_t workspace = 0;                    ///< bytes cuDNN needs besides our own workspace tensors
  std::vector<std::int64_t> uids;                ///< the variant pack's tensors (non-virtual), in spec order
};

inline Descriptor make_tensor(const Api& api, const TensorSpec& t, const std::vector<Descriptor>& made,
                              const GraphSpec& spec) {
  Descriptor d(api, CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  d.set_type(CUDNN_ATTR_TENSOR_DATA_TYPE, t.type);
  d.set_int64s(CUDNN_ATTR_TENSOR_DIMENSIONS, t.dims);
  d.set_int64s(CUDNN_ATTR_TENSOR_STRIDES, t.strides);
  d.set_int64(CUDNN_ATTR_TENSOR_UNIQUE_ID, t.uid);
  d.set_int64(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, 16);
  d.set_bool(CUDNN_ATTR_TENSOR_IS_VIRTUAL, t.is_virtual);
  d.set_bool(CUDNN_ATTR_TENSOR_IS_BY_VALUE, t.by_value);
  if (t.ragged != 0) {
    for (std::size_t i = 0; i < made.size(); ++i) {
      if (spec.tensors[i].uid == t.ragged) {
        d.set_desc(CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, made[i]);
        break;
      }
    }
  }
  d.finalize(t.name);
  return d;
}

/// Descriptors of the graph's tensors and operations, the operation graph,
/// and the first engine configuration heuristics mode A (then the fallback
/// list) offers that finalizes into an execution plan.
inline std::unique_ptr<ExecutionPlan> build_plan(const Api& api, cudnnHandle_t handle, GraphSpec spec) {
  auto p = std::make_unique<ExecutionPlan>();
  p->spec = std::move(spec);
  const GraphSpec& g = p->spec;
  p->tensors.reserve(g.tensors.size());
  for (const TensorSpec& t : g.tensors) {
    p->tensors.push_back(make_tensor(api, t, p->tensors, g));
    if (!t.is_virtual) p->uids.push_back(t.uid);
  }
  auto tensor = [&](std::int64_t id) -> const Descriptor& {
    for (std::size_t i = 0; i < g.tensors.size(); ++i) {
      if (g.tensors[i].uid == id) return p->tensors[i];
    }
    cpdispatch::detail::fail("cuDNN attention graph: no tensor ", id);
  };
  for (const OpSpec& op : g.ops) {
    switch (op.kind) {
      case OpKind::pointwise: {
        Descriptor pw(api, CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
        pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &op.mode);
        pw.set_type(CUDNN_ATTR_POINTWISE_MATH_PREC, op.compute);
        if (op.axis >= 0) pw.set_int64(CUDNN_ATTR_POINTWISE_AXIS, op.axis);
        pw.finalize(op.name);
        Descriptor d(api, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
        d.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw);
        d.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, tensor(op.in[0]));
        d.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, tensor(op.out));
        const float one = 1.0f;
        d.set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one);
        d.set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
        if (op.in[1] != 0) d.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, tensor(op.in[1]));
        if (op.in[2] != 0) d.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, tensor(op.in[2]));
        d.finalize(op.name);
        p->parts.push_back(std::move(pw));
        p->ops.push_back(std::move(d));
        break;
      }
      case OpKind::matmul: {
        Descriptor mm(api, CUDNN_BACKEND_MATMUL_DESCRIPTOR);
        mm.set_type(CUDNN_ATTR_MATMUL_COMP_TYPE, op.compute);
        if (op.has_padding) {
          const double zero = 0.0;
          mm.set(CUDNN_ATTR_MATMUL_PADDING_VALUE, CUDNN_TYPE_DOUBLE, 1, &zero);
        }
        mm.finalize(op.name);
        Descriptor d(api, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
        d.set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, tensor(op.in[0]));
        d.set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, tensor(op.in[1]));
        d.set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, tensor(op.out));
        if (op.m_override) d.set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, tensor(op.m_override));
        if (op.n_override) d.set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, tensor(op.n_override));
        if (op.k_override) d.set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, tensor(op.k_override));
        d.set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, mm);
        d.finalize(op.name);
        p->parts.push_back(std::move(mm));
        p->ops.push_back(std::move(d));
        break;
      }
      case OpKind::reduction: {
        Descriptor r(api, CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
        r.set_type(CUDNN_ATTR_REDUCTION_COMP_TYPE, op.compute);
        r.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &op.reduce);
        r.finalize(op.name);
        Descriptor d(api, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
        d.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, r);
        d.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, tensor(op.in[0]));
        d.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, tensor(op.out));
        d.finalize(op.name);
        p->parts.push_back(std::move(r));
        p->ops.push_back(std::move(d));
        break;
      }
      case OpKind::reshape: {
        Descriptor d(api, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
        d.set_desc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, tensor(op.in[0]));
        d.set_desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, tensor(op.out));
        d.finalize(op.name);
        p->ops.push_back(std::move(d));
        break;
      }
    }
  }
  std::vector<cudnnBackendDescriptor_t> raw;
  for (const Descriptor& d : p->ops) raw.push_back(d.get());
  p->graph = Descriptor(api, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  p->graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<std::int64_t>(raw.size()),
               raw.data());
  p->graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
  p->graph.finalize("operation graph");

  std::string refusals;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    Descriptor heur(api, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    heur.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, p->graph);
    heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    if (const cudnnStatus_t st = api.finalize(heur.get()); st != CUDNN_STATUS_SUCCESS) {
      // keep what the engines said so far: it is the message that explains a refusal
      refusals += cpdispatch::detail::concat(" [", mode == CUDNN_HEUR_MODE_A ? "A" : "fallback", " heuristics: ",
                                             api.error_string ? api.error_string(st) : "?", "]");
      continue;
    }
    std::int64_t count = 0;
    check(api, api.get_attribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
          "cudnnBackendGetAttribute", "engine count");
    p->configs.clear();
    std::vector<cudnnBackendDescriptor_t> cfgs;
    for (std::int64_t i = 0; i < count; ++i) {
      p->configs.emplace_back(api, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
      cfgs.push_back(p->configs.back().get());
    }
    std::int64_t got = 0;
    if (count > 0) {
      check(api, api.get_attribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got,
                                   cfgs.data()),
            "cudnnBackendGetAttribute", "engine configurations");
    }
    for (std::int64_t i = 0; i < got; ++i) {
      Descriptor plan(api, CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      plan.set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
      plan.set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, p->configs[static_cast<std::size_t>(i)]);
      const cudnnStatus_t st = api.finalize(plan.get());
      if (st != CUDNN_STATUS_SUCCESS) {
        char last[256] = {0};
        if (api.last_error) api.last_error(last, sizeof last);
        if (refusals.size() < 2000) {
          refusals += cpdispatch::detail::concat(" [", mode == CUDNN_HEUR_MODE_A ? "A" : "fallback", " #", i, ": ",
                                                 api.error_string ? api.error_string(st) : "?", last[0] ? ", " : "", last, "]");
        }
        continue;
      }
      std::int64_t one = 0;
      check(api, api.get_attribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &one,
                                   &p->workspace),
            "cudnnBackendGetAttribute", "workspace size");
      p->plan = std::move(plan);
      return p;
    }
  }
  throw cudnn_error(cpdispatch::detail::concat("cuDNN offers no engine for this attention graph (", g.ops.size(),
                                               " operations); engines tried:", refusals.empty() ? " none" : refusals),
                    static_cast<int>(CUDNN_STATUS_NOT_SUPPORTED));
}

/// One execution: the plan's non-virtual tensors bound to `pointers` (same
/// order as plan.uids) and the workspace.
inline void execute(const Api& api, cudnnHandle_t handle, const ExecutionPlan& plan, std::span<void* const> pointers,
                    void* workspace) {
  if (pointers.size() != plan.uids.size()) {
    cpdispatch::detail::fail("cuDNN execute: ", pointers.size(), " pointers for ", plan.uids.size(), " tensors");
  }
  Descriptor pack(api, CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<std::int64_t>(plan.uids.size()),
           plan.uids.data());
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<std::int64_t>(pointers.size()),
           pointers.data());
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  pack.finalize("variant pack");
  check(api, api.execute(handle, plan.plan.get(), pack.get()), "cudnnBackendExecute");
}

}  // namespace cpdispatch::cudnn::detail
