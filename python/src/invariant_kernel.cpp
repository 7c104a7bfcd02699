// The host kernel's invariant mode for the Python front (cpdispatch.torch's
// invariant=True): out, lse, dq and the key-value gradients' exact sums from
// HostAttentionKernel::forward_invariant / backward_invariant, so that Python
// gets the C++ op's property from the one implementation. Tensors come in as
// C-contiguous NumPy arrays (bfloat16 as its int16 bits, float16 as NumPy's
// float16); the calls release the GIL while the kernel runs.

#include "invariant_kernel.hpp"

#include <pybind11/numpy.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cpdispatch/attention/host_kernel.hpp"
#include "cpdispatch/attention/invariant.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/float16.hpp"

namespace py = pybind11;

namespace {

using cpdispatch::AttentionEntry;
using cpdispatch::Band;
using cpdispatch::detail::fail;

/// A [tokens][heads][dim] tensor of the call: its array and shape.
struct Tensor {
  py::array array;
  std::int64_t tokens = 0, heads = 0, dim = 0;
};

/// The NumPy item size and kind each element name travels as.
std::pair<py::ssize_t, char> storage_of(const std::string& element) {
  if (element == "float32") return {4, 'f'};
  if (element == "bfloat16") return {2, 'i'};  // its bits, as int16
  if (element == "float16") return {2, 'f'};
  fail("element is '", element, "'; it must be float32, bfloat16 or float16");
}

Tensor tensor_of(py::handle x, const char* name, const std::string& element, int ndim = 3) {
  auto a = py::reinterpret_borrow<py::array>(x);
  const auto [size, kind] = storage_of(element);
  if (a.ndim() != ndim) fail(name, " has ", a.ndim(), " dimensions; it must have ", ndim);
  if (a.itemsize() != size || a.dtype().kind() != kind) fail(name, " is not stored as ", element, " (item size ", a.itemsize(), ")");
  if (!(a.flags() & py::array::c_style)) fail(name, " must be C-contiguous");
  Tensor t{a, a.shape(0), ndim > 1 ? a.shape(1) : 1, ndim > 2 ? a.shape(2) : 1};
  return t;
}

std::int64_t band_end(py::handle x, std::int64_t open) { return x.is_none() ? open : x.cast<std::int64_t>(); }

}  // namespace

std::vector<AttentionEntry> entries_of(py::handle list) {
  std::vector<AttentionEntry> out;
  std::size_t i = 0;
  for (py::handle item : list) {
    auto t = py::reinterpret_borrow<py::sequence>(item);
    if (t.size() != 6) fail("entries[", i, "] has ", t.size(), " fields; it must be (q_start, q_len, kv_start, kv_len, lo, hi)");
    out.push_back({t[0].cast<std::int64_t>(), t[1].cast<std::int64_t>(), t[2].cast<std::int64_t>(), t[3].cast<std::int64_t>(),
                   Band{band_end(t[4], Band::unbounded_lo), band_end(t[5], Band::unbounded_hi)}});
    ++i;
  }
  return out;
}

namespace {

std::vector<cpdispatch::UnitPhase> phases_of(py::handle list) {
  std::vector<cpdispatch::UnitPhase> out;
  std::size_t i = 0;
  for (py::handle item : list) {
    auto t = py::reinterpret_borrow<py::sequence>(item);
    if (t.size() != 2) fail("phases[", i, "] has ", t.size(), " fields; it must be (q, kv)");
    out.push_back({t[0].cast<std::int64_t>(), t[1].cast<std::int64_t>()});
    ++i;
  }
  return out;
}

cpdispatch::AttentionShape shape_of(const Tensor& q, const Tensor& k, double scale) {
  return {q.heads, k.heads, q.dim, static_cast<float>(scale)};
}

template <class E>
std::span<const E> in(const Tensor& t) {
  return {static_cast<const E*>(t.array.data()), static_cast<std::size_t>(t.array.size())};
}

template <class E>
std::span<E> out(py::array& a) {
  return {static_cast<E*>(a.mutable_data()), static_cast<std::size_t>(a.size())};
}

/// The C++ element type of an element name, passed to f as a value.
template <class F>
auto with_element(const std::string& element, F&& f) {
  if (element == "bfloat16") return f(cpdispatch::bfloat16{});
  if (element == "float16") return f(cpdispatch::float16{});
  return f(float{});
}

cpdispatch::HostAttentionKernel kernel_of(int threads) {
  cpdispatch::HostAttentionOptions o;
  o.threads = threads;
  return cpdispatch::HostAttentionKernel(o);
}

py::tuple forward(py::handle q_, py::handle k_, py::handle v_, py::handle entries_, py::handle phases_, std::int64_t grid, double scale,
                  const std::string& element, int threads) {
  const Tensor q = tensor_of(q_, "q", element), k = tensor_of(k_, "k", element), v = tensor_of(v_, "v", element);
  const std::vector<AttentionEntry> entries = entries_of(entries_);
  const std::vector<cpdispatch::UnitPhase> phases = phases_of(phases_);
  // Rows no entry covers see nothing: out 0 and lse -inf (the kernel writes only its entries' rows).
  py::array o(q.array.dtype(), {q.tokens, q.heads, v.dim});
  std::memset(o.mutable_data(), 0, static_cast<std::size_t>(o.nbytes()));
  py::array_t<float> lse({q.heads, q.tokens});
  std::fill_n(lse.mutable_data(), lse.size(), -std::numeric_limits<float>::infinity());
  with_element(element, [&](auto e) {
    using E = decltype(e);
    cpdispatch::HostAttentionKernel kernel = kernel_of(threads);
    py::gil_scoped_release unlocked;
    kernel.forward_invariant(shape_of(q, k, scale), {grid, phases}, entries, in<E>(q), in<E>(k), in<E>(v), out<E>(o),
                             std::span<float>(lse.mutable_data(), static_cast<std::size_t>(lse.size())));
  });
  return py::make_tuple(o, lse);
}

py::tuple backward(py::handle q_, py::handle k_, py::handle v_, py::handle out_, py::handle lse_, py::handle dout_, py::handle entries_,
                   py::handle phases_, std::int64_t grid, double scale, py::sequence bounds, const std::string& element, int threads) {
  const Tensor q = tensor_of(q_, "q", element), k = tensor_of(k_, "k", element), v = tensor_of(v_, "v", element);
  const Tensor o = tensor_of(out_, "out", element), dout = tensor_of(dout_, "dout", element);
  const Tensor lse = tensor_of(lse_, "lse", "float32", 2);
  const std::vector<AttentionEntry> entries = entries_of(entries_);
  const std::vector<cpdispatch::UnitPhase> phases = phases_of(phases_);
  if (bounds.size() != 4) fail("bounds has ", bounds.size(), " values; it must be (max_abs_q, max_abs_v, max_abs_dout, queries)");
  const cpdispatch::InvariantBounds b{bounds[0].cast<double>(), bounds[1].cast<double>(), bounds[2].cast<double>(), bounds[3].cast<std::int64_t>()};
  const cpdispatch::AttentionShape shape = shape_of(q, k, scale);
  const cpdispatch::KvGradientExponents exponents = cpdispatch::kv_gradient_exponents(shape, b);
  py::array dq(q.array.dtype(), {q.tokens, q.heads, q.dim});
  std::memset(dq.mutable_data(), 0, static_cast<std::size_t>(dq.nbytes()));  // rows no entry covers: 0
  py::array_t<std::int64_t> dk({k.tokens, k.heads, k.dim}), dv({v.tokens, v.heads, v.dim});
  std::span<std::int64_t> dk_sums(dk.mutable_data(), static_cast<std::size_t>(dk.size())), dv_sums(dv.mutable_data(), static_cast<std::size_t>(dv.size()));
  with_element(element, [&](auto e) {
    using E = decltype(e);
    cpdispatch::HostAttentionKernel kernel = kernel_of(threads);
    py::gil_scoped_release unlocked;
    std::fill(dk_sums.begin(), dk_sums.end(), 0);
    std::fill(dv_sums.begin(), dv_sums.end(), 0);
    kernel.backward_invariant(shape, {grid, phases}, entries, in<E>(q), in<E>(k), in<E>(v), in<E>(o), in<float>(lse), in<E>(dout), out<E>(dq),
                              {dk_sums, dv_sums, exponents.dk, exponents.dv});
  });
  return py::make_tuple(dq, dk, dv, exponents.dk, exponents.dv);
}

py::array round_exact(py::array_t<std::int64_t, py::array::c_style> exact, int exponent, const std::string& element) {
  const auto [size, kind] = storage_of(element);
  py::array rounded(py::dtype(std::string(1, kind) + std::to_string(size)), std::vector<py::ssize_t>(exact.shape(), exact.shape() + exact.ndim()));
  with_element(element, [&](auto e) {
    using E = decltype(e);
    cpdispatch::round_exact<E>(std::span<const std::int64_t>(exact.data(), static_cast<std::size_t>(exact.size())), exponent, out<E>(rounded));
  });
  return rounded;
}

}  // namespace

void bind_invariant_kernel(py::module_& m) {
  using namespace pybind11::literals;
  m.def("invariant_forward", &forward, "q"_a, "k"_a, "v"_a, "entries"_a, "phases"_a, "grid"_a, "softmax_scale"_a, "element"_a, "threads"_a = 0);
  m.def("invariant_backward", &backward, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, "dout"_a, "entries"_a, "phases"_a, "grid"_a, "softmax_scale"_a,
        "bounds"_a, "element"_a, "threads"_a = 0);
  m.def("round_exact", &round_exact, "exact"_a, "exponent"_a, "element"_a);
}
