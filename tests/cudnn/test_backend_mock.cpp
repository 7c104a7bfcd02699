// The cuDNN and CUDA calls of CudnnAttentionKernel through a GoogleMock table
// (no GPU): the backend descriptors built for each graph (read back from the
// attributes set, compared with the GraphSpec), descriptor lifetimes, engine
// selection, and whole forward / backward calls whose "device" memory is host
// memory and whose cudnnBackendExecute is a fake that writes marker values
// where cuDNN would (statistics in the declared layout, outputs per sequence).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <vector>

#include "cpdispatch/cudnn/attention.hpp"

namespace {

using namespace cpdispatch;
using namespace cpdispatch::cudnn;
using namespace cpdispatch::cudnn::detail;
using cpdispatch::cudnn::Band;  // the execution's kind of mask, not cpdispatch::Band (an entry's bounds)
using ::testing::_;
using ::testing::AtLeast;
using ::testing::NiceMock;

struct Attr {
  cudnnBackendAttributeType_t type{};
  std::int64_t count = 0;
  std::vector<unsigned char> bytes;
  template <class T>
  std::vector<T> as() const {
    std::vector<T> out(bytes.size() / sizeof(T));
    std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
    return out;
  }
  template <class T>
  T one() const {
    EXPECT_EQ(bytes.size(), sizeof(T));
    T value{};
    if (bytes.size() == sizeof(T)) std::memcpy(&value, bytes.data(), sizeof(T));
    return value;
  }
};

struct FakeDescriptor {
  cudnnBackendDescriptorType_t type{};
  std::map<int, Attr> attrs;
  bool finalized = false, destroyed = false;
  const Attr& at(cudnnBackendAttributeName_t n) const {
    static const Attr none;
    const auto it = attrs.find(n);
    return it == attrs.end() ? none : it->second;
  }
  bool has(cudnnBackendAttributeName_t n) const { return attrs.count(n) != 0; }
};

std::size_t element_size(cudnnBackendAttributeType_t t) {
  switch (t) {
    case CUDNN_TYPE_INT64: return 8;
    case CUDNN_TYPE_DOUBLE: return 8;
    case CUDNN_TYPE_FLOAT: return 4;
    case CUDNN_TYPE_BOOLEAN: return sizeof(bool);
    case CUDNN_TYPE_VOID_PTR: return sizeof(void*);
    case CUDNN_TYPE_BACKEND_DESCRIPTOR: return sizeof(void*);
    case CUDNN_TYPE_HANDLE: return sizeof(cudnnHandle_t);
    default: return 4;  // enums
  }
}

/// The recording fake behind the mocks.
class Fake {
 public:
  std::deque<FakeDescriptor> descs;
  int engines = 2, failing_engines = 1;  // heuristics return `engines`; the first `failing_engines` do not finalize
  std::int64_t workspace = 1000;
  int executions = 0;
  std::function<void(const FakeDescriptor& pack)> on_execute;

  FakeDescriptor& of(cudnnBackendDescriptor_t d) { return *static_cast<FakeDescriptor*>(d); }

  cudnnStatus_t create(cudnnBackendDescriptorType_t t, cudnnBackendDescriptor_t* d) {
    descs.push_back({});
    descs.back().type = t;
    *d = &descs.back();
    return CUDNN_STATUS_SUCCESS;
  }
  cudnnStatus_t destroy(cudnnBackendDescriptor_t d) {
    EXPECT_FALSE(of(d).destroyed) << "descriptor destroyed twice";
    of(d).destroyed = true;
    return CUDNN_STATUS_SUCCESS;
  }
  cudnnStatus_t set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t n, cudnnBackendAttributeType_t t,
                    std::int64_t count, const void* values) {
    EXPECT_FALSE(of(d).finalized) << "attribute " << n << " set after finalize";
    Attr a;
    a.type = t;
    a.count = count;
    a.bytes.resize(static_cast<std::size_t>(count) * element_size(t));
    if (count) std::memcpy(a.bytes.data(), values, a.bytes.size());
    of(d).attrs[n] = a;
    return CUDNN_STATUS_SUCCESS;
  }
  cudnnStatus_t get(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t n, cudnnBackendAttributeType_t,
                    std::int64_t requested, std::int64_t* count, void* values) {
    if (n == CUDNN_ATTR_ENGINEHEUR_RESULTS) {
      *count = requested == 0 ? engines : std::min<std::int64_t>(requested, engines);
      if (requested) {
        auto** out = static_cast<cudnnBackendDescriptor_t*>(values);
        for (std::int64_t i = 0; i < *count; ++i) of(out[i]).attrs[9999].count = i;  // engine index
      }
      return CUDNN_STATUS_SUCCESS;
    }
    if (n == CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE) {
      EXPECT_TRUE(of(d).finalized);
      *count = 1;
      *static_cast<std::int64_t*>(values) = workspace;
      return CUDNN_STATUS_SUCCESS;
    }
    return CUDNN_STATUS_NOT_SUPPORTED;
  }
  cudnnStatus_t finalize(cudnnBackendDescriptor_t d) {
    FakeDescriptor& f = of(d);
    if (f.type == CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR) {
      auto* cfg = static_cast<FakeDescriptor*>(f.at(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG).as<void*>().at(0));
      if (cfg->attrs[9999].count < failing_engines) return CUDNN_STATUS_NOT_SUPPORTED;
      EXPECT_TRUE(f.has(CUDNN_ATTR_EXECUTION_PLAN_HANDLE));
    }
    f.finalized = true;
    return CUDNN_STATUS_SUCCESS;
  }
  cudnnStatus_t execute(cudnnHandle_t, cudnnBackendDescriptor_t plan, cudnnBackendDescriptor_t pack) {
    EXPECT_TRUE(of(plan).finalized);
    EXPECT_TRUE(of(pack).finalized);
    ++executions;
    if (on_execute) on_execute(of(pack));
    return CUDNN_STATUS_SUCCESS;
  }
  /// The live tensor descriptor with this uid (the latest one).
  const FakeDescriptor* tensor(std::int64_t id) const {
    for (auto it = descs.rbegin(); it != descs.rend(); ++it) {
      if (it->type == CUDNN_BACKEND_TENSOR_DESCRIPTOR && !it->destroyed &&
          it->at(CUDNN_ATTR_TENSOR_UNIQUE_ID).as<std::int64_t>() == std::vector<std::int64_t>{id}) {
        return &*it;
      }
    }
    return nullptr;
  }
  int live() const {
    int n = 0;
    for (const auto& d : descs) n += !d.destroyed;
    return n;
  }
  int created(cudnnBackendDescriptorType_t t) const {
    int n = 0;
    for (const auto& d : descs) n += d.type == t;
    return n;
  }
};

class MockApi {
 public:
  MOCK_METHOD(cudnnStatus_t, Create, (cudnnHandle_t*));
  MOCK_METHOD(cudnnStatus_t, SetStream, (cudnnHandle_t, cudaStream_t));
  MOCK_METHOD(cudnnStatus_t, CreateDescriptor, (cudnnBackendDescriptorType_t, cudnnBackendDescriptor_t*));
  MOCK_METHOD(cudnnStatus_t, DestroyDescriptor, (cudnnBackendDescriptor_t));
  MOCK_METHOD(cudnnStatus_t, SetAttribute,
              (cudnnBackendDescriptor_t, cudnnBackendAttributeName_t, cudnnBackendAttributeType_t, std::int64_t, const void*));
  MOCK_METHOD(cudnnStatus_t, GetAttribute,
              (cudnnBackendDescriptor_t, cudnnBackendAttributeName_t, cudnnBackendAttributeType_t, std::int64_t,
               std::int64_t*, void*));
  MOCK_METHOD(cudnnStatus_t, Finalize, (cudnnBackendDescriptor_t));
  MOCK_METHOD(cudnnStatus_t, Execute, (cudnnHandle_t, cudnnBackendDescriptor_t, cudnnBackendDescriptor_t));

  explicit MockApi(Fake& fake) {
    ON_CALL(*this, Create(_)).WillByDefault([](cudnnHandle_t* h) {
      *h = reinterpret_cast<cudnnHandle_t>(0x1234);
      return CUDNN_STATUS_SUCCESS;
    });
    ON_CALL(*this, SetStream(_, _)).WillByDefault([](cudnnHandle_t, cudaStream_t) { return CUDNN_STATUS_SUCCESS; });
    ON_CALL(*this, CreateDescriptor(_, _)).WillByDefault([&fake](auto t, auto d) { return fake.create(t, d); });
    ON_CALL(*this, DestroyDescriptor(_)).WillByDefault([&fake](auto d) { return fake.destroy(d); });
    ON_CALL(*this, SetAttribute(_, _, _, _, _)).WillByDefault([&fake](auto d, auto n, auto t, auto c, auto v) {
      return fake.set(d, n, t, c, v);
    });
    ON_CALL(*this, GetAttribute(_, _, _, _, _, _)).WillByDefault([&fake](auto d, auto n, auto t, auto r, auto c, auto v) {
      return fake.get(d, n, t, r, c, v);
    });
    ON_CALL(*this, Finalize(_)).WillByDefault([&fake](auto d) { return fake.finalize(d); });
    ON_CALL(*this, Execute(_, _, _)).WillByDefault([&fake](auto h, auto p, auto v) { return fake.execute(h, p, v); });
  }
};

MockApi* current = nullptr;

// "Device" memory is host memory; copies and fills run at once.
Api mock_table() {
  Api api{};
  api.get_version = [] { return std::size_t{91900}; };
  api.create = [](cudnnHandle_t* h) { return current->Create(h); };
  api.destroy = [](cudnnHandle_t) { return CUDNN_STATUS_SUCCESS; };
  api.set_stream = [](cudnnHandle_t h, cudaStream_t s) { return current->SetStream(h, s); };
  api.create_descriptor = [](cudnnBackendDescriptorType_t t, cudnnBackendDescriptor_t* d) {
    return current->CreateDescriptor(t, d);
  };
  api.destroy_descriptor = [](cudnnBackendDescriptor_t d) { return current->DestroyDescriptor(d); };
  api.set_attribute = [](cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t n, cudnnBackendAttributeType_t t,
                         std::int64_t c, const void* v) { return current->SetAttribute(d, n, t, c, v); };
  api.get_attribute = [](cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t n, cudnnBackendAttributeType_t t,
                         std::int64_t r, std::int64_t* c, void* v) { return current->GetAttribute(d, n, t, r, c, v); };
  api.finalize = [](cudnnBackendDescriptor_t d) { return current->Finalize(d); };
  api.execute = [](cudnnHandle_t h, cudnnBackendDescriptor_t p, cudnnBackendDescriptor_t v) {
    return current->Execute(h, p, v);
  };
  api.error_string = [](cudnnStatus_t) { return "CUDNN_STATUS_FAKE"; };
  api.last_error = [](char* m, std::size_t n) { std::snprintf(m, n, "fake detail"); };
  api.get_device = [](int* d) {
    *d = 0;
    return cudaSuccess;
  };
  api.malloc_async = [](void** p, std::size_t n, cudaStream_t) {
    *p = std::calloc(n, 1);
    return cudaSuccess;
  };
  api.free_async = [](void* p, cudaStream_t) {
    std::free(p);
    return cudaSuccess;
  };
  api.memcpy_async = [](void* d, const void* s, std::size_t n, cudaMemcpyKind, cudaStream_t) {
    std::memcpy(d, s, n);
    return cudaSuccess;
  };
  api.memcpy2d_async = [](void* d, std::size_t dp, const void* s, std::size_t sp, std::size_t w, std::size_t h,
                          cudaMemcpyKind, cudaStream_t) {
    EXPECT_LE(w, dp);
    EXPECT_LE(w, sp);
    for (std::size_t r = 0; r < h; ++r) std::memcpy(static_cast<char*>(d) + r * dp, static_cast<const char*>(s) + r * sp, w);
    return cudaSuccess;
  };
  api.memset_async = [](void* d, int v, std::size_t n, cudaStream_t) {
    std::memset(d, v, n);
    return cudaSuccess;
  };
  api.host_alloc = [](void** p, std::size_t n, unsigned) {
    *p = std::malloc(n);
    return cudaSuccess;
  };
  api.free_host = [](void* p) {
    std::free(p);
    return cudaSuccess;
  };
  api.event_create = [](cudaEvent_t* e, unsigned) {
    *e = reinterpret_cast<cudaEvent_t>(new int(0));
    return cudaSuccess;
  };
  api.event_record = [](cudaEvent_t, cudaStream_t) { return cudaSuccess; };
  api.event_query = [](cudaEvent_t) { return cudaSuccess; };
  api.event_destroy = [](cudaEvent_t e) {
    delete reinterpret_cast<int*>(e);
    return cudaSuccess;
  };
  return api;
}

class CudnnMock : public ::testing::Test {
 protected:
  CudnnMock() : mock(fake), api(mock_table()) { current = &mock; }
  ~CudnnMock() override { current = nullptr; }
  Fake fake;
  NiceMock<MockApi> mock;
  Api api;
};

GraphKey key(Direction dir, Band band, std::int64_t hq, std::int64_t hk, bool deterministic = true) {
  GraphKey k;
  k.direction = dir;
  k.io_type = CUDNN_DATA_HALF;
  k.heads_q = hq;
  k.heads_kv = hk;
  k.head_dim = 64;
  k.band = band;
  k.deterministic = deterministic;
  k.batch = 2;
  k.max_q = 64;
  k.max_kv = 128;
  k.stats_pitch = 256;
  return k;
}

std::int64_t uid_of(const Fake& f, void* desc) {
  const auto& d = *static_cast<const FakeDescriptor*>(desc);
  EXPECT_EQ(d.type, CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  (void)f;
  return d.at(CUDNN_ATTR_TENSOR_UNIQUE_ID).as<std::int64_t>().at(0);
}
std::int64_t uid_at(const Fake& f, const FakeDescriptor& op, cudnnBackendAttributeName_t n) {
  if (!op.has(n)) return 0;
  return uid_of(f, op.at(n).as<void*>().at(0));
}

// Reads the graph back from the descriptors' attributes and compares it
// with the spec: every tensor (uid, type, dims, strides, virtual, by value,
// ragged offset) and every operation in the operation graph's order.
void check_descriptors_match(const Fake& f, const ExecutionPlan& plan) {
  const GraphSpec& g = plan.spec;
  for (const TensorSpec& t : g.tensors) {
    SCOPED_TRACE(t.name);
    const FakeDescriptor* d = f.tensor(t.uid);
    ASSERT_NE(d, nullptr);
    EXPECT_TRUE(d->finalized);
    EXPECT_EQ(d->at(CUDNN_ATTR_TENSOR_DATA_TYPE).one<cudnnDataType_t>(), t.type);
    EXPECT_EQ(d->at(CUDNN_ATTR_TENSOR_DIMENSIONS).as<std::int64_t>(), std::vector<std::int64_t>(t.dims.begin(), t.dims.end()));
    EXPECT_EQ(d->at(CUDNN_ATTR_TENSOR_STRIDES).as<std::int64_t>(), std::vector<std::int64_t>(t.strides.begin(), t.strides.end()));
    EXPECT_EQ(d->at(CUDNN_ATTR_TENSOR_IS_VIRTUAL).one<bool>(), t.is_virtual);
    EXPECT_EQ(d->at(CUDNN_ATTR_TENSOR_IS_BY_VALUE).one<bool>(), t.by_value);
    EXPECT_EQ(d->at(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT).one<std::int64_t>(), 16);
    EXPECT_EQ(uid_at(f, *d, CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC), t.ragged);
  }
  const auto& graph = *static_cast<const FakeDescriptor*>(plan.graph.get());
  EXPECT_EQ(graph.type, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  EXPECT_TRUE(graph.has(CUDNN_ATTR_OPERATIONGRAPH_HANDLE));
  const auto ops = graph.at(CUDNN_ATTR_OPERATIONGRAPH_OPS).as<void*>();
  ASSERT_EQ(ops.size(), g.ops.size());
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const OpSpec& s = g.ops[i];
    SCOPED_TRACE(s.name);
    const auto& op = *static_cast<const FakeDescriptor*>(ops[i]);
    EXPECT_TRUE(op.finalized);
    switch (s.kind) {
      case OpKind::pointwise: {
        ASSERT_EQ(op.type, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
        const auto& pw = *static_cast<const FakeDescriptor*>(op.at(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR).as<void*>().at(0));
        EXPECT_EQ(pw.at(CUDNN_ATTR_POINTWISE_MODE).one<cudnnPointwiseMode_t>(), s.mode);
        EXPECT_EQ(pw.at(CUDNN_ATTR_POINTWISE_MATH_PREC).one<cudnnDataType_t>(), s.compute);
        if (s.axis >= 0) {
          EXPECT_EQ(pw.at(CUDNN_ATTR_POINTWISE_AXIS).one<std::int64_t>(), s.axis);
        } else {
          EXPECT_FALSE(pw.has(CUDNN_ATTR_POINTWISE_AXIS));
        }
        EXPECT_EQ(uid_at(f, op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC), s.in[0]);
        EXPECT_EQ(uid_at(f, op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC), s.in[1]);
        EXPECT_EQ(uid_at(f, op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC), s.in[2]);
        EXPECT_EQ(uid_at(f, op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC), s.out);
        EXPECT_EQ(op.at(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1).one<float>(), 1.0f);
        break;
      }
      case OpKind::matmul: {
        ASSERT_EQ(op.type, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
        const auto& mm = *static_cast<const FakeDescriptor*>(op.at(CUDNN_ATTR_OPERATION_MATMUL_DESC).as<void*>().at(0));
        EXPECT_EQ(mm.at(CUDNN_ATTR_MATMUL_COMP_TYPE).one<cudnnDataType_t>(), CUDNN_DATA_FLOAT);
        EXPECT_EQ(mm.has(CUDNN_ATTR_MATMUL_PADDING_VALUE), s.has_padding);
        EXPECT_EQ(uid_at(f, op, CUDNN_ATTR_OPERATION_MATMUL_ADESC), s.in[0]);
        EXPECT_EQ(uid_at(f, op, CUDNN_ATTR_OPERATION_MATMUL_BDESC), s.in[1]);
        EXPECT_EQ(uid_at(f, op, CUDNN_ATTR_OPERATION_MATMUL_CDESC), s.out);
        EXPECT_EQ(uid_at(f, op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC), s.m_override);
        EXPECT_EQ(uid_at(f, op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC), s.n_override);
        EXPECT_EQ(uid_at(f, op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC), s.k_override);
        break;
      }
      case OpKind::reduction: {
        ASSERT_EQ(op.type, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
        const auto& r = *static_cast<const FakeDescriptor*>(op.at(CUDNN_ATTR_OPERATION_REDUCTION_DESC).as<void*>().at(0));
        EXPECT_EQ(r.at(CUDNN_ATTR_REDUCTION_OPERATOR).one<cudnnReduceTensorOp_t>(), s.reduce);
        EXPECT_EQ(uid_at(f, op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC), s.in[0]);
        EXPECT_EQ(uid_at(f, op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC), s.out);
        break;
      }
      case OpKind::reshape:
        ASSERT_EQ(op.type, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
        EXPECT_EQ(uid_at(f, op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC), s.in[0]);
        EXPECT_EQ(uid_at(f, op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC), s.out);
        break;
    }
  }
}

TEST_F(CudnnMock, GraphsReachCudnnAsSpecifiedForEveryBandAndDirection) {
  const cudnnHandle_t handle = reinterpret_cast<cudnnHandle_t>(0x1234);
  const std::vector<GraphKey> keys{
      key(Direction::forward, Band::causal, 4, 4),       key(Direction::forward, Band::window, 4, 4),
      key(Direction::forward, Band::full, 4, 4),         key(Direction::forward, Band::causal, 8, 2),
      key(Direction::backward, Band::causal, 4, 4),      key(Direction::backward, Band::window, 8, 2),
      key(Direction::backward, Band::full, 8, 1, false), key(Direction::backward, Band::causal, 8, 2, false)};
  for (const GraphKey& k : keys) {
    SCOPED_TRACE(::testing::Message() << "direction " << int(k.direction) << " band " << int(k.band) << " heads "
                                      << k.heads_q << "/" << k.heads_kv << " deterministic " << k.deterministic);
    auto spec = k.direction == Direction::forward ? forward_graph(k) : backward_graph(k);
    const std::size_t ops = spec.ops.size();
    {
      auto plan = build_plan(api, handle, std::move(spec));
      ASSERT_EQ(plan->spec.ops.size(), ops);
      check_descriptors_match(fake, *plan);
      EXPECT_EQ(plan->workspace, 1000);
      // the second engine (the first refuses to finalize) is the plan's
      const auto& p = *static_cast<const FakeDescriptor*>(plan->plan.get());
      EXPECT_TRUE(p.finalized);
      const auto* cfg = static_cast<const FakeDescriptor*>(p.at(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG).as<void*>().at(0));
      EXPECT_EQ(cfg->attrs.at(9999).count, 1);
      std::vector<std::int64_t> uids;
      for (const TensorSpec& t : plan->spec.tensors) {
        if (!t.is_virtual) uids.push_back(t.uid);
      }
      EXPECT_EQ(plan->uids, uids);
    }
    EXPECT_EQ(fake.live(), 0) << "every descriptor is destroyed with its plan";
    fake.descs.clear();
  }
}

TEST_F(CudnnMock, NoEngineIsAClearError) {
  fake.failing_engines = 5;
  try {
    build_plan(api, reinterpret_cast<cudnnHandle_t>(1), forward_graph(key(Direction::forward, Band::causal, 4, 4)));
    FAIL() << "no exception";
  } catch (const cudnn_error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("cuDNN offers no engine for this attention graph"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("fake detail"));
  }
  EXPECT_EQ(fake.live(), 0);
}

TEST_F(CudnnMock, AFailingCallNamesTheAttributeAndCudnnsMessage) {
  EXPECT_CALL(mock, SetAttribute(_, _, _, _, _)).Times(::testing::AnyNumber());
  EXPECT_CALL(mock, SetAttribute(_, CUDNN_ATTR_TENSOR_STRIDES, _, _, _)).WillOnce([](auto...) {
    return CUDNN_STATUS_BAD_PARAM;
  });
  try {
    build_plan(api, reinterpret_cast<cudnnHandle_t>(1), forward_graph(key(Direction::forward, Band::full, 4, 4)));
    FAIL() << "no exception";
  } catch (const cudnn_error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("cudnnBackendSetAttribute failed: CUDNN_STATUS_FAKE (2000) [attribute 903]; fake detail"));
    EXPECT_EQ(e.code(), 2000);
  }
  EXPECT_EQ(fake.live(), 0);
}

// ---- whole calls -------------------------------------------------------------

/// The entry attending query rows [q0, +lq) to key rows [k0, +lk) under
/// `mask`, its query row 0 at document position `diagonal` counted from key
/// row 0: the mask's band moved into buffer rows.
AttentionEntry part(const AttentionMask& mask, std::int64_t q0, std::int64_t lq, std::int64_t k0, std::int64_t lk,
                    std::int64_t diagonal) {
  return {q0, lq, k0, lk, mask.band().shifted(diagonal + k0 - q0)};
}

std::vector<float16> halves(std::size_t n, float v) { return std::vector<float16>(n, float16(v)); }

struct Pack {
  std::map<std::int64_t, void*> ptr;
  void* workspace = nullptr;
};
Pack read_pack(const FakeDescriptor& pack) {
  Pack p;
  const auto uids = pack.at(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS).as<std::int64_t>();
  const auto ptrs = pack.at(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS).as<void*>();
  EXPECT_EQ(uids.size(), ptrs.size());
  for (std::size_t i = 0; i < uids.size(); ++i) p.ptr[uids[i]] = ptrs[i];
  p.workspace = pack.at(CUDNN_ATTR_VARIANT_PACK_WORKSPACE).as<void*>().at(0);
  return p;
}
std::vector<std::int32_t> ints(void* p, std::size_t n) {
  std::vector<std::int32_t> v(n);
  std::memcpy(v.data(), p, n * 4);
  return v;
}

TEST_F(CudnnMock, ForwardExecutesOneGraphPerBandAndFixesDeadRows) {
  const AttentionShape shape{4, 2, 8, 0.5f};
  const std::int64_t Hq = 4, Hk = 2, D = 8, T = 20, TK = 16;
  // causal: entry 0 whole KV group (causal, shift 0), entry 1 sees all its keys
  // (full), entry 2 sees nothing (dead), rows 18..19 outside every entry
  const AttentionMask causal = AttentionMask::causal();
  const std::vector<AttentionEntry> entries{part(causal, 0, 6, 0, 6, 0), part(causal, 6, 8, 6, 4, 20), part(causal, 14, 4, 10, 6, -8)};
  const auto q = halves(static_cast<std::size_t>(T * Hq * D), 1.0f), k = halves(static_cast<std::size_t>(TK * Hk * D), 1.0f);
  auto out = halves(static_cast<std::size_t>(T * Hq * D), 7.0f);
  std::vector<float> lse(static_cast<std::size_t>(Hq * T), 7.0f);
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(0x5678);
  EXPECT_CALL(mock, SetStream(_, stream)).Times(AtLeast(1));
  std::vector<std::vector<std::int32_t>> seq_q_seen, right_seen;
  fake.on_execute = [&](const FakeDescriptor& d) {
    const Pack p = read_pack(d);
    EXPECT_EQ(p.ptr.at(uid::q), q.data());
    EXPECT_EQ(p.ptr.at(uid::k), k.data());
    EXPECT_EQ(p.ptr.at(uid::o), out.data());
    EXPECT_EQ(*static_cast<float*>(p.ptr.at(uid::scale)), 0.5f);
    EXPECT_EQ(*static_cast<float*>(p.ptr.at(uid::neg_inf)), -INFINITY);
    const auto seq_q = ints(p.ptr.at(uid::seq_q), 1), off = ints(p.ptr.at(uid::ragged_stats), 2);
    const auto off_q = ints(p.ptr.at(uid::ragged_q), 1), off_kv = ints(p.ptr.at(uid::ragged_kv), 1);
    seq_q_seen.push_back(seq_q);
    EXPECT_EQ(off_q[0], off[0] * Hq * D);
    right_seen.push_back(p.ptr.count(uid::right_bound) ? std::vector<std::int32_t>{*static_cast<std::int32_t*>(p.ptr.at(uid::right_bound))}
                                                       : std::vector<std::int32_t>{});
    // what cuDNN writes: statistics at off + h * pitch + s (pitch 64), output rows
    const std::int64_t pitch = fake.tensor(uid::stats)->at(CUDNN_ATTR_TENSOR_STRIDES).as<std::int64_t>().at(1);
    EXPECT_EQ(pitch, 64);
    auto* stats = static_cast<float*>(p.ptr.at(uid::stats));
    for (std::int64_t h = 0; h < Hq; ++h) {
      for (std::int64_t s = 0; s < seq_q[0]; ++s) stats[off[0] + h * pitch + s] = static_cast<float>(100 * h + off[0] + s);
    }
    (void)off_kv;
  };
  cuda::CudnnAttentionKernel kernel(stream, {}, api);
  kernel.forward<float16>(shape, entries, q, k, k, out, lse);
  EXPECT_EQ(fake.executions, 2);
  EXPECT_EQ(kernel.plan_count(), 2u);
  EXPECT_EQ(seq_q_seen, (std::vector<std::vector<std::int32_t>>{{8}, {6}}));  // full band first, then causal
  EXPECT_EQ(right_seen, (std::vector<std::vector<std::int32_t>>{{}, {0}}));
  for (std::int64_t h = 0; h < Hq; ++h) {
    for (std::int64_t r = 0; r < T; ++r) {
      const float got = lse[static_cast<std::size_t>(h * T + r)];
      if (r < 14) {
        EXPECT_EQ(got, static_cast<float>(100 * h + r)) << h << " " << r;
      } else if (r < 18) {
        EXPECT_EQ(got, -INFINITY) << "dead row " << r;
      } else {
        EXPECT_EQ(got, 7.0f) << "row outside the entries " << r;
      }
    }
  }
  for (std::int64_t r = 14; r < T; ++r) {
    for (std::int64_t i = 0; i < Hq * D; ++i) {
      EXPECT_EQ(static_cast<float>(out[static_cast<std::size_t>(r * Hq * D + i)]), r < 18 ? 0.0f : 7.0f) << r;
    }
  }
  // the same shapes again: no new plan, no new heuristics
  const int heuristics = fake.created(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  kernel.forward<float16>(shape, entries, q, k, k, out, lse);
  EXPECT_EQ(kernel.plan_count(), 2u);
  EXPECT_EQ(fake.created(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR), heuristics);
  EXPECT_EQ(fake.executions, 4);
}

TEST_F(CudnnMock, BackwardHandsCudnnOurLseAndZeroesDeadGradients) {
  const AttentionShape shape{2, 2, 8, 0.25f};
  const std::int64_t Hq = 2, D = 8, T = 12, TK = 12;
  const AttentionMask mask = AttentionMask::sliding_window(3);
  // rows 0..5 against keys 0..5, diagonal 0: the window's left bound binds
  // (window band, shift 0); rows 6..11 against keys 6..11, diagonal -3: rows
  // 6..8 see nothing, keys 9..11 nobody sees, and rows 9..11 against keys
  // 6..8 never reach the left bound (causal band)
  const std::vector<AttentionEntry> entries{part(mask, 0, 6, 0, 6, 0), part(mask, 6, 6, 6, 6, -3)};
  const auto q = halves(static_cast<std::size_t>(T * Hq * D), 1.0f), k = halves(static_cast<std::size_t>(TK * Hq * D), 1.0f);
  std::vector<float> lse(static_cast<std::size_t>(Hq * T));
  for (std::size_t i = 0; i < lse.size(); ++i) lse[i] = static_cast<float>(i);
  auto dq = halves(q.size(), 7.0f), dk = halves(k.size(), 7.0f), dv = halves(k.size(), 7.0f);
  int checked = 0;
  std::vector<std::int32_t> lengths;
  fake.on_execute = [&](const FakeDescriptor& d) {
    const Pack p = read_pack(d);
    EXPECT_EQ(p.ptr.at(uid::dq), dq.data());
    EXPECT_EQ(p.ptr.at(uid::dk), dk.data());
    EXPECT_EQ(*static_cast<float*>(p.ptr.at(uid::one)), 1.0f);
    EXPECT_EQ(*static_cast<std::int32_t*>(p.ptr.at(uid::right_bound)), 0);
    if (p.ptr.count(uid::left_bound)) { EXPECT_EQ(*static_cast<std::int32_t*>(p.ptr.at(uid::left_bound)), 3); }
    EXPECT_EQ(p.ptr.count(uid::dq_accum), 0u);  // deterministic by default
    EXPECT_GE(static_cast<char*>(p.ptr.at(uid::softmax_sum)) - static_cast<char*>(p.workspace), 1000);
    const auto seq_q = ints(p.ptr.at(uid::seq_q), 1), off = ints(p.ptr.at(uid::ragged_stats), 1);
    lengths.push_back(seq_q[0]);
    const std::int64_t pitch = 64;
    const auto* stats = static_cast<const float*>(p.ptr.at(uid::stats));
    for (std::int64_t h = 0; h < Hq; ++h) {
      for (std::int64_t s = 0; s < seq_q[0]; ++s) {
        EXPECT_EQ(stats[off[0] + h * pitch + s], lse[static_cast<std::size_t>(h * T + off[0] + s)]);
        ++checked;
      }
    }
  };
  cuda::CudnnAttentionKernel kernel(nullptr, {}, api);
  kernel.backward<float16>(shape, entries, q, k, k, q, lse, q, dq, dk, dv);
  EXPECT_EQ(fake.executions, 2);
  EXPECT_EQ(lengths, (std::vector<std::int32_t>{3, 6}));  // causal band, then window
  EXPECT_EQ(checked, Hq * 9);
  for (std::int64_t r = 0; r < T; ++r) {
    const bool dead_q = r >= 6 && r < 9, dead_kv = r >= 9;
    EXPECT_EQ(static_cast<float>(dq[static_cast<std::size_t>(r * Hq * D)]), dead_q ? 0.0f : 7.0f) << r;
    EXPECT_EQ(static_cast<float>(dk[static_cast<std::size_t>(r * Hq * D)]), dead_kv ? 0.0f : 7.0f) << r;
    EXPECT_EQ(static_cast<float>(dv[static_cast<std::size_t>(r * Hq * D + 5)]), dead_kv ? 0.0f : 7.0f) << r;
  }
}

/// Grouped-query attention (4 query heads, 2 key-value heads) with dead rows
/// and keys, forward then backward: cuDNN gets the GQA graphs (dV and dK summed
/// over each key-value head's query heads), and the kernel clears exactly the
/// dead rows' outputs and dq (4 heads a row) and the dead keys' dk and dv (2
/// heads a row), nothing past the buffers it was given.
TEST_F(CudnnMock, GroupedQueryAttentionWithDeadRowsAndKeysForwardAndBackward) {
  const AttentionShape shape{4, 2, 8, 0.25f};
  const std::int64_t Hq = 4, Hk = 2, D = 8, T = 10, TK = 10, guard = 512;
  const AttentionMask mask = AttentionMask::sliding_window(2);
  // Rows 0..4 against keys 0..4, diagonal 0 (a window band); rows 5..9 against keys 5..9, diagonal -4:
  // rows 5..8 see nothing, keys 6..9 nobody sees (row 9 sees key 5 alone).
  const std::vector<AttentionEntry> entries{part(mask, 0, 5, 0, 5, 0), part(mask, 5, 5, 5, 5, -4)};
  const auto q = halves(static_cast<std::size_t>(T * Hq * D), 1.0f), k = halves(static_cast<std::size_t>(TK * Hk * D), 1.0f);
  const std::size_t nq = q.size(), nk = k.size();
  // Every output buffer runs `guard` elements past what the kernel is given, all 7 to begin with.
  auto out = halves(nq + guard, 7.0f), dq = halves(nq + guard, 7.0f), dk = halves(nk + guard, 7.0f), dv = halves(nk + guard, 7.0f);
  std::vector<float> lse(static_cast<std::size_t>(Hq * T), 7.0f);
  std::vector<Direction> directions;
  fake.on_execute = [&](const FakeDescriptor&) {};
  cuda::CudnnAttentionKernel kernel(nullptr, {}, api);
  kernel.forward<float16>(shape, entries, q, k, k, std::span<float16>(out.data(), nq), lse);
  const int forward_runs = fake.executions;
  EXPECT_EQ(forward_runs, 2);  // a window band and a causal one
  kernel.backward<float16>(shape, entries, q, k, k, std::span<const float16>(out.data(), nq), lse, q, std::span<float16>(dq.data(), nq),
                           std::span<float16>(dk.data(), nk), std::span<float16>(dv.data(), nk));
  EXPECT_EQ(fake.executions, 2 * forward_runs);
  // The backward graphs reached cuDNN with their dV and dK summed over the group.
  int sums = 0;
  for (const FakeDescriptor& d : fake.descs) {
    if (d.type != CUDNN_BACKEND_REDUCTION_DESCRIPTOR) continue;
    const auto op = d.at(CUDNN_ATTR_REDUCTION_OPERATOR).one<cudnnReduceTensorOp_t>();
    EXPECT_TRUE(op == CUDNN_REDUCE_TENSOR_ADD || op == CUDNN_REDUCE_TENSOR_MAX);
    sums += op == CUDNN_REDUCE_TENSOR_ADD;
  }
  // Per graph: forward's row sum; backward's rowsum(dO O), dV's and dK's sums (the row maximum is the one MAX).
  EXPECT_EQ(sums, 2 * 1 + 2 * 3);
  for (std::int64_t r = 0; r < T; ++r) {
    const bool dead_q = r >= 5 && r < 9;
    for (std::int64_t e = 0; e < Hq * D; ++e) {
      const auto at = static_cast<std::size_t>(r * Hq * D + e);
      EXPECT_EQ(static_cast<float>(out[at]), dead_q ? 0.0f : 7.0f) << "out row " << r << ", element " << e;
      EXPECT_EQ(static_cast<float>(dq[at]), dead_q ? 0.0f : 7.0f) << "dq row " << r << ", element " << e;
    }
    for (std::int64_t h = 0; h < Hq; ++h) {
      EXPECT_EQ(lse[static_cast<std::size_t>(h * T + r)] == -INFINITY, dead_q) << "lse row " << r << ", head " << h;
    }
  }
  for (std::int64_t r = 0; r < TK; ++r) {
    const bool dead_kv = r >= 6;
    for (std::int64_t e = 0; e < Hk * D; ++e) {
      const auto at = static_cast<std::size_t>(r * Hk * D + e);
      EXPECT_EQ(static_cast<float>(dk[at]), dead_kv ? 0.0f : 7.0f) << "dk row " << r << ", element " << e;
      EXPECT_EQ(static_cast<float>(dv[at]), dead_kv ? 0.0f : 7.0f) << "dv row " << r << ", element " << e;
    }
  }
  for (std::size_t i = 0; i < guard; ++i) {
    EXPECT_EQ(static_cast<float>(out[nq + i]), 7.0f) << "past out, " << i;
    EXPECT_EQ(static_cast<float>(dq[nq + i]), 7.0f) << "past dq, " << i;
    EXPECT_EQ(static_cast<float>(dk[nk + i]), 7.0f) << "past dk, " << i;
    EXPECT_EQ(static_cast<float>(dv[nk + i]), 7.0f) << "past dv, " << i;
  }
}

TEST_F(CudnnMock, NonDeterministicBackwardAccumulatesInTheWorkspace) {
  const AttentionShape shape{2, 1, 16, 0.25f};
  const std::vector<AttentionEntry> entries{part(AttentionMask::full(), 0, 4, 0, 4, 0)};
  const auto q = halves(4 * 2 * 16, 1.0f), k = halves(4 * 16, 1.0f);
  std::vector<float> lse(8, 0.0f);
  auto dq = halves(q.size(), 0.0f), dk = halves(k.size(), 0.0f), dv = halves(k.size(), 0.0f);
  bool seen = false;
  fake.on_execute = [&](const FakeDescriptor& d) {
    const Pack p = read_pack(d);
    ASSERT_EQ(p.ptr.count(uid::dq_accum), 1u);
    EXPECT_GT(static_cast<char*>(p.ptr.at(uid::dq_accum)), static_cast<char*>(p.ptr.at(uid::softmax_sum)));
    seen = true;
  };
  cuda::CudnnAttentionKernel kernel(nullptr, {.deterministic = false}, api);
  kernel.backward<float16>(shape, entries, q, k, k, q, lse, q, dq, dk, dv);
  EXPECT_TRUE(seen);
}

TEST_F(CudnnMock, EmptyCallsTouchNothingAndBadHeadDimsAreRefused) {
  EXPECT_CALL(mock, Create(_)).Times(0);
  cuda::CudnnAttentionKernel kernel(nullptr, {}, api);
  std::vector<float16> none;
  std::vector<float> no_lse;
  kernel.forward<float16>({2, 1, 8, 1.0f}, {}, none, none, none, none, no_lse);
  const std::vector<AttentionEntry> entries{part(AttentionMask::causal(), 0, 1, 0, 1, 0)};
  auto q = halves(2 * 12, 1.0f), k = halves(12, 1.0f), out = q;
  std::vector<float> lse(2);
  EXPECT_THROW(kernel.forward<float16>({2, 1, 12, 1.0f}, entries, q, k, k, out, lse), invalid_input);
}

/// cuDNN writes each sequence's rows on its own, so entries sharing a query
/// or a key row are refused before anything runs (the op gives this kernel
/// calls whose entries share no row: folds_shared_rows is false).
TEST_F(CudnnMock, EntriesSharingRowsAreRefused) {
  EXPECT_CALL(mock, Create(_)).Times(0);
  static_assert(!attention_kernel_folds_shared_rows<cuda::CudnnAttentionKernel>());
  cuda::CudnnAttentionKernel kernel(nullptr, {}, api);
  const AttentionShape shape{2, 1, 8, 1.0f};
  const auto q = halves(2 * 8 * 8, 1.0f), k = halves(8 * 8, 1.0f);
  auto out = q, dq = q, dk = k, dv = k;
  std::vector<float> lse(2 * 8);
  const cpdispatch::Band full{};
  const std::vector<AttentionEntry> shared_q{{0, 4, 0, 4, full}, {2, 4, 4, 4, full}}, shared_kv{{0, 4, 0, 4, full}, {4, 4, 2, 4, full}};
  auto refused = [](auto&& call, const char* what) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one naming " << what;
    } catch (const invalid_input& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused([&] { kernel.forward<float16>(shape, shared_q, q, k, k, out, lse); }, "share query rows");
  refused([&] { kernel.backward<float16>(shape, shared_kv, q, k, k, q, lse, q, dq, dk, dv); }, "share key-value rows");
}

}  // namespace
