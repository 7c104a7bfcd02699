// _cpdispatch: the C++ planner for Python. Plans come in as the JSON
// contract's dict (or JSON text) and go through the library's JSON reader
// (the common dict shapes are read straight into the library's structs), so
// every check and message is the CLI's; results go out as dicts with the
// CLI's keys whose arrays are NumPy int64 arrays that own the planner's
// storage (moved, not copied). The pure-Python layer (cpdispatch/__init__.py)
// documents the public functions.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "invariant_kernel.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpdispatch/attention/detail/share_entries.hpp"
#include "cpdispatch/attention/detail/stage_plan.hpp"
#include "cpdispatch/execute/token_indices.hpp"
#include "cpdispatch/io/balance_json.hpp"
#include "cpdispatch/io/json.hpp"

namespace py = pybind11;

namespace {

using cpdispatch::Metadata;
using cpdispatch::RankMetadata;
using Int64Array = py::array_t<std::int64_t>;

// ---------------------------------------------------------------- input

/// Where a value sits ("documents.pieces"), as a chain of keys that becomes a
/// string only for a message: building the path per key cost more than the
/// conversion itself.
struct KeyPath {
  const KeyPath* parent = nullptr;
  std::string_view key;

  std::string str() const {
    if (!parent) return std::string(key);
    std::string out = parent->str();
    if (!out.empty()) out += '.';
    out += key;
    return out;
  }
  std::string or_plan() const {
    std::string out = str();
    return out.empty() ? std::string("plan") : out;
  }
};

nlohmann::json to_json(PyObject* value, const KeyPath& where);

nlohmann::json sequence_to_json(PyObject* seq, const KeyPath& where) {
  nlohmann::json out = nlohmann::json::array();
  if (PyList_CheckExact(seq) || PyTuple_CheckExact(seq)) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    out.get_ref<nlohmann::json::array_t&>().reserve(static_cast<std::size_t>(n));
    // Held while converted, and the size read each time: an __index__ may change the list.
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
      const py::object item = py::reinterpret_borrow<py::object>(PySequence_Fast_GET_ITEM(seq, i));
      out.push_back(to_json(item.ptr(), where));
    }
    return out;
  }
  for (py::handle item : py::reinterpret_borrow<py::iterable>(seq)) out.push_back(to_json(item.ptr(), where));
  return out;
}

std::string_view utf8_of(PyObject* text) {
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(text, &size);
  if (!data) throw py::error_already_set();
  return {data, static_cast<std::size_t>(size)};
}

nlohmann::json dict_to_json(PyObject* dict, const KeyPath& where) {
  nlohmann::json out = nlohmann::json::object();
  PyObject* key = nullptr;
  PyObject* item = nullptr;
  Py_ssize_t pos = 0;
  while (PyDict_Next(dict, &pos, &key, &item)) {
    const py::object key_held = py::reinterpret_borrow<py::object>(key), item_held = py::reinterpret_borrow<py::object>(item);
    if (!PyUnicode_Check(key)) cpdispatch::detail::fail(where.or_plan(), ": keys must be strings, got ", std::string(py::repr(key)));
    const std::string_view name = utf8_of(key);
    out[std::string(name)] = to_json(item, KeyPath{&where, name});
  }
  return out;
}

/// A Python value as JSON: dict, list/tuple/ndarray, int (also NumPy
/// integers), float, bool, str, None. Anything else is a ValueError naming
/// the key it sits under.
nlohmann::json to_json(PyObject* value, const KeyPath& where) {
  if (value == Py_None) return nullptr;
  if (PyBool_Check(value)) return value == Py_True;
  if (PyDict_Check(value)) return dict_to_json(value, where);
  if (PyUnicode_Check(value)) return std::string(utf8_of(value));
  if (py::isinstance<py::array>(value)) return sequence_to_json(py::handle(value).attr("tolist")().ptr(), where);
  if (PyList_Check(value) || PyTuple_Check(value)) return sequence_to_json(value, where);
  if (PyIndex_Check(value)) {
    const py::int_ v = py::reinterpret_steal<py::int_>(PyNumber_Index(value));
    if (!v) throw py::error_already_set();
    int overflow = 0;
    const long long n = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
    if (overflow != 0) cpdispatch::detail::fail(where.str(), ": ", std::string(py::str(value)), " is outside the 64-bit signed integer range");
    return static_cast<std::int64_t>(n);
  }
  if (PyFloat_Check(value)) return PyFloat_AS_DOUBLE(value);
  cpdispatch::detail::fail(where.or_plan(), ": a ", std::string(py::str(py::type::handle_of(py::handle(value)).attr("__name__"))),
                           " is not a JSON value (expected a dict, list, int, float, bool, str or None)");
}

/// The limits of a call's max_memory: a positive whole number of bytes (an
/// int or NumPy integer, not a bool). Beyond 64 bits it is simply no limit.
cpdispatch::PlanLimits limits_of(py::handle max_memory) {
  PyObject* o = max_memory.ptr();
  if (PyBool_Check(o) || !PyIndex_Check(o)) {
    throw py::type_error("max_memory must be an int (bytes), got a " + std::string(py::str(py::type::handle_of(max_memory).attr("__name__"))));
  }
  const py::int_ bytes = py::reinterpret_steal<py::int_>(PyNumber_Index(o));
  if (!bytes) throw py::error_already_set();
  if (PyObject_RichCompareBool(bytes.ptr(), py::int_(0).ptr(), Py_LE) == 1) {
    cpdispatch::detail::fail("max_memory = ", std::string(py::str(bytes.ptr())), " must be a positive number of bytes");
  }
  cpdispatch::PlanLimits limits;
  limits.max_bytes = PyLong_AsUnsignedLongLong(bytes.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    limits.max_bytes = std::numeric_limits<std::uint64_t>::max();
  }
  return limits;
}

/// A plan (or balance input) given as a dict or as JSON text; text beyond
/// `limits` is refused before it is parsed.
nlohmann::json input_json(py::handle input, const cpdispatch::PlanLimits& limits) {
  if (py::isinstance<py::str>(input) || py::isinstance<py::bytes>(input)) return cpdispatch::parse_json(input.cast<std::string>(), limits);
  if (!py::isinstance<py::dict>(input)) {
    cpdispatch::detail::fail("plan: expected a dict or JSON text, got a ", std::string(py::str(py::type::handle_of(input).attr("__name__"))));
  }
  return to_json(input.ptr(), KeyPath{});
}

// ---------------------------------------------------------------- output arrays

/// An int64 array that owns `values` (moved to the heap; freed with the array).
template <class Storage>
Int64Array owning_array(Storage&& values, std::vector<py::ssize_t> shape) {
  auto* owned = new Storage(std::move(values));
  py::capsule free_when_done(owned, [](void* p) { delete static_cast<Storage*>(p); });
  std::vector<py::ssize_t> strides(shape.size(), sizeof(std::int64_t));
  for (std::size_t a = shape.size(); a-- > 1;) strides[a - 1] = strides[a] * shape[a];
  return Int64Array(std::move(shape), std::move(strides), owned->data(), free_when_done);
}

Int64Array array_of(cpdispatch::Tensor<std::int64_t>&& t) {
  std::vector<py::ssize_t> shape;
  for (std::size_t a = 0; a < t.dim(); ++a) shape.push_back(static_cast<py::ssize_t>(t.size(a)));
  if (shape.empty()) shape.push_back(0);  // a tensor never shaped: the CLI writes []
  return owning_array(std::move(t), std::move(shape));
}

Int64Array array_of(std::vector<std::int64_t>&& v) {
  const auto n = static_cast<py::ssize_t>(v.size());
  return owning_array(std::move(v), {n});
}

/// [n][copies] when `nested` (a slice's rows), else [n].
Int64Array rows_of(std::vector<std::int64_t>&& v, std::size_t copies, bool nested) {
  if (!nested) return array_of(std::move(v));
  const auto c = static_cast<py::ssize_t>(copies);
  const py::ssize_t n = c == 0 ? 0 : static_cast<py::ssize_t>(v.size()) / c;
  return owning_array(std::move(v), {n, c});
}

/// Ragged rows as a list of arrays: views into one array holding them back
/// to back (one allocation and one object per row instead of a buffer each).
py::list arrays_of(const std::vector<std::vector<std::int64_t>>& rows) {
  std::size_t total = 0;
  for (const auto& row : rows) total += row.size();
  Int64Array flat(static_cast<py::ssize_t>(total));
  std::int64_t* at = flat.mutable_data();
  // Straight through NumPy's C API: py::array's constructor costs a few
  // times more per row, which adds up over thousands of ranks.
  const auto& api = py::detail::npy_api::get();
  py::list out(rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    std::copy(rows[i].begin(), rows[i].end(), at);
    Py_intptr_t extent = static_cast<Py_intptr_t>(rows[i].size()), stride = sizeof(std::int64_t);
    PyObject* view = api.PyArray_NewFromDescr_(api.PyArray_Type_, api.PyArray_DescrFromType_(py::detail::npy_api::NPY_INT64_), 1, &extent,
                                               &stride, at, py::detail::npy_api::NPY_ARRAY_WRITEABLE_, nullptr);
    if (!view) throw py::error_already_set();
    py::object owned = py::reinterpret_steal<py::object>(view);
    if (api.PyArray_SetBaseObject_(view, flat.inc_ref().ptr()) != 0) throw py::error_already_set();  // steals the reference
    out[i] = std::move(owned);
    at += rows[i].size();
  }
  return out;
}

/// cu_seqlens as int32, the dtype flash-attention's varlen API takes.
py::array_t<std::int32_t> int32_of(const std::vector<std::int64_t>& v, std::string_view field) {
  py::array_t<std::int32_t> out(static_cast<py::ssize_t>(v.size()));
  auto* p = out.mutable_data();
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (v[i] > std::numeric_limits<std::int32_t>::max()) {
      cpdispatch::detail::fail(field, '[', i, "] = ", v[i], " does not fit in int32 (flash-attention's cu_seqlens)");
    }
    p[i] = static_cast<std::int32_t>(v[i]);
  }
  return out;
}

// ---------------------------------------------------------------- output dicts

/// The CLI's Metadata object (detail::metadata_object's keys).
py::dict metadata_dict(Metadata&& m) {
  py::dict d;
  d["world_size"] = m.world_size;
  d["has_copies"] = m.has_copies();
  d["num_copies"] = m.num_copies();
  d["mask_copies"] = m.seq_recv_mask ? py::object(py::int_(m.seq_recv_mask->size(2))) : py::object(py::none());
  d["dst_rank"] = array_of(std::move(m.dst_rank));
  d["dst_offset"] = array_of(std::move(m.dst_offset));
  d["seq_len"] = array_of(std::move(m.seq_len));
  d["num_recv_tokens"] = array_of(std::move(m.num_recv_tokens));
  d["num_seqs"] = array_of(std::move(m.num_seqs));
  d["seq_recv_mask"] = m.seq_recv_mask ? py::object(array_of(std::move(*m.seq_recv_mask))) : py::object(py::none());
  d["recv_seq_lens"] = m.recv_seq_lens ? py::object(array_of(std::move(*m.recv_seq_lens))) : py::object(py::none());
  return d;
}

/// One rank's slice, as the CLI's --rank writes it.
py::dict slice_dict(RankMetadata&& m) {
  py::dict d;
  const bool masked = m.seq_recv_mask.has_value();
  d["rank"] = m.rank;
  d["world_size"] = m.world_size;
  d["has_copies"] = m.has_copies;
  d["num_copies"] = m.num_copies;
  d["mask_copies"] = masked ? py::object(py::int_(m.mask_copies)) : py::object(py::none());
  d["dst_rank"] = rows_of(std::move(m.dst_rank), m.num_copies, m.has_copies);
  d["dst_offset"] = rows_of(std::move(m.dst_offset), m.num_copies, m.has_copies);
  d["seq_len"] = array_of(std::move(m.seq_len));
  d["num_recv_tokens"] = array_of(std::move(m.num_recv_tokens));
  d["num_seqs"] = m.num_seqs;
  d["seq_recv_mask"] = masked ? py::object(rows_of(std::move(*m.seq_recv_mask), m.mask_copies, true)) : py::object(py::none());
  d["recv_seq_lens"] = m.recv_seq_lens ? py::object(array_of(std::move(*m.recv_seq_lens))) : py::object(py::none());
  return d;
}

py::dict varlen_dict(const std::vector<std::int64_t>& cu_q, const std::vector<std::int64_t>& cu_kv, std::int64_t max_q, std::int64_t max_kv,
                     std::size_t rank) {
  py::dict d;
  d["cu_seqlens_q"] = int32_of(cu_q, cpdispatch::detail::concat("attn.cu_seqlens_q[", rank, "]"));
  d["cu_seqlens_kv"] = int32_of(cu_kv, cpdispatch::detail::concat("attn.cu_seqlens_kv[", rank, "]"));
  d["max_seqlen_q"] = max_q;
  d["max_seqlen_kv"] = max_kv;
  return d;
}

template <class Layout>
constexpr bool has_mask = requires(const Layout& a) { a.mask; };

/// attn.mask as the library's JSON writer writes it (section 2d), where it
/// writes one: the layout's mask, through the writer, into a Python dict.
template <class Layout>
void add_mask(const Layout& a, py::dict& d) {
  if constexpr (has_mask<Layout>) {
    Layout mask_only;
    mask_only.mask = a.mask;
    const nlohmann::json j = mask_only;
    if (j.contains("mask")) d["mask"] = py::module_::import("json").attr("loads")(j["mask"].dump());
  } else {
    (void)a;
    (void)d;
  }
}

/// One attention entry as the plan format writes it (section 2e):
/// [q0, q1, k0, k1, lo, hi], None for an open end of the band.
py::object entry_object(const cpdispatch::AttentionEntry& e) {
  const auto end = [](std::int64_t v, bool bounded) { return bounded ? py::object(py::int_(v)) : py::object(py::none()); };
  py::list out(6);
  out[0] = py::int_(e.q_start);
  out[1] = py::int_(e.q_start + e.q_len);
  out[2] = py::int_(e.kv_start);
  out[3] = py::int_(e.kv_start + e.kv_len);
  out[4] = end(e.band.lo, e.band.bounded_below());
  out[5] = end(e.band.hi, e.band.bounded_above());
  return out;
}

template <class Item>
py::object entry_object(const std::vector<Item>& items) {
  py::list out(items.size());
  for (std::size_t i = 0; i < items.size(); ++i) out[i] = entry_object(items[i]);
  return out;
}

/// attn.entries (section 2e): per destination rank (a whole plan) or for
/// the one rank, per query shard in arrival order, its entries in the
/// shard's rows and its KV group's columns. Absent where the plan has no
/// slices (the layout's list is then empty); `slices`: the plan has some,
/// so a rank without query shards gets [] too (every rank of such a plan
/// has the key, and so fails or succeeds alike).
template <class Layout>
void add_entries(const Layout& a, py::dict& d, bool slices = false) {
  if (!a.entries.empty() || slices) d["entries"] = entry_object(a.entries);
}

/// "attn" of a whole plan.
py::dict attention_dict(const cpdispatch::AttentionLayout& a) {
  py::dict d;
  d["seqlens_q"] = arrays_of(a.seqlens_q);
  d["seqlens_kv"] = arrays_of(a.seqlens_kv);
  d["cu_seqlens_q"] = arrays_of(a.cu_seqlens_q);
  d["cu_seqlens_kv"] = arrays_of(a.cu_seqlens_kv);
  d["max_seqlen_q"] = array_of(std::vector<std::int64_t>(a.max_seqlen_q));
  d["max_seqlen_kv"] = array_of(std::vector<std::int64_t>(a.max_seqlen_kv));
  add_mask(a, d);
  add_entries(a, d);
  return d;
}

py::dict rank_attention_dict(cpdispatch::RankAttentionLayout&& a, std::size_t rank, py::dict& varlen, bool slices) {
  varlen = varlen_dict(a.cu_seqlens_q, a.cu_seqlens_kv, a.max_seqlen_q, a.max_seqlen_kv, rank);
  py::dict d;
  d["seqlens_q"] = array_of(std::move(a.seqlens_q));
  d["seqlens_kv"] = array_of(std::move(a.seqlens_kv));
  d["cu_seqlens_q"] = array_of(std::move(a.cu_seqlens_q));
  d["cu_seqlens_kv"] = array_of(std::move(a.cu_seqlens_kv));
  d["max_seqlen_q"] = a.max_seqlen_q;
  d["max_seqlen_kv"] = a.max_seqlen_kv;
  add_mask(a, d);
  add_entries(a, d, slices);
  return d;
}

// ---------------------------------------------------------------- planning

struct ParsedPlan {
  cpdispatch::Plan plan;
  bool dedup = false;
};

// ---- the common case without the JSON detour
// A QKV plan dict is read straight into the plan structs by the format's
// tables (io/fields.hpp) with the JSON reader's rules (known keys only,
// plain ints in range, lists of the right lengths): walking a dict into
// nlohmann-json costs several times the planning. Anything else returns
// false and goes through the library's JSON reader, which then names what is
// wrong; values (ranks, lengths, destinations) are checked by the planner
// either way.

/// A plain int (not bool, not a NumPy scalar) that fits in 64 bits.
bool plain_int(PyObject* o, std::int64_t& out) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(o, &overflow);
  return overflow == 0 && !(out == -1 && PyErr_Occurred());
}

/// Interned keys made once (kept for the life of the module): PyDict_GetItemString
/// would make a new string object per lookup.
template <class Name, std::size_t N>
std::array<PyObject*, N> keys_of(const std::array<Name, N>& names) {
  std::array<PyObject*, N> keys{};
  for (std::size_t i = 0; i < N; ++i) {
    const std::string_view name(names[i]);
    keys[i] = PyUnicode_FromStringAndSize(name.data(), static_cast<Py_ssize_t>(name.size()));
    if (!keys[i]) throw py::error_already_set();
    PyUnicode_InternInPlace(&keys[i]);
  }
  return keys;
}

/// The dict's values for `keys` (nullptr where absent); false when it is not
/// a dict or has any other key.
template <std::size_t N>
bool dict_fields(PyObject* o, const std::array<PyObject*, N>& keys, std::array<PyObject*, N>& values) {
  if (!PyDict_CheckExact(o)) return false;
  std::size_t found = 0;
  for (std::size_t i = 0; i < N; ++i) {
    values[i] = PyDict_GetItem(o, keys[i]);  // borrowed
    found += values[i] != nullptr;
  }
  return static_cast<std::size_t>(PyDict_Size(o)) == found;
}

bool int_list(PyObject* o, std::vector<std::int64_t>& out) {
  if (!PyList_CheckExact(o)) return false;
  const Py_ssize_t n = PyList_GET_SIZE(o);
  out.resize(static_cast<std::size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!plain_int(PyList_GET_ITEM(o, i), out[static_cast<std::size_t>(i)])) return false;
  }
  return true;
}

/// "mask" through the library's reader (a small dict: the JSON detour costs nothing here).
cpdispatch::AttentionMask read_mask_field(PyObject* o) {
  const KeyPath root{};
  const auto path = cpdispatch::detail::JsonPath::root("input");
  return cpdispatch::detail::read_mask(to_json(o, KeyPath{&root, "mask"}), path / "mask");
}

namespace fields = cpdispatch::fields;

/// A table's keys as interned strings, made once per struct.
template <fields::Tabled S>
const std::array<PyObject*, fields::size<S>>& interned_keys() {
  static const auto keys = keys_of(fields::keys<S>());
  return keys;
}

template <fields::Tabled S>
bool read_fields(const std::array<PyObject*, fields::size<S>>& values, S& out);

bool read_value(PyObject* o, std::int64_t& out, const fields::Rule& rule) { return plain_int(o, out) && out >= rule.at_least; }

bool read_value(PyObject* o, std::optional<std::int64_t>& out, const fields::Rule& rule) { return read_value(o, out.emplace(), rule); }

bool read_value(PyObject* o, bool& out, const fields::Rule&) {
  out = o == Py_True;
  return PyBool_Check(o);
}

bool read_value(PyObject* o, cpdispatch::AttentionMask& out, const fields::Rule&) {
  try {
    out = read_mask_field(o);
    return true;
  } catch (const cpdispatch::invalid_input&) {
    return false;  // the JSON reader names it, after any field it reads first
  }
}

template <class T>
bool read_value(PyObject* o, std::vector<T>& out, const fields::Rule&) {
  if constexpr (!fields::Tabled<T>) {
    return int_list(o, out);
  } else {
    if (!PyList_CheckExact(o)) return false;
    const auto& keys = interned_keys<T>();  // looked up once for the list: this loop is the hot one
    std::array<PyObject*, fields::size<T>> values;
    out.resize(static_cast<std::size_t>(PyList_GET_SIZE(o)));
    for (std::size_t i = 0; i < out.size(); ++i) {
      if (!dict_fields(PyList_GET_ITEM(o, static_cast<Py_ssize_t>(i)), keys, values) || !read_fields(values, out[i])) return false;
    }
    return true;
  }
}

/// A fixed key: absent, or its one value as a str.
template <class S>
bool read_field(PyObject* o, const fields::Tag& tag, S&) {
  return !o || (PyUnicode_CheckExact(o) && PyUnicode_CompareWithASCIIString(o, std::string(tag.value).c_str()) == 0);
}

template <class S, class T>
bool read_field(PyObject* o, const fields::Field<S, T>& f, S& out) {
  if (!o || (o == Py_None && !f.rule.required)) return !f.rule.required;
  if constexpr (fields::is_vector<T>) {
    if (!f.rule.length_of.empty()) {
      const auto bound = fields::bound_of(out, f.rule.length_of);
      if (!PyList_CheckExact(o) || !bound || static_cast<std::size_t>(PyList_GET_SIZE(o)) != bound->value) return false;
    }
  }
  return read_value(o, out.*f.member, f.rule);
}

/// S from the values of its table's keys (nullptr where absent), by the JSON reader's rules.
template <fields::Tabled S>
bool read_fields(const std::array<PyObject*, fields::size<S>>& values, S& out) {
  bool ok = true;
  std::size_t i = 0;
  fields::for_each<S>([&](const auto& entry) { ok = ok && read_field(values[i++], entry, out); });
  return ok;
}

/// S from a dict of its table's keys and no other.
template <fields::Tabled S>
bool read_struct(PyObject* o, S& out) {
  std::array<PyObject*, fields::size<S>> values;
  return dict_fields(o, interned_keys<S>(), values) && read_fields(values, out);
}

/// The fast read of a QKV plan dict (see above); false: use the JSON reader.
bool read_qkv_dict(py::handle input, ParsedPlan& out) {
  static const auto form_keys = keys_of(std::array{"documents", "ranks"});
  PyObject* o = input.ptr();
  if (!PyDict_CheckExact(o)) return false;
  const bool documents = PyDict_GetItem(o, form_keys[0]) != nullptr, ranks = PyDict_GetItem(o, form_keys[1]) != nullptr;
  if (documents == ranks) return false;
  const auto read = [&](auto plan) {
    if (!read_struct(o, plan)) return false;
    out.dedup = out.dedup || plan.dedup;
    out.plan = std::move(plan);
    return true;
  };
  return documents ? read(cpdispatch::QkvDocumentsPlan{}) : read(cpdispatch::QkvPlan{});
}

void check_dedup(const ParsedPlan& p) {
  if (p.dedup && p.plan.index() == 0) {
    cpdispatch::detail::fail("dedup: deduplication applies to qkv plans (key-value copies); this is a query plan");
  }
}

ParsedPlan parse_plan(py::handle input, bool dedup, const cpdispatch::PlanLimits& limits) {
  ParsedPlan out{{}, dedup};
  if (!read_qkv_dict(input, out)) {
    const nlohmann::json j = input_json(input, limits);
    out = {cpdispatch::plan_from_json(j), dedup || cpdispatch::dedup_requested(j)};
  }
  check_dedup(out);
  return out;
}

/// Runs `f(parsed plan)` on a plan read once before (a ParsedPlan) or read now.
template <class F>
auto with_plan(py::handle input, bool dedup, const cpdispatch::PlanLimits& limits, F&& f) {
  if (py::isinstance<ParsedPlan>(input)) {
    const ParsedPlan& kept = input.cast<const ParsedPlan&>();
    if (!dedup || kept.dedup) return f(kept);
    ParsedPlan with_dedup{kept.plan, true};  // a copy, only when dedup is asked for here and not there
    check_dedup(with_dedup);
    return f(with_dedup);
  }
  return f(parse_plan(input, dedup, limits));
}

/// The whole plan's metadata: cpdispatch-plan's output.
py::object to_python(const nlohmann::json& j);

/// Section 2f's parts of a plan with head-parallel documents, as the JSON
/// writer writes them: the metadata as arrays, the small layout through JSON.
template <class Planned, class Slice>
void add_head_parallel(Planned& m, py::dict& out, Slice&& slice) {
  out["hp_fwd"] = slice(std::move(m.hp_fwd));
  out["hp_rev"] = slice(std::move(m.hp_rev));
  out["hp_attn"] = to_python(nlohmann::json(m.hp_attn));
}

py::dict plan_dict(cpdispatch::PlanMetadata&& planned, bool dedup) {
  py::dict out;
  if (auto* q = std::get_if<cpdispatch::QueryMetadata>(&planned)) {
    out["fwd"] = metadata_dict(std::move(q->fwd));
    out["rev"] = metadata_dict(std::move(q->rev));
    return out;
  }
  auto& qkv = std::get<cpdispatch::QkvMetadata>(planned);
  if (dedup) {
    cpdispatch::KvWireMetadata wire = cpdispatch::plan_kv_wire(qkv);
    out["kv_wire_fwd"] = metadata_dict(std::move(wire.fwd));
    out["kv_wire_rev"] = metadata_dict(std::move(wire.rev));
  }
  out["q_fwd"] = metadata_dict(std::move(qkv.q_fwd));
  out["q_rev"] = metadata_dict(std::move(qkv.q_rev));
  out["kv_fwd"] = metadata_dict(std::move(qkv.kv_fwd));
  out["kv_rev"] = metadata_dict(std::move(qkv.kv_rev));
  out["attn"] = attention_dict(qkv.attn);
  if (!qkv.hp_attn.empty()) add_head_parallel(qkv, out, [](Metadata&& m) { return metadata_dict(std::move(m)); });
  return out;
}

py::dict plan(py::handle input, bool dedup, py::handle max_memory) {
  const cpdispatch::PlanLimits limits = limits_of(max_memory);
  return with_plan(input, dedup, limits, [&](const ParsedPlan& parsed) {
    cpdispatch::PlanLimits planning = limits;
    if (parsed.dedup) planning.bytes_per_element += planning.bytes_per_element / 2;  // the wire metadata repeats half of the KV shapes and more
    return plan_dict(cpdispatch::plan_metadata(parsed.plan, planning), parsed.dedup);
  });
}

/// Whether some dispatched document of the plan carries slices (section 2e;
/// a head-parallel one's entries are in hp_attn, section 2f).
bool has_slices(const ParsedPlan& parsed) {
  const auto* d = std::get_if<cpdispatch::QkvDocumentsPlan>(&parsed.plan);
  return d && std::any_of(d->documents.begin(), d->documents.end(), [](const auto& doc) { return !doc.slices.empty() && !doc.head_parallel; });
}

/// Every rank's MLP token count of a plan (a rank's MLP layout holds the shards whose home it is).
std::vector<std::int64_t> rank_tokens(const ParsedPlan& parsed) {
  std::vector<std::int64_t> tokens;
  if (const auto* p = std::get_if<cpdispatch::QkvPlan>(&parsed.plan)) {
    for (const auto& r : p->ranks) {
      tokens.push_back(0);
      for (const auto& d : r.docs) {
        for (std::int64_t len : d.shard_len) tokens.back() += len;
      }
    }
  } else if (const auto* d = std::get_if<cpdispatch::QkvDocumentsPlan>(&parsed.plan)) {
    tokens.assign(static_cast<std::size_t>(d->world_size), 0);
    for (const auto& doc : d->documents) {
      for (const auto& s : doc.shards) tokens[static_cast<std::size_t>(s.rank)] += s.len;
    }
  }
  return tokens;
}

/// Rank `rank`'s share (and, with dedup, its wire slices and fan list),
/// planned per rank once: the rank calls below take it in place of a plan
/// (cpdispatch.torch.RankDispatch plans its share once for all of them).
struct RankShare {
  cpdispatch::RankPlanMetadata metadata;
  std::optional<cpdispatch::RankKvWire> wire;
  bool slices = false;  ///< some document of the plan has slices
  std::int64_t rank = 0;
  bool dedup = false;
  std::vector<std::int64_t> starts;  ///< each rank's first MLP token in the packed order, then the total
};

RankShare plan_rank_share(const ParsedPlan& parsed, std::int64_t rank, const cpdispatch::PlanLimits& limits) {
  RankShare out;
  if (!parsed.dedup) {
    out.metadata = cpdispatch::plan_metadata_for_rank(parsed.plan, rank, limits);
  } else {
    cpdispatch::RankQkvMetadata share;
    cpdispatch::RankKvWire wire;
    if (const auto* p = std::get_if<cpdispatch::QkvPlan>(&parsed.plan)) {
      cpdispatch::RankPlanWorkspace workspace;
      cpdispatch::plan_qkv_for_rank(*p, rank, share, workspace, &wire, limits);
    } else {
      const auto& d = std::get<cpdispatch::QkvDocumentsPlan>(parsed.plan);
      share = cpdispatch::plan_qkv_for_rank(d, rank, limits);
      wire = cpdispatch::plan_kv_wire_for_rank(d, rank, limits);
    }
    out.metadata = std::move(share);
    out.wire = std::move(wire);
  }
  out.slices = has_slices(parsed);
  out.rank = rank;
  out.dedup = parsed.dedup;
  out.starts.assign(1, 0);
  for (std::int64_t t : rank_tokens(parsed)) out.starts.push_back(out.starts.back() + t);
  return out;
}

/// Runs `f(share)` on rank `rank`'s share: `input` itself when it is one
/// (of that rank, planned with dedup where dedup is asked for), else
/// planned now from the plan `input`.
template <class F>
auto with_share(py::handle input, std::int64_t rank, bool dedup, const cpdispatch::PlanLimits& limits, F&& f) {
  if (py::isinstance<RankShare>(input)) {
    const RankShare& kept = input.cast<const RankShare&>();
    if (kept.rank != rank) cpdispatch::detail::fail("rank = ", rank, ", but the share given is rank ", kept.rank, "'s");
    if (dedup && !kept.dedup) cpdispatch::detail::fail("dedup = True, but the share given was planned without deduplication");
    return f(kept);
  }
  return f(with_plan(input, dedup, limits, [&](const ParsedPlan& parsed) { return plan_rank_share(parsed, rank, limits); }));
}

py::dict rank_share_dict(const RankShare& share) {
  py::dict out;
  if (const auto* q = std::get_if<cpdispatch::RankQueryMetadata>(&share.metadata)) {
    out["rank"] = q->fwd.rank;
    out["fwd"] = slice_dict(RankMetadata(q->fwd));
    out["rev"] = slice_dict(RankMetadata(q->rev));
    return out;
  }
  cpdispatch::RankQkvMetadata m = std::get<cpdispatch::RankQkvMetadata>(share.metadata);  // a copy: the share may be kept
  out["rank"] = m.q_fwd.rank;
  out["q_fwd"] = slice_dict(std::move(m.q_fwd));
  out["q_rev"] = slice_dict(std::move(m.q_rev));
  out["kv_fwd"] = slice_dict(std::move(m.kv_fwd));
  out["kv_rev"] = slice_dict(std::move(m.kv_rev));
  py::dict varlen;
  out["attn"] = rank_attention_dict(std::move(m.attn), static_cast<std::size_t>(share.rank), varlen, share.slices);
  out["varlen"] = varlen;
  if (share.wire) {
    out["kv_wire_fwd"] = slice_dict(RankMetadata(share.wire->fwd));
    out["kv_wire_rev"] = slice_dict(RankMetadata(share.wire->rev));
  }
  if (m.has_head_parallel()) add_head_parallel(m, out, [](RankMetadata&& s) { return slice_dict(std::move(s)); });
  return out;
}

py::dict plan_for_rank(py::handle input, std::int64_t rank, bool dedup, py::handle max_memory) {
  const cpdispatch::PlanLimits limits = limits_of(max_memory);
  return with_share(input, rank, dedup, limits, [](const RankShare& share) { return rank_share_dict(share); });
}

// ---------------------------------------------------------------- invariant mode

py::object band_end(std::int64_t x, std::int64_t open) { return x == open ? py::object(py::none()) : py::object(py::int_(x)); }

/// An entry as Python's (q_start, q_len, kv_start, kv_len, lo, hi) tuple, None for an open band end.
py::tuple entry_tuple(const cpdispatch::AttentionEntry& x) {
  return py::make_tuple(x.q_start, x.q_len, x.kv_start, x.kv_len, band_end(x.band.lo, cpdispatch::Band::unbounded_lo),
                        band_end(x.band.hi, cpdispatch::Band::unbounded_hi));
}

/// `mask` (None: causal) through the library's reader.
cpdispatch::AttentionMask mask_or_causal(py::handle mask) {
  return mask.is_none() ? cpdispatch::AttentionMask::causal() : read_mask_field(mask.ptr());
}

/// The band of `mask` on t - p over a whole document, (lo, hi), None for an open end.
py::tuple mask_band(py::handle mask) {
  const cpdispatch::Band b = mask_or_causal(mask).band();
  return py::make_tuple(band_end(b.lo, cpdispatch::Band::unbounded_lo), band_end(b.hi, cpdispatch::Band::unbounded_hi));
}

/// A varlen layout's entries (layout_entries, attention/kernel.hpp: each
/// entry's query rows against its key rows under `mask`, bottom-right
/// aligned) as (q_start, q_len, kv_start, kv_len, lo, hi), the empty ones
/// left out; the prefix sums checked against `queries` and `keys` rows.
py::list layout_entries(py::handle cu_seqlens_q, py::handle cu_seqlens_kv, std::int64_t queries, std::int64_t keys, py::handle mask) {
  std::vector<std::int64_t> cu_q, cu_kv;
  if (!int_list(cu_seqlens_q.ptr(), cu_q)) cpdispatch::detail::fail("cu_seqlens_q must be a list of ints");
  if (!int_list(cu_seqlens_kv.ptr(), cu_kv)) cpdispatch::detail::fail("cu_seqlens_kv must be a list of ints");
  if (cu_q.size() != cu_kv.size() || cu_q.empty()) {
    cpdispatch::detail::fail("cu_seqlens_q has ", cu_q.size(), " values and cu_seqlens_kv ", cu_kv.size(), ": they need the same number, at least 1");
  }
  for (auto [name, cu, total] : {std::tuple{"cu_seqlens_q", &cu_q, queries}, std::tuple{"cu_seqlens_kv", &cu_kv, keys}}) {
    for (std::size_t i = 0; i < cu->size(); ++i) {
      const std::int64_t x = (*cu)[i];
      if ((i == 0 && x != 0) || (i > 0 && x < (*cu)[i - 1]) || x > total) {
        cpdispatch::detail::fail(name, " must start at 0, never decrease and end at most at ", total, " rows: ", name, "[", i, "] = ", x);
      }
    }
  }
  py::list out;
  for (const cpdispatch::AttentionEntry& e : cpdispatch::layout_entries(cu_q, cu_kv, mask_or_causal(mask))) {
    if (e.q_len > 0 && e.kv_len > 0) out.append(entry_tuple(e));
  }
  return out;
}

/// A part's band end: an int, or None (open, `open`); anything else refused naming the part.
std::int64_t part_end(py::handle x, const char* what, const std::string& part, std::int64_t open) {
  if (x.is_none()) return open;
  if (PyBool_Check(x.ptr()) || !PyIndex_Check(x.ptr())) {
    cpdispatch::detail::fail("a part's ", what, " is an int or None (open), not ", std::string(py::repr(x)), ": ", part);
  }
  const std::int64_t v = PyLong_AsLongLong(py::reinterpret_steal<py::object>(PyNumber_Index(x.ptr())).ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    cpdispatch::detail::fail("a part's ", what, " does not fit 64 bits: ", part);
  }
  return v;
}

/// Explicit entries (q_start, q_len, kv_start, kv_len, lo, hi; lo and hi an
/// int or None, an open end) checked against `queries` query and `keys` key
/// rows, as tuples of ints; those whose band holds no pair of their
/// rectangle (band_meets) left out.
py::list explicit_entries(py::iterable parts, std::int64_t queries, std::int64_t keys) {
  py::list out;
  for (py::handle item : parts) {
    const py::tuple part(py::reinterpret_borrow<py::object>(item));
    const std::string shown = py::str(part);
    if (part.size() != 6) cpdispatch::detail::fail("a part is (q_start, q_len, kv_start, kv_len, lo, hi), not ", shown);
    std::int64_t x[4];
    bool inside = true;
    for (std::size_t i = 0; i < 4; ++i) {
      const py::int_ v(py::reinterpret_borrow<py::object>(part[i]));  // int(x), as Python reads it
      x[i] = PyLong_AsLongLong(v.ptr());
      if (PyErr_Occurred()) {
        PyErr_Clear();
        inside = false;
      }
    }
    std::int64_t q_end = 0, kv_end = 0;
    inside = inside && std::min({x[0], x[1], x[2], x[3]}) >= 0 && !__builtin_add_overflow(x[0], x[1], &q_end) &&
             !__builtin_add_overflow(x[2], x[3], &kv_end) && q_end <= queries && kv_end <= keys;
    if (!inside) {
      cpdispatch::detail::fail("a part is (q_start, q_len, kv_start, kv_len, lo, hi) within ", queries, " query and ", keys, " key rows, not ", shown);
    }
    const cpdispatch::Band band{part_end(part[4], "lo", shown, cpdispatch::Band::unbounded_lo), part_end(part[5], "hi", shown, cpdispatch::Band::unbounded_hi)};
    if (cpdispatch::band_meets(x[0], q_end, x[2], kv_end, band)) out.append(entry_tuple({x[0], x[1], x[2], x[3], band}));
  }
  return out;
}

/// Each entry's pass in the op's cut of a kernel call into passes of which
/// none holds a query row twice (detail::query_row_passes).
py::list query_row_passes(py::handle entries_in) {
  const std::vector<cpdispatch::AttentionEntry> entries = entries_of(entries_in);
  std::vector<std::size_t> order(entries.size()), pass(entries.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return entries[a].q_start < entries[b].q_start; });
  std::vector<std::int64_t> ends;
  cpdispatch::detail::query_row_passes(order, [&](std::size_t i) -> const cpdispatch::AttentionEntry& { return entries[i]; }, pass, ends);
  py::list out;
  for (const std::size_t p : pass) out.append(p);
  return out;
}

/// invariant_layout on a planned share.
py::dict invariant_layout_of(const RankShare& share, std::int64_t grid) {
  const auto* m = std::get_if<cpdispatch::RankQkvMetadata>(&share.metadata);
  if (m == nullptr) cpdispatch::detail::fail("the invariant mode takes a qkv plan (queries and key-values); this is a query plan");
  std::vector<cpdispatch::AttentionEntry> entries;
  std::vector<std::size_t> begin;
  std::vector<cpdispatch::UnitPhase> phases;
  std::vector<std::int64_t> scratch;
  cpdispatch::detail::share_entries(m->attn, entries, begin);
  cpdispatch::detail::unit_phases(grid, share.starts, m->attn, entries, begin, m->q_rev, m->kv_rev, "ContextParallelAttention(invariant=True)", phases,
                                  scratch);
  py::list e, p;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    e.append(entry_tuple(entries[i]));
    p.append(py::make_tuple(phases[i].q, phases[i].kv));
  }
  py::dict out;
  out["entries"] = e;
  out["phases"] = p;
  out["tokens"] = share.starts.back();
  return out;
}

/// Rank `rank`'s kernel entries over its attention buffers and each one's
/// phase on a grid of `grid` tokens, as ContextParallelAttention lays them
/// out in its invariant mode (attention/detail/share_entries.hpp); refuses
/// a share cut off the grid, naming the shard and its packed position.
py::dict invariant_layout(py::handle input, std::int64_t rank, bool dedup, std::int64_t grid, py::handle max_memory) {
  if (grid < 1 || grid > (std::int64_t{1} << 40)) cpdispatch::detail::fail("grid = ", grid, " must be in [1, 2^40]");
  return with_share(input, rank, dedup, limits_of(max_memory), [&](const RankShare& share) { return invariant_layout_of(share, grid); });
}

// ---------------------------------------------------------------- stages

/// Entries over a rank's attention buffers in query-shard order (stable),
/// with where each shard's start (begin); refuses one that leaves its
/// shard's rows or its KV group's columns.
std::vector<cpdispatch::AttentionEntry> shard_order(std::vector<cpdispatch::AttentionEntry> entries, const cpdispatch::RankAttentionLayout& layout,
                                                    std::vector<std::size_t>& begin) {
  const auto& cu_q = layout.cu_seqlens_q;
  const auto& cu_kv = layout.cu_seqlens_kv;
  std::vector<std::size_t> shard(entries.size());
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const cpdispatch::AttentionEntry& e = entries[i];
    const auto g = static_cast<std::size_t>(std::upper_bound(cu_q.begin(), cu_q.end(), e.q_start) - cu_q.begin()) - 1;
    if (e.q_start < 0 || e.q_len < 0 || e.kv_start < 0 || e.kv_len < 0 || g + 1 >= cu_q.size() || e.q_start + e.q_len > cu_q[g + 1] ||
        e.kv_start < cu_kv[g] || e.kv_start + e.kv_len > cu_kv[g + 1]) {
      cpdispatch::detail::fail("entries[", i, "] = (", e.q_start, ", ", e.q_len, ", ", e.kv_start, ", ", e.kv_len,
                               ", ...) does not lie in one query shard's rows and its KV group's columns");
    }
    shard[i] = g;
  }
  std::vector<std::size_t> order(entries.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return shard[a] < shard[b]; });
  std::vector<cpdispatch::AttentionEntry> sorted;
  begin.assign(cu_q.size(), 0);
  for (std::size_t i : order) {
    sorted.push_back(entries[i]);
    ++begin[shard[i] + 1];
  }
  for (std::size_t g = 1; g < begin.size(); ++g) begin[g] += begin[g - 1];
  return sorted;
}

/// stage_plan on a planned share.
py::dict stage_plan_of(const RankShare& share, std::int64_t stages, py::handle entries_in) {
  const auto* m = std::get_if<cpdispatch::RankQkvMetadata>(&share.metadata);
  if (m == nullptr) cpdispatch::detail::fail("stages take a qkv plan (queries and key-values); this is a query plan");
  const int W = static_cast<int>(m->q_fwd.world_size), me = static_cast<int>(share.rank);
  const int groups = cpdispatch::detail::stage_groups(stages, W);
  std::vector<cpdispatch::AttentionEntry> entries;
  std::vector<std::size_t> begin;
  if (entries_in.is_none()) {
    cpdispatch::detail::share_entries(m->attn, entries, begin);
  } else {
    entries = shard_order(entries_of(entries_in), m->attn, begin);
  }
  cpdispatch::detail::StagePlan plan;
  plan.build(entries, begin, m->attn.cu_seqlens_q, m->attn.cu_seqlens_kv, m->q_rev, m->kv_rev, me, W, groups, true, "stage_plan");
  py::list send_group, recv_round, parts, passes, kv_ready;
  for (int p = 0; p < W; ++p) {
    send_group.append(p == me || groups == 0 ? -1 : cpdispatch::detail::stage_group(me, p, W, groups));
    recv_round.append(plan.round_of(p));
  }
  for (const cpdispatch::AttentionEntry& x : plan.parts()) parts.append(entry_tuple(x));
  for (const cpdispatch::detail::StagePass& x : plan.passes()) passes.append(py::make_tuple(x.round, x.begin, x.end));
  for (int g = 0; g < groups; ++g) kv_ready.append(plan.kv_ready(g));
  py::dict out;
  out["groups"] = groups;
  out["send_group"] = send_group;
  out["recv_round"] = recv_round;
  out["parts"] = parts;
  out["passes"] = passes;
  out["kv_ready"] = kv_ready;
  return out;
}

/// What ContextParallelAttention(stages=S) attends in which round on rank
/// `rank`, as the C++ op plans it (attention/detail/stage_plan.hpp over the
/// entries of share_entries): the stage groups, per peer the group of what
/// this rank sends it and the round in which what it sends arrives (this
/// rank itself: -1 and 0), the parts (entries' query rows against runs of
/// their keys that arrive in one round), the passes (round, first part, end)
/// and per group the round after which its key-value gradients are complete.
/// `entries` (None: the share's own) replaces the share's entries: each
/// must lie in one query shard's rows and its KV group's columns.
py::dict stage_plan(py::handle input, std::int64_t rank, bool dedup, std::int64_t stages, py::handle entries_in, py::handle max_memory) {
  if (stages < 1) cpdispatch::detail::fail("stages = ", stages, " must be at least 1");
  return with_share(input, rank, dedup, limits_of(max_memory), [&](const RankShare& share) { return stage_plan_of(share, stages, entries_in); });
}

// ---------------------------------------------------------------- token indices

py::dict exchange_dict(cpdispatch::ExchangeIndices&& e) {
  py::dict d;
  d["send_index"] = array_of(std::move(e.send_index));
  d["send_counts"] = array_of(std::move(e.send_counts));
  d["recv_index"] = array_of(std::move(e.recv_index));
  d["recv_counts"] = array_of(std::move(e.recv_counts));
  d["input_tokens"] = e.input_tokens;
  d["output_tokens"] = e.output_tokens;
  return d;
}

py::dict indices_dict(const RankMetadata& fwd, const RankMetadata& rev) {
  cpdispatch::DispatchIndices ix = cpdispatch::dispatch_indices(fwd, rev);
  py::dict d;
  d["forward"] = exchange_dict(std::move(ix.forward));
  d["reverse"] = exchange_dict(std::move(ix.reverse));
  d["copies"] = ix.copies;
  d["tokens"] = ix.tokens;
  d["combine_source"] = array_of(std::move(ix.combine_source));
  d["combine_target"] = array_of(std::move(ix.combine_target));
  return d;
}

/// token_indices on a planned share.
py::dict token_indices_of(const RankShare& share) {
  py::dict out;
  if (const auto* q = std::get_if<cpdispatch::RankQueryMetadata>(&share.metadata)) {
    out["q"] = indices_dict(q->fwd, q->rev);
    return out;
  }
  const auto& m = std::get<cpdispatch::RankQkvMetadata>(share.metadata);
  out["q"] = indices_dict(m.q_fwd, m.q_rev);
  out["kv"] = indices_dict(m.kv_fwd, m.kv_rev);
  if (share.wire) {
    out["kv_wire"] = indices_dict(share.wire->fwd, share.wire->rev);
    cpdispatch::FanIndices fan = cpdispatch::fan_indices(share.wire->fan);
    py::dict f;
    f["fan_source"] = array_of(std::move(fan.fan_source));
    f["wire_tokens"] = fan.wire_tokens;
    f["attention_tokens"] = fan.attention_tokens;
    out["fan"] = f;
  }
  return out;
}

/// Rank `rank`'s gather/scatter indices: "q" (queries and outputs), "kv"
/// (key-values), and with dedup "kv_wire" and "fan" (the fan-out).
py::dict token_indices(py::handle input, std::int64_t rank, bool dedup, py::handle max_memory) {
  return with_share(input, rank, dedup, limits_of(max_memory), [](const RankShare& share) { return token_indices_of(share); });
}

// ---------------------------------------------------------------- positions

std::size_t checked_copies(const cpdispatch::QkvPlan& p) { return cpdispatch::detail::check_rank_plan(p); }
std::size_t checked_copies(const cpdispatch::QkvDocumentsPlan& p) { return cpdispatch::detail::check_documents_plan(p); }

/// Each of rank `rank`'s tokens (MLP layout order) as its position within its
/// document, from the planner's shard table: a shard's context is the
/// tokens of its document before it. The plan is checked as the planner
/// checks it first (the table indexes by its ranks).
template <class QkvForm>
std::vector<std::int64_t> rank_positions(const QkvForm& plan, std::int64_t rank, const cpdispatch::PlanLimits& limits) {
  namespace detail = cpdispatch::detail;
  const std::size_t C = checked_copies(plan);
  const std::size_t R = detail::checked_rank(rank, plan.world_size, "position_ids");
  const detail::ShardTable t = detail::shard_table(plan, C);
  std::uint64_t tokens = 0;
  for (std::size_t p = t.rank_begin[R]; p < t.rank_begin[R + 1]; ++p) tokens += static_cast<std::uint64_t>(t.len[t.by_rank[p]]);
  detail::check_footprint(limits, {tokens, 0}, "position_ids", detail::concat("rank ", R, "'s ", tokens, " tokens"));
  std::vector<std::int64_t> out;
  out.reserve(tokens);
  for (std::size_t p = t.rank_begin[R]; p < t.rank_begin[R + 1]; ++p) {
    const std::size_t id = t.by_rank[p];
    for (std::int64_t i = 0; i < t.len[id]; ++i) out.push_back(t.context[id] + i);
  }
  return out;
}

std::vector<std::int64_t> rank_positions(const cpdispatch::QueryPlan&, std::int64_t, const cpdispatch::PlanLimits&) {
  cpdispatch::detail::fail("position_ids: a query plan has no documents (positions are a qkv plan's)");
}

/// position_ids: see rank_positions.
Int64Array position_ids(py::handle input, std::int64_t rank, py::handle max_memory) {
  const cpdispatch::PlanLimits limits = limits_of(max_memory);
  std::vector<std::int64_t> positions = with_plan(input, false, limits, [&](const ParsedPlan& parsed) {
    return std::visit([&](const auto& plan) { return rank_positions(plan, rank, limits); }, parsed.plan);
  });
  return array_of(std::move(positions));
}

// ---------------------------------------------------------------- balancing

py::object to_python(const nlohmann::json& j);

py::list list_of(const nlohmann::json& j) {
  py::list out(j.size());
  std::size_t i = 0;
  for (const auto& item : j) PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i++), to_python(item).release().ptr());  // steals
  return out;
}

py::dict dict_of(const nlohmann::json& j) {
  py::dict out;
  for (const auto& [key, item] : j.items()) {
    const py::object value = to_python(item);
    if (PyDict_SetItemString(out.ptr(), key.c_str(), value.ptr()) != 0) throw py::error_already_set();
  }
  return out;
}

/// JSON as json.loads(j.dump()) returns it, without the text in between
/// (the writer writes a non-finite number as null).
py::object to_python(const nlohmann::json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::object: return dict_of(j);
    case nlohmann::json::value_t::array: return list_of(j);
    case nlohmann::json::value_t::string: return py::str(j.get_ref<const std::string&>());
    case nlohmann::json::value_t::boolean: return py::bool_(j.get<bool>());
    case nlohmann::json::value_t::number_integer: return py::int_(j.get<std::int64_t>());
    case nlohmann::json::value_t::number_unsigned: return py::int_(j.get<std::uint64_t>());
    case nlohmann::json::value_t::number_float: {
      const double v = j.get<double>();
      return std::isfinite(v) ? py::object(py::float_(v)) : py::object(py::none());
    }
    default: return py::none();  // null (and the writer's discarded values)
  }
}

// ---- the balance input without the JSON detour
// As for plans: a balance dict of the expected shape (known keys only, plain
// ints, lists of the right lengths) is read straight into the BalanceProblem,
// whose values plan_balanced checks. Anything else goes through the library's
// JSON reader, and so does a direct read whose planning fails: the reader
// then names a bad value as the CLI does.

struct BalanceInput {
  cpdispatch::BalanceProblem problem;
  cpdispatch::BalanceOptions options;
  bool read_directly = false;
};

bool read_pieces(PyObject* o, std::vector<cpdispatch::DocumentPiece>& pieces) {
  static const auto document_keys = keys_of(std::array{"pieces"});
  static const auto piece_keys = keys_of(std::array{"rank", "len"});
  std::array<PyObject*, 1> doc{};
  std::array<PyObject*, 2> piece{};
  if (!dict_fields(o, document_keys, doc) || !doc[0] || !PyList_CheckExact(doc[0])) return false;
  pieces.resize(static_cast<std::size_t>(PyList_GET_SIZE(doc[0])));
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    if (!dict_fields(PyList_GET_ITEM(doc[0], static_cast<Py_ssize_t>(k)), piece_keys, piece) || !piece[0] || !piece[1] ||
        !plain_int(piece[0], pieces[k].rank) || !plain_int(piece[1], pieces[k].len)) {
      return false;
    }
  }
  return true;
}

bool read_packed_batch(PyObject* o, cpdispatch::BalanceProblem& p) {
  if (!PyList_CheckExact(o)) return false;
  p.documents.resize(static_cast<std::size_t>(PyList_GET_SIZE(o)));
  for (std::size_t i = 0; i < p.documents.size(); ++i) {
    if (!read_pieces(PyList_GET_ITEM(o, static_cast<Py_ssize_t>(i)), p.documents[i].pieces)) return false;
  }
  return true;
}

/// "ranks": exactly world_size entries, as the reader requires (the planner
/// would take an empty list for the packed form).
bool read_rank_lengths(PyObject* o, cpdispatch::BalanceProblem& p) {
  if (!PyList_CheckExact(o) || PyList_GET_SIZE(o) != p.world_size) return false;
  static const auto rank_keys = keys_of(std::array{"docs"});
  std::array<PyObject*, 1> rank{};
  p.docs.resize(static_cast<std::size_t>(p.world_size));
  for (std::size_t r = 0; r < p.docs.size(); ++r) {
    if (!dict_fields(PyList_GET_ITEM(o, static_cast<Py_ssize_t>(r)), rank_keys, rank) || !rank[0] || !int_list(rank[0], p.docs[r])) return false;
  }
  return true;
}

/// An optional int field; false when present and not a plain int.
bool optional_int(PyObject* o, std::int64_t& out) { return !o || plain_int(o, out); }

/// The direct read of a balance dict (see above); false: use the JSON reader.
bool read_balance_dict(py::handle input, BalanceInput& out) {
  static const auto batch_keys =
      keys_of(std::array{"world_size", "max_cp_degree", "documents", "ranks", "recv_capacity", "q_bytes", "kv_bytes", "dedup", "mask"});
  std::array<PyObject*, 9> f{};  // in batch_keys' order
  cpdispatch::BalanceProblem& p = out.problem;
  if (!dict_fields(input.ptr(), batch_keys, f) || !f[0] || !f[1] || !plain_int(f[0], p.world_size) || !plain_int(f[1], p.max_cp_degree)) {
    return false;
  }
  if (!optional_int(f[5], p.q_bytes) || !optional_int(f[6], p.kv_bytes) || (f[7] && !PyBool_Check(f[7]))) return false;
  out.options.dedup = f[7] == Py_True;
  if ((f[2] == nullptr) == (f[3] == nullptr) || !(f[2] ? read_packed_batch(f[2], p) : read_rank_lengths(f[3], p))) return false;
  if (f[4] && (!int_list(f[4], p.recv_capacity) || static_cast<std::int64_t>(p.recv_capacity.size()) != p.world_size)) return false;
  if (f[8]) {
    try {
      p.mask = read_mask_field(f[8]);
    } catch (const cpdispatch::invalid_input&) {
      return false;  // the reader names it, after any field it reads first
    }
  }
  out.read_directly = true;
  return true;
}

/// A balance input through the library's JSON reader (dict or JSON text).
BalanceInput read_balance_json(py::handle input, const cpdispatch::PlanLimits& limits) {
  const nlohmann::json j = input_json(input, limits);
  return {cpdispatch::balance_problem_from_json(j), cpdispatch::balance_options_from_json(j), false};
}

BalanceInput read_balance_input(py::handle input, const cpdispatch::PlanLimits& limits) {
  BalanceInput out;
  if (read_balance_dict(input, out)) return out;
  return read_balance_json(input, limits);
}

// ---- the balanced plan as a dict
// Keys and nesting as balanced_plan_to_json writes them, in its (sorted) key
// order, built from the plan: going through nlohmann-json cost several
// times as much.

py::object int_object(std::int64_t v) {
  PyObject* o = PyLong_FromLongLong(v);
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

void set_item(py::dict& d, PyObject* key, const py::object& value) {
  if (PyDict_SetItem(d.ptr(), key, value.ptr()) != 0) throw py::error_already_set();
}

py::list int_list_of(const std::vector<std::int64_t>& values) {
  py::list out(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), int_object(values[i]).release().ptr());
  return out;
}

template <fields::Tabled S>
py::dict struct_dict(const S& s);

py::object python_value(std::int64_t v) { return int_object(v); }
py::object python_value(const std::optional<std::int64_t>& v) { return v ? int_object(*v) : py::none(); }
py::object python_value(bool v) { return py::bool_(v); }
py::object python_value(const cpdispatch::AttentionMask& mask) { return to_python(cpdispatch::detail::mask_to_json(mask)); }

template <class T>
py::object python_value(const std::vector<T>& items) {
  if constexpr (!fields::Tabled<T>) {
    return int_list_of(items);
  } else {
    py::list out(items.size());
    for (std::size_t i = 0; i < items.size(); ++i) PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), struct_dict(items[i]).release().ptr());
    return out;
  }
}

template <class S>
void write_field(py::dict& d, PyObject* key, const fields::Tag& tag, const S&) {
  set_item(d, key, py::str(tag.value.data(), tag.value.size()));
}

template <class S, class T>
void write_field(py::dict& d, PyObject* key, const fields::Field<S, T>& f, const S& s) {
  if (!fields::is_default(s, f)) set_item(d, key, python_value(s.*f.member));
}

/// The keys the JSON writer writes by hand rather than from the tables
/// (io/fields.hpp says why), last: a document's "slices" (section 2e) and
/// "head_parallel", a documents-form plan's "head_parallel_degree" (section
/// 2f), each only when set. Other structs have none.
template <class S>
void add_extra_keys(py::dict&, const S&) {}

void add_extra_keys(py::dict& d, const cpdispatch::PackedDocument& doc) {
  if (!doc.slices.empty()) d["slices"] = to_python(cpdispatch::detail::slices_json(doc.slices));
  if (doc.head_parallel) d["head_parallel"] = py::bool_(true);
}

void add_extra_keys(py::dict& d, const cpdispatch::QkvDocumentsPlan& plan) {
  if (plan.head_parallel_degree != 0) d["head_parallel_degree"] = int_object(plan.head_parallel_degree);
}

/// S as the dict json.loads makes of the JSON writer's object: the same keys
/// (optional ones at their default left out), in its sorted order.
template <fields::Tabled S>
py::dict struct_dict(const S& s) {
  static constexpr auto order = fields::sorted_order<S>();
  const auto& keys = interned_keys<S>();
  py::dict d;
  for (std::size_t i : order) fields::visit<S>(i, [&](const auto& entry) { write_field(d, keys[i], entry, s); });
  add_extra_keys(d, s);
  return d;
}

/// Python's cycle collector paused while a call builds a tree of new
/// objects: the tree holds no cycle, and tens of thousands of new dicts
/// would otherwise set off collections that scan every object the program has.
/// (PyGC_Disable came with Python 3.10; before it, no pause.)
class CycleCollectorPause {
 public:
#if PY_VERSION_HEX >= 0x030A0000
  CycleCollectorPause() : was_enabled_(PyGC_Disable() != 0) {}
  ~CycleCollectorPause() {
    if (was_enabled_) PyGC_Enable();
  }
#else
  CycleCollectorPause() = default;
#endif
  CycleCollectorPause(const CycleCollectorPause&) = delete;
  CycleCollectorPause& operator=(const CycleCollectorPause&) = delete;

 private:
  [[maybe_unused]] bool was_enabled_ = false;
};

/// A balanced plan (either form) as the dict json.loads makes of balanced_plan_to_json's JSON.
template <class QkvForm>
py::dict balanced_plan_dict(QkvForm p, bool dedup) {
  const CycleCollectorPause pause;
  p.dedup = p.dedup || dedup;
  return struct_dict(p);
}

/// plan_balanced on a balance input; see "the balance input without the JSON detour".
cpdispatch::QkvDocumentsPlan plan_balanced_input(py::handle input, const BalanceInput& in, const cpdispatch::PlanLimits& limits) {
  try {
    return cpdispatch::plan_balanced(in.problem, in.options, limits);
  } catch (const cpdispatch::invalid_input&) {
    if (in.read_directly) read_balance_json(input, limits);  // throws where the reader refuses the input
    throw;
  }
}

/// cpdispatch-plan balance's output for `input`, as the dict json.loads makes
/// of it; `grid` other than 1 replaces the input's "grid" (as --grid does).
py::dict balance(py::handle input, bool dedup, py::handle max_memory, std::int64_t grid) {
  const cpdispatch::PlanLimits limits = limits_of(max_memory);
  BalanceInput in = read_balance_input(input, limits);
  in.options.dedup = in.options.dedup || dedup;
  if (grid != 1) in.options.grid = grid;
  cpdispatch::QkvDocumentsPlan balanced = plan_balanced_input(input, in, limits);
  if (in.problem.docs.empty()) return balanced_plan_dict(std::move(balanced), in.options.dedup);
  return balanced_plan_dict(cpdispatch::to_rank_plan(balanced), in.options.dedup);
}

/// The planners prefix messages with their own name; for a Python caller the
/// field path reads better alone (as in the CLI's messages). The library
/// names its own knob for the budget; here the caller sets max_memory.
std::string python_message(std::string message) {
  constexpr std::string_view knob = "(PlanLimits::max_bytes)";
  if (const auto at = message.find(knob); at != std::string::npos) message.replace(at, knob.size(), "(max_memory)");
  for (std::string_view prefix : {"plan_qkv: ", "plan_query: ", "plan_qkv_for_rank: ", "plan_query_for_rank: ", "plan_kv_wire_for_rank: "}) {
    if (std::string_view(message).starts_with(prefix)) return message.substr(prefix.size());
  }
  return message;
}

}  // namespace

PYBIND11_MODULE(_cpdispatch, m) {
  m.doc() = "cpdispatch's C++ planner (use the cpdispatch package, which documents these functions)";
  // The budget of one call by default: the library's (PlanLimits::max_bytes).
  const py::int_ default_max_memory(cpdispatch::default_plan_max_bytes);
  m.attr("default_max_memory") = default_max_memory;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const cpdispatch::invalid_input& e) {
      PyErr_SetString(PyExc_ValueError, python_message(e.what()).c_str());
    }
  });
  py::class_<ParsedPlan>(m, "ParsedPlan", "A plan read once, for repeated planning calls")
      .def(py::init([](py::handle input, bool dedup, py::handle max_memory) { return parse_plan(input, dedup, limits_of(max_memory)); }),
           py::arg("plan"), py::arg("dedup") = false, py::arg("max_memory") = default_max_memory)
      .def_property_readonly("dedup", [](const ParsedPlan& p) { return p.dedup; })
      .def_property_readonly("world_size", [](const ParsedPlan& p) {
        return std::visit([](const auto& plan) { return plan.world_size; }, p.plan);
      })
      .def_property_readonly("kind", [](const ParsedPlan& p) { return std::string(cpdispatch::plan_kind(p.plan)); });
  py::class_<RankShare>(m, "RankShare", "One rank's share of a plan, planned once: plan_for_rank, token_indices, invariant_layout and stage_plan take it in place of the plan")
      .def(py::init([](py::handle input, std::int64_t rank, bool dedup, py::handle max_memory) {
             const cpdispatch::PlanLimits limits = limits_of(max_memory);
             return with_plan(input, dedup, limits, [&](const ParsedPlan& parsed) { return plan_rank_share(parsed, rank, limits); });
           }),
           py::arg("plan"), py::arg("rank"), py::arg("dedup") = false, py::arg("max_memory") = default_max_memory)
      .def_property_readonly("rank", [](const RankShare& s) { return s.rank; })
      .def_property_readonly("dedup", [](const RankShare& s) { return s.dedup; });
  m.def("plan", &plan, py::arg("plan"), py::arg("dedup") = false, py::arg("max_memory") = default_max_memory);
  m.def("plan_for_rank", &plan_for_rank, py::arg("plan"), py::arg("rank"), py::arg("dedup") = false, py::arg("max_memory") = default_max_memory);
  m.def("token_indices", &token_indices, py::arg("plan"), py::arg("rank"), py::arg("dedup") = false, py::arg("max_memory") = default_max_memory);
  m.def("balance", &balance, py::arg("batch"), py::arg("dedup") = false, py::arg("max_memory") = default_max_memory, py::arg("grid") = 1);
  m.def("position_ids", &position_ids, py::arg("plan"), py::arg("rank"), py::arg("max_memory") = default_max_memory);
  m.def("invariant_layout", &invariant_layout, py::arg("plan"), py::arg("rank"), py::arg("dedup") = false, py::arg("grid") = 64,
        py::arg("max_memory") = default_max_memory);
  m.def("stage_plan", &stage_plan, py::arg("plan"), py::arg("rank"), py::arg("dedup") = false, py::arg("stages") = 1,
        py::arg("entries") = py::none(), py::arg("max_memory") = default_max_memory);
  m.def("stage_groups", &cpdispatch::detail::stage_groups, py::arg("stages"), py::arg("world_size"),
        "The stage groups of a step in `stages` stages on `world_size` ranks, as the op counts them: min(stages - 1, world_size - 1)");
  m.def("mask_band", &mask_band, py::arg("mask") = py::none());
  m.def("query_row_passes", &query_row_passes, py::arg("entries"));
  m.def("explicit_entries", &explicit_entries, py::arg("parts"), py::arg("queries"), py::arg("keys"));
  m.def("layout_entries", &layout_entries, py::arg("cu_seqlens_q"), py::arg("cu_seqlens_kv"), py::arg("queries"), py::arg("keys"),
        py::arg("mask") = py::none());
  bind_invariant_kernel(m);
}
