#pragma once
// JSON I/O for plans and metadata (docs/plan-format.md, section 3), on
// nlohmann-json (target cpdispatch::json).
//
// Reading: every malformed input throws cpdispatch::invalid_input naming the
// JSON path of the offending value, e.g.
//   ranks[1].docs[0].dst[2]: expected an integer, got "x"
// The reader checks structure (types, integers, rectangular arrays, shapes,
// known keys); the values themselves (ranges, padding, positivity) are
// checked by plan_query/plan_qkv and Metadata::validate, whose messages use
// the same paths.
//
// Writing: tensors become nested arrays of their shape; absent optional
// fields are null; masks are 0/1 integers.
//
// The QKV plan structs are read and written through their field tables
// (io/fields.hpp), which the Python module's dict conversion walks too.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/any_plan.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/io/fields.hpp"
#include "cpdispatch/plan/limits.hpp"
#include "cpdispatch/plan/metadata.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "cpdispatch/plan/topology.hpp"
#include "cpdispatch/tensor.hpp"

namespace cpdispatch {

namespace detail {

using json = nlohmann::json;

/// A JSON path built on the stack while reading, turned into text only for an
/// error message. A child refers to its parent: keep children as temporaries
/// or as locals that do not outlive the parent.
class JsonPath {
 public:
  /// The document itself, called `label` in messages about it as a whole;
  /// its members print without a prefix (`ranks[1]`, not `plan.ranks[1]`).
  static JsonPath root(std::string_view label) { return JsonPath(nullptr, Kind::root, label, 0); }

  JsonPath operator/(std::string_view key) const { return JsonPath(this, Kind::key, key, 0); }
  JsonPath operator[](std::size_t index) const { return JsonPath(this, Kind::index, {}, index); }

  std::string str() const {
    if (kind_ == Kind::root) return std::string(name_);
    std::string out;
    append(out);
    return out;
  }

 private:
  enum class Kind { root, key, index };
  JsonPath(const JsonPath* parent, Kind kind, std::string_view name, std::size_t index)
      : parent_(parent), kind_(kind), name_(name), index_(index) {}

  void append(std::string& out) const {
    if (kind_ == Kind::root) return;
    parent_->append(out);
    if (kind_ == Kind::index) {
      out += '[' + std::to_string(index_) + ']';
    } else {
      if (!out.empty()) out += '.';
      out += name_;
    }
  }

  const JsonPath* parent_;
  Kind kind_;
  std::string_view name_;
  std::size_t index_;
};

template <class... Args>
[[noreturn]] void fail_at(const JsonPath& path, Args&&... args) {
  fail(path.str(), std::forward<Args>(args)...);
}

/// A value as a message shows it: short scalars verbatim, containers by kind.
inline std::string describe(const json& j) {
  if (j.is_array()) return j.empty() ? "an empty array" : "an array";
  if (j.is_object()) return j.empty() ? "an empty object" : "an object";
  std::string s = j.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 40) {
    std::size_t cut = 37;
    while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // not inside a UTF-8 character
    s.resize(cut);
    s += "...";
  }
  return s;
}

inline std::string entries(std::size_t n) { return std::to_string(n) + (n == 1 ? " entry" : " entries"); }

inline std::int64_t read_int(const json& j, const JsonPath& path) {
  if (j.is_number_unsigned()) {
    const auto v = j.get<std::uint64_t>();
    if (v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      fail_at(path, ": ", v, " is outside the 64-bit signed integer range");
    }
    return static_cast<std::int64_t>(v);
  }
  if (j.is_number_integer()) return j.get<std::int64_t>();
  fail_at(path, ": expected an integer, got ", describe(j));
}

inline bool read_bool(const json& j, const JsonPath& path) {
  if (!j.is_boolean()) fail_at(path, ": expected true or false, got ", describe(j));
  return j.get<bool>();
}

inline const json& read_array(const json& j, const JsonPath& path) {
  if (!j.is_array()) fail_at(path, ": expected an array, got ", describe(j));
  return j;
}

inline const json& read_object(const json& j, const JsonPath& path) {
  if (!j.is_object()) fail_at(path, ": expected an object, got ", describe(j));
  return j;
}

/// The member `key` of the object at `path`; nullptr where it is absent or
/// null and `required` is false.
inline const json* member(const json& obj, const JsonPath& path, std::string_view key, bool required) {
  const auto it = obj.find(key);
  if (it == obj.end() || (!required && it->is_null())) {
    if (required) fail_at(path, ": missing \"", key, '"');
    return nullptr;
  }
  return &*it;
}

/// Rejects keys outside `allowed` (and `unlisted`, accepted but left out of
/// the message), so that a misspelt optional key is an error rather than
/// silently ignored.
inline void check_keys(const json& obj, const JsonPath& path, std::string_view what, std::span<const std::string_view> allowed,
                       std::span<const std::string_view> unlisted = {}) {
  for (const auto& item : obj.items()) {
    bool known = false;
    for (std::string_view a : allowed) known = known || item.key() == a;
    for (std::string_view a : unlisted) known = known || item.key() == a;
    if (known) continue;
    std::string list;
    for (std::string_view a : allowed) list += (list.empty() ? "\"" : ", \"") + std::string(a) + '"';
    fail_at(path, ": unknown key ", json(item.key()).dump(-1, ' ', false, json::error_handler_t::replace), " (", what,
            " has ", list, ')');
  }
}

inline void check_keys(const json& obj, const JsonPath& path, std::string_view what, std::initializer_list<std::string_view> allowed) {
  check_keys(obj, path, what, std::span<const std::string_view>(allowed.begin(), allowed.size()));
}

/// The required length of one axis of a tensor being read, with the reason
/// messages give; no length: take it from the first array on that axis.
struct Extent {
  std::optional<std::size_t> length;
  std::string_view why = {};
};

/// Reads a rectangular nested array of integers with `extents.size()` (1 to
/// 3) dimensions. Every length is checked against the JSON before anything
/// of that size is allocated.
inline Tensor<std::int64_t> read_tensor(const json& j, const JsonPath& path, const std::vector<Extent>& extents) {
  const std::size_t dim = extents.size();
  std::vector<std::size_t> shape(dim, 0);
  const json* first = &j;  // walks j[0][0]..: the arrays unfixed lengths come from
  for (std::size_t a = 0; a < dim; ++a) {
    const bool has_first = first != nullptr && first->is_array();
    shape[a] = extents[a].length ? *extents[a].length : has_first ? first->size() : 0;
    first = has_first && !first->empty() ? &first->front() : nullptr;
  }
  std::vector<std::int64_t> values;
  auto fill = [&](auto& self, const json& node, const JsonPath& p, std::size_t axis) -> void {
    read_array(node, p);
    if (node.size() != shape[axis]) {
      if (extents[axis].length) {
        fail_at(p, " has ", entries(node.size()), ", expected ", shape[axis], " (", extents[axis].why, ')');
      }
      std::string first_path = path.str();
      for (std::size_t a = 0; a < axis; ++a) first_path += "[0]";
      fail_at(p, " has ", entries(node.size()), ", but ", first_path, " has ", shape[axis], " (arrays must be rectangular)");
    }
    for (std::size_t i = 0; i < node.size(); ++i) {
      if (axis + 1 == dim) {
        values.push_back(read_int(node[i], p[i]));
      } else {
        self(self, node[i], p[i], axis + 1);
      }
    }
  };
  fill(fill, j, path, 0);
  // The JSON holds exactly prod(shape) integers now (or an axis is empty), so
  // the product cannot overflow.
  Tensor<std::int64_t> out(shape);
  std::copy(values.begin(), values.end(), out.data());
  return out;
}

inline std::vector<std::int64_t> read_int_vector(const json& j, const JsonPath& path) {
  read_array(j, path);
  std::vector<std::int64_t> out;
  out.reserve(j.size());
  for (std::size_t i = 0; i < j.size(); ++i) out.push_back(read_int(j[i], path[i]));
  return out;
}

/// An array of integer arrays, possibly ragged (the attention layout's rows).
inline std::vector<std::vector<std::int64_t>> read_int_rows(const json& j, const JsonPath& path) {
  read_array(j, path);
  std::vector<std::vector<std::int64_t>> out;
  out.reserve(j.size());
  for (std::size_t i = 0; i < j.size(); ++i) out.push_back(read_int_vector(j[i], path[i]));
  return out;
}

/// The integer member `key` of the object at `root`, at least `min`;
/// `fallback` when it is absent and not `required`.
inline std::int64_t read_int_at_least(const json& j, const JsonPath& root, std::string_view key, std::int64_t min, bool required,
                                      std::int64_t fallback) {
  const json* v = member(j, root, key, required);
  if (!v) return fallback;
  const JsonPath path = root / key;
  const std::int64_t x = read_int(*v, path);
  if (x < min) fail_at(path, " = ", x, " must be at least ", min);
  return x;
}

/// Whether the array at `j` nests at least three deep (j[0][0] is an array).
inline bool is_3d(const json& j) {
  return j.is_array() && !j.empty() && j.front().is_array() && !j.front().empty() && j.front().front().is_array();
}

inline QueryPlan read_query_plan(const json& obj, const JsonPath& path) {
  if (obj.contains("dedup")) fail_at(path / "dedup", ": deduplication applies to qkv plans (key-value copies); a query plan sends each shard once");
  if (obj.contains("mask")) {
    fail_at(path / "mask", ": an attention mask applies to qkv plans (it decides which key-values each query needs); a query plan has none");
  }
  check_keys(obj, path, "a query plan", {"kind", "world_size", "seq_len", "dispatch"});
  QueryPlan plan;
  plan.world_size = read_int_at_least(obj, path, "world_size", 1, true, 0);
  const auto W = static_cast<std::size_t>(plan.world_size);
  plan.seq_len = read_tensor(*member(obj, path, "seq_len", true), path / "seq_len", {{W, "world_size"}, {}});
  const std::size_t S = plan.seq_len.size(1);
  const json& dispatch = *member(obj, path, "dispatch", true);
  std::vector<Extent> extents = {{W, "world_size"}, {S, "as seq_len"}};
  if (is_3d(dispatch)) extents.push_back({});
  plan.dispatch = read_tensor(dispatch, path / "dispatch", extents);
  return plan;
}

/// {"type": "causal"}, {"type": "full"} or {"type": "sliding_window",
/// "window": w} with w an integer >= 1 (section 2d).
inline AttentionMask read_mask(const json& j, const JsonPath& path) {
  read_object(j, path);
  const JsonPath type_path = path / "type";
  const json& type = *member(j, path, "type", true);
  const char* expected = "expected \"causal\", \"full\" or \"sliding_window\"";
  if (!type.is_string()) fail_at(type_path, ": ", expected, ", got ", describe(type));
  const std::string name = type.get<std::string>();
  if (name == "causal" || name == "full") {
    check_keys(j, path, ("a " + name + " mask").c_str(), {"type"});
    return name == "full" ? AttentionMask::full() : AttentionMask::causal();
  }
  if (name != "sliding_window") fail_at(type_path, ": unknown mask type ", describe(type), "; ", expected);
  check_keys(j, path, "a sliding_window mask", {"type", "window"});
  const JsonPath window_path = path / "window";
  const json* window = member(j, path, "window", false);
  if (!window) fail_at(path, ": a sliding_window mask needs \"window\" (the tokens a query sees, itself included)");
  const std::int64_t w = read_int(*window, window_path);
  if (w < 1) fail_at(window_path, " = ", w, " must be at least 1 (a query sees at least itself)");
  return AttentionMask::sliding_window(w);
}

/// "mask" of a plan or balance input: causal when absent.
inline AttentionMask read_plan_mask(const json& obj, const JsonPath& path) {
  const json* m = member(obj, path, "mask", false);
  return m ? read_mask(*m, path / "mask") : AttentionMask::causal();
}

inline json mask_to_json(const AttentionMask& mask) {
  switch (mask.type) {
    case MaskType::full: return {{"type", "full"}};
    case MaskType::sliding_window: return {{"type", "sliding_window"}, {"window", mask.window}};
    case MaskType::causal: break;
  }
  return {{"type", "causal"}};
}

// ---- the plan format's tables (io/fields.hpp) as JSON

template <fields::Tabled S>
S read_struct(const json& j, const JsonPath& path);

/// A length rule of S's table: fails at `path` when its `n` entries break it.
template <fields::Tabled S>
void check_length(const S& s, std::string_view of, std::size_t n, const JsonPath& path) {
  if (of.empty()) return;
  const std::optional<fields::Bound> bound = fields::bound_of(s, of);
  if (!bound || bound->value == n) return;
  if (bound->is_size) fail_at(path, " has ", entries(n), ", but ", of, " has ", bound->value);
  fail_at(path, " has ", entries(n), ", but ", of, " = ", bound->value);
}

inline void read_value(const json& j, const JsonPath& path, std::int64_t& out, const fields::Rule& rule) {
  out = read_int(j, path);
  if (out < rule.at_least) fail_at(path, " = ", out, " must be at least ", rule.at_least);
}

inline void read_value(const json& j, const JsonPath& path, std::optional<std::int64_t>& out, const fields::Rule& rule) {
  read_value(j, path, out.emplace(), rule);
}

inline void read_value(const json& j, const JsonPath& path, bool& out, const fields::Rule&) { out = read_bool(j, path); }

inline void read_value(const json& j, const JsonPath& path, AttentionMask& out, const fields::Rule&) { out = read_mask(j, path); }

/// An array, whose length the caller has checked; its items by their own rules.
template <class T>
void read_value(const json& j, const JsonPath& path, std::vector<T>& out, const fields::Rule&) {
  out.resize(j.size());
  for (std::size_t i = 0; i < j.size(); ++i) {
    if constexpr (fields::Tabled<T>) {
      out[i] = read_struct<T>(j[i], path[i]);
    } else {
      read_value(j[i], path[i], out[i], fields::Rule{});
    }
  }
}

/// A fixed key's value, where present: checked, not stored.
template <class S>
void read_field(const json& obj, const JsonPath& path, const fields::Tag& tag, S&) {
  const json* v = member(obj, path, tag.key, false);
  if (v && !(v->is_string() && v->get_ref<const std::string&>() == tag.value)) {
    fail_at(path / tag.key, ": expected \"", tag.value, "\", got ", describe(*v));
  }
}

template <class S, class T>
void read_field(const json& obj, const JsonPath& path, const fields::Field<S, T>& f, S& out) {
  const json* v = member(obj, path, f.key, f.rule.required);
  if (!v) return;  // absent or null: the member keeps its default
  const JsonPath p = path / f.key;
  if constexpr (fields::is_vector<T>) check_length(out, f.rule.length_of, read_array(*v, p).size(), p);
  read_value(*v, p, out.*f.member, f.rule);
}

// ---- section 2e's slices: read and written by hand (io/fields.hpp says why)

/// [a, b]: a slice's query or key range, two integers (the planner checks the values).
inline std::pair<std::int64_t, std::int64_t> read_range(const json& j, const JsonPath& path) {
  read_array(j, path);
  if (j.size() != 2) fail_at(path, " has ", entries(j.size()), ", expected 2 ([begin, end), document positions)");
  return {read_int(j[0], path[0]), read_int(j[1], path[1])};
}

/// "full", "causal", "inv_causal" or "bi_causal".
inline SliceType read_slice_type(const json& j, const JsonPath& path) {
  const char* expected = "expected \"full\", \"causal\", \"inv_causal\" or \"bi_causal\"";
  if (!j.is_string()) fail_at(path, ": ", expected, ", got ", describe(j));
  for (SliceType type : {SliceType::full, SliceType::causal, SliceType::inv_causal, SliceType::bi_causal}) {
    if (j.get_ref<const std::string&>() == to_string(type)) return type;
  }
  fail_at(path, ": unknown slice type ", describe(j), "; ", expected);
}

/// {"q": [qa, qb], "k": [ka, kb], "type": ...}.
inline AttentionSlice read_slice(const json& j, const JsonPath& path) {
  read_object(j, path);
  check_keys(j, path, "a slice", {"q", "k", "type"});
  AttentionSlice s;
  std::tie(s.q_begin, s.q_end) = read_range(*member(j, path, "q", true), path / "q");
  std::tie(s.k_begin, s.k_end) = read_range(*member(j, path, "k", true), path / "k");
  s.type = read_slice_type(*member(j, path, "type", true), path / "type");
  return s;
}

/// A document's optional "slices": absent or null keeps the plan's mask; an
/// empty list is refused, so that a list emptied by mistake is not silently
/// read as "the plan's mask".
inline void read_extra_keys(const json& obj, const JsonPath& path, PackedDocument& doc) {
  const json* list = member(obj, path, "slices", false);
  if (!list) return;
  const JsonPath p = path / "slices";
  read_array(*list, p);
  if (list->empty()) fail_at(p, ": an empty list; leave \"slices\" out for the plan's mask (section 2e)");
  doc.slices.reserve(list->size());
  for (std::size_t i = 0; i < list->size(); ++i) doc.slices.push_back(read_slice((*list)[i], p[i]));
}

/// A plan's optional "head_parallel_degree" (section 2f; plan_qkv checks its value).
inline void read_extra_keys(const json& obj, const JsonPath& path, QkvDocumentsPlan& plan) {
  if (const json* u = member(obj, path, "head_parallel_degree", false)) plan.head_parallel_degree = read_int(*u, path / "head_parallel_degree");
}

template <class S>
void read_extra_keys(const json&, const JsonPath&, S&) {}

/// A document's optional "head_parallel" (section 2f), true or false.
inline void read_head_parallel(const json& obj, const JsonPath& path, PackedDocument& doc) {
  if (const json* hp = member(obj, path, "head_parallel", false)) doc.head_parallel = read_bool(*hp, path / "head_parallel");
}

/// A head-parallel document's shards need no "dst" (section 2f): where it is
/// missing or null it reads as -1. Other objects are read as they are.
inline const json& with_default_dst(const json& obj, json& patched) {
  const auto hp = obj.find("head_parallel");
  const auto shards = obj.find("shards");
  if (hp == obj.end() || *hp != json(true) || shards == obj.end() || !shards->is_array()) return obj;
  patched = obj;
  for (json& shard : patched["shards"]) {
    if (shard.is_object() && (!shard.contains("dst") || shard["dst"].is_null())) shard["dst"] = -1;
  }
  return patched;
}

/// A per-rank document has no slices: they need the documents form (a
/// message of its own rather than "unknown key").
inline void reject_misplaced_keys(const json& obj, const JsonPath& path, const Document&) {
  if (obj.contains("slices")) {
    fail_at(path / "slices", ": slices exist only in the documents form (\"documents\": [{\"shards\": [...], \"slices\": [...]}], section 2e)");
  }
}

template <class S>
void reject_misplaced_keys(const json&, const JsonPath&, const S&) {}

/// Keys an object of S may have beyond its table's: a document's "slices"
/// and "head_parallel", a documents-form plan's "head_parallel_degree".
/// Messages about unknown keys name the table's keys only, as they always have.
inline constexpr std::array<std::string_view, 2> document_extra_keys{"slices", "head_parallel"};
inline constexpr std::array<std::string_view, 1> documents_plan_extra_keys{"head_parallel_degree"};

template <class S>
constexpr std::span<const std::string_view> extra_keys() {
  if constexpr (std::is_same_v<S, PackedDocument>) return document_extra_keys;
  if constexpr (std::is_same_v<S, QkvDocumentsPlan>) return documents_plan_extra_keys;
  return {};
}

/// The members of S from the object at `path`: its keys checked, then each
/// field in table order, then the keys read by hand.
template <fields::Tabled S>
void read_fields(const json& obj, const JsonPath& path, S& out) {
  reject_misplaced_keys(obj, path, out);
  static constexpr auto keys = fields::keys<S>();
  check_keys(obj, path, fields::Table<S>::what, keys, extra_keys<S>());
  json patched;
  const json& read = [&]() -> const json& {
    if constexpr (std::is_same_v<S, PackedDocument>) {
      read_head_parallel(obj, path, out);
      return with_default_dst(obj, patched);
    }
    return obj;
  }();
  fields::for_each<S>([&](const auto& entry) { read_field(read, path, entry, out); });
  read_extra_keys(obj, path, out);
}

template <fields::Tabled S>
S read_struct(const json& j, const JsonPath& path) {
  S out;
  read_fields(read_object(j, path), path, out);
  return out;
}

template <fields::Tabled S>
json struct_json(const S& s);

/// A document's slices as the plan format writes them.
inline json slices_json(const std::vector<AttentionSlice>& slices) {
  json out = json::array();
  for (const AttentionSlice& s : slices) {
    out.push_back({{"q", {s.q_begin, s.q_end}}, {"k", {s.k_begin, s.k_end}}, {"type", to_string(s.type)}});
  }
  return out;
}

inline json value_json(std::int64_t v) { return v; }
inline json value_json(const std::optional<std::int64_t>& v) { return v ? json(*v) : json(nullptr); }
inline json value_json(bool v) { return v; }
inline json value_json(const AttentionMask& mask) { return mask_to_json(mask); }

template <class T>
json value_json(const std::vector<T>& items) {
  if constexpr (fields::Tabled<T>) {
    json out = json::array();
    for (const T& item : items) out.push_back(struct_json(item));
    return out;
  } else {
    return items;
  }
}

template <class S>
void write_field(json& j, const fields::Tag& tag, const S&) {
  j[std::string(tag.key)] = tag.value;
}

template <class S, class T>
void write_field(json& j, const fields::Field<S, T>& f, const S& s) {
  if (!fields::is_default(s, f)) j[std::string(f.key)] = value_json(s.*f.member);
}

/// S as an object of its table's keys; optional fields at their default are
/// left out, so a causal plan's JSON stays as it always was.
template <fields::Tabled S>
json struct_json(const S& s) {
  json j = json::object();
  fields::for_each<S>([&](const auto& entry) { write_field(j, entry, s); });
  if constexpr (std::is_same_v<S, PackedDocument>) {
    if (!s.slices.empty()) j["slices"] = slices_json(s.slices);  // left out otherwise, so plans without slices read as before
    if (s.head_parallel) j["head_parallel"] = true;              // likewise for section 2f
  }
  if constexpr (std::is_same_v<S, QkvDocumentsPlan>) {
    if (s.head_parallel_degree != 0) j["head_parallel_degree"] = s.head_parallel_degree;
  }
  return j;
}

template <class T>
json tensor_to_json(const Tensor<T>& t) {
  auto value = [](T v) { return static_cast<std::int64_t>(v); };
  json out = json::array();
  if (t.empty()) return out;
  const std::size_t n0 = t.size(0), n1 = t.size(1), n2 = t.size(2);
  for (std::size_t i = 0; i < n0; ++i) {
    if (t.dim() == 1) {
      out.push_back(value(t(i)));
      continue;
    }
    json row = json::array();
    for (std::size_t j = 0; j < n1; ++j) {
      if (t.dim() == 2) {
        row.push_back(value(t(i, j)));
        continue;
      }
      json cell = json::array();
      for (std::size_t k = 0; k < n2; ++k) cell.push_back(value(t(i, j, k)));
      row.push_back(std::move(cell));
    }
    out.push_back(std::move(row));
  }
  return out;
}

/// One line for `j` if it fits in `budget` characters (", " between items);
/// false as soon as it does not.
inline bool one_line(const json& j, std::size_t budget, std::string& line) {
  if (j.is_object()) return j.empty() ? (line += "{}", line.size() <= budget) : false;
  if (!j.is_array()) {
    line += j.dump(-1, ' ', false, json::error_handler_t::replace);
    return line.size() <= budget;
  }
  line += '[';
  bool first = true;
  for (const json& item : j) {
    if (!first) line += ", ";
    first = false;
    if (line.size() > budget || !one_line(item, budget, line)) return false;
  }
  line += ']';
  return line.size() <= budget;
}

/// Writes `j` starting at column `column`; nested lines are indented by
/// `indent` + 2.
inline void write_pretty(const json& j, std::size_t indent, std::size_t column, std::size_t width, std::string& out) {
  std::string line;
  if (!j.is_structured()) {
    out += j.dump(-1, ' ', false, json::error_handler_t::replace);
    return;
  }
  if (j.is_array() && column < width && one_line(j, width - column, line)) {
    out += line;
    return;
  }
  if (j.empty()) {
    out += j.is_object() ? "{}" : "[]";
    return;
  }
  const std::string pad(indent + 2, ' ');
  out += j.is_object() ? "{\n" : "[\n";
  bool first = true;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (!first) out += ",\n";
    first = false;
    out += pad;
    std::size_t key_width = 0;
    if (j.is_object()) {
      const std::string key = json(it.key()).dump(-1, ' ', false, json::error_handler_t::replace) + ": ";
      out += key;
      key_width = key.size();
    }
    write_pretty(*it, indent + 2, indent + 2 + key_width, width, out);
  }
  out += '\n' + std::string(indent, ' ') + (j.is_object() ? '}' : ']');
}

}  // namespace detail

// ---------------------------------------------------------------- reading

/// Parses JSON text; a syntax error throws invalid_input ("invalid JSON: parse
/// error at line 1, column 5: ..."), and so does a text whose parsed form
/// would exceed `limits` or that nests deeper than it allows (checked
/// before parsing).
inline nlohmann::json parse_json(std::string_view text, const PlanLimits& limits = {}) {
  detail::check_json_text(text, limits);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // parse_error, and out_of_range for numbers like 1e999
    std::string what = e.what();
    if (const auto end = what.find("] "); what.rfind("[json.exception.", 0) == 0 && end != std::string::npos) {
      what.erase(0, end + 2);
    }
    detail::fail("invalid JSON: ", what);
  }
}

namespace detail {

/// "query" or "qkv": the "kind" member, or what the plan's keys imply.
inline std::string plan_kind_of(const json& j, const JsonPath& root) {
  if (const json* k = member(j, root, "kind", false)) {
    if (!k->is_string() || (*k != "query" && *k != "qkv")) {
      fail_at(root / "kind", ": expected \"query\" or \"qkv\", got ", describe(*k));
    }
    return k->get<std::string>();
  }
  const bool has_qkv = j.contains("ranks") || j.contains("documents"), has_seq_len = j.contains("seq_len");
  if (has_qkv && has_seq_len) {
    fail_at(root, ": has both \"", j.contains("ranks") ? "ranks" : "documents", "\" (qkv plan) and \"seq_len\" (query plan); set \"kind\"");
  }
  if (!has_qkv && !has_seq_len) {
    fail_at(root, ": cannot tell its kind: expected \"ranks\" or \"documents\" (qkv plan), \"seq_len\" (query plan) or \"kind\"");
  }
  return has_qkv ? "qkv" : "query";
}

}  // namespace detail

/// A plan from its JSON document (docs/plan-format.md, section 3). A QKV
/// plan has `ranks` (per-rank form) or `documents` (documents form), never both.
inline Plan plan_from_json(const nlohmann::json& j) {
  using detail::fail_at;
  const auto root = detail::JsonPath::root("plan");
  detail::read_object(j, root);
  if (j.contains("ranks_per_node") || j.contains("nodes")) {  // the network's shape (topology_from_json), not part of the plan
    nlohmann::json plan = j;
    plan.erase("ranks_per_node");
    plan.erase("nodes");
    return plan_from_json(plan);
  }
  if (detail::plan_kind_of(j, root) == "query") return detail::read_query_plan(j, root);
  const bool has_ranks = j.contains("ranks"), has_documents = j.contains("documents");
  if (has_ranks && has_documents) fail_at(root, ": has both \"ranks\" and \"documents\" (a qkv plan has one of them)");
  if (has_documents) {
    QkvDocumentsPlan plan;
    detail::read_fields(j, root, plan);
    return plan;
  }
  if (!has_ranks) fail_at(root, ": missing \"ranks\" or \"documents\" (a qkv plan has one of them)");
  QkvPlan plan;
  detail::read_fields(j, root, plan);
  return plan;
}

/// A plan from JSON text.
inline Plan parse_plan(std::string_view text) { return plan_from_json(parse_json(text)); }

/// Whether a plan's JSON asks for the deduplicated KV exchange ("dedup": true,
/// docs/plan-format.md section 2c); false when the key is absent.
inline bool dedup_requested(const nlohmann::json& j) {
  const auto root = detail::JsonPath::root("plan");
  const nlohmann::json* d = j.is_object() ? detail::member(j, root, "dedup", false) : nullptr;
  return d && detail::read_bool(*d, root / "dedup");
}

/// The topology of a plan or a balance input (docs/node-exchange.md):
/// `"ranks_per_node": n` (rank r on node r / n) or `"nodes": [node of each
/// rank]`, never both; nullopt when neither is given. `root_label` names the
/// document in messages ("plan", "input").
inline std::optional<Topology> topology_from_json(const nlohmann::json& j, std::int64_t world_size, std::string_view root_label = "plan") {
  using detail::fail_at;
  const auto root = detail::JsonPath::root(root_label);
  if (!j.is_object()) return std::nullopt;
  const nlohmann::json* per_node = detail::member(j, root, "ranks_per_node", false);
  const nlohmann::json* nodes = detail::member(j, root, "nodes", false);
  if (per_node && nodes) fail_at(root, ": has both \"ranks_per_node\" and \"nodes\" (a topology is one of them)");
  if (per_node) return Topology::uniform(world_size, detail::read_int_at_least(j, root, "ranks_per_node", 1, true, 0));
  if (!nodes) return std::nullopt;
  const auto path = root / "nodes";
  std::vector<std::int64_t> of = detail::read_int_vector(*nodes, path);
  if (of.size() != static_cast<std::size_t>(world_size)) fail_at(path, " has ", detail::entries(of.size()), ", but world_size = ", world_size);
  for (std::size_t r = 0; r < of.size(); ++r) {
    if (of[r] < 0 || of[r] >= world_size) fail_at(path[r], " = ", of[r], " is outside [0, ", world_size, ")");
  }
  try {
    return Topology::from_nodes(std::move(of));
  } catch (const invalid_input& e) {  // a node number that skips one
    fail_at(path, ": ", e.what());
  }
}

/// Metadata from the object to_json writes. `name` is its path in messages
/// (e.g. "kv_rev", giving `kv_rev.dst_rank[0][1]: ...`); empty: the object
/// is the document. Keys beyond the format's are optional: `world_size`,
/// `has_copies`, `num_copies` and `mask_copies` fix shapes that empty arrays
/// leave open and are checked against the arrays. The result has the shapes
/// of the format (detail::check_shapes); call validate() for the full rules.
inline Metadata metadata_from_json(const nlohmann::json& j, std::string_view name = "") {
  using detail::Extent;
  using detail::fail_at;
  using detail::member;
  const auto root = detail::JsonPath::root("metadata");
  const auto named = root / name;
  const detail::JsonPath& path = name.empty() ? root : named;
  detail::read_object(j, path);
  Metadata m;
  const std::int64_t world = detail::read_int_at_least(j, path, "world_size", 1, false, 0);
  std::optional<std::size_t> W;
  if (world > 0) W = static_cast<std::size_t>(world);

  const nlohmann::json& dst_rank = *member(j, path, "dst_rank", true);
  bool copies = detail::is_3d(dst_rank);
  if (const nlohmann::json* h = member(j, path, "has_copies", false)) copies = detail::read_bool(*h, path / "has_copies");
  std::optional<std::size_t> C;
  if (const nlohmann::json* c = member(j, path, "num_copies", false)) {
    const auto p = path / "num_copies";
    const std::int64_t n = detail::read_int(*c, p);
    if (!copies && n != 1) fail_at(p, " = ", n, ", but dst_rank has no copy dimension (expected 1)");
    if (n < 0) fail_at(p, " = ", n, " is negative");
    if (copies) C = static_cast<std::size_t>(n);
  }
  std::vector<Extent> extents = {{W, "world_size"}, {}};
  if (copies) extents.push_back({C, "num_copies"});
  m.dst_rank = detail::read_tensor(dst_rank, path / "dst_rank", extents);
  if (m.dst_rank.size(0) == 0) fail_at(path / "dst_rank", " has no rows (world_size must be at least 1)");
  m.world_size = static_cast<std::int64_t>(m.dst_rank.size(0));
  W = m.dst_rank.size(0);
  const std::size_t S = m.dst_rank.size(1);

  extents.clear();
  for (std::size_t extent : m.dst_rank.shape()) extents.push_back({extent, "as dst_rank"});
  m.dst_offset = detail::read_tensor(*member(j, path, "dst_offset", true), path / "dst_offset", extents);
  m.seq_len = detail::read_tensor(*member(j, path, "seq_len", true), path / "seq_len", {{W, "world_size"}, {S, "as dst_rank"}});
  m.num_recv_tokens = detail::read_tensor(*member(j, path, "num_recv_tokens", true), path / "num_recv_tokens",
                                          {{W, "world_size"}, {*W + 1, "world_size + 1"}});
  m.num_seqs = detail::read_tensor(*member(j, path, "num_seqs", true), path / "num_seqs", {{W, "world_size"}});

  const nlohmann::json* mask = member(j, path, "seq_recv_mask", false);
  const nlohmann::json* lens = member(j, path, "recv_seq_lens", false);
  if ((mask == nullptr) != (lens == nullptr)) {
    fail_at(path, ": seq_recv_mask and recv_seq_lens must be both null or both present");
  }
  if (mask) {
    std::optional<std::size_t> mask_c;
    if (const nlohmann::json* c = member(j, path, "mask_copies", false)) {
      const auto p = path / "mask_copies";
      const std::int64_t n = detail::read_int(*c, p);
      if (n < 0) fail_at(p, " = ", n, " is negative");
      mask_c = static_cast<std::size_t>(n);
    }
    m.seq_recv_mask = detail::read_tensor(*mask, path / "seq_recv_mask", {{W, "world_size"}, {}, {mask_c, "mask_copies"}});
    m.recv_seq_lens = detail::read_tensor(*lens, path / "recv_seq_lens",
                                          {{W, "world_size"}, {m.seq_recv_mask->size(1), "as seq_recv_mask"}});
  }
  m.num_total_recv_tokens.resize(*W);
  for (std::size_t d = 0; d < *W; ++d) m.num_total_recv_tokens[d] = m.num_recv_tokens(d, *W);
  detail::check_shapes(m, path.str());
  return m;
}

namespace detail {

/// An entry's band end: an integer, or null for an open end.
inline std::int64_t read_band_end(const json& j, const JsonPath& path, std::int64_t open) {
  return j.is_null() ? open : read_int(j, path);
}

/// [q0, q1, k0, k1, lo, hi] (section 2e), lo and hi null where open.
inline AttentionEntry read_entry(const json& j, const JsonPath& path) {
  read_array(j, path);
  if (j.size() != 6) fail_at(path, " has ", entries(j.size()), ", expected 6 ([q0, q1, k0, k1, lo, hi])");
  const std::int64_t q0 = read_int(j[0], path[0]), q1 = read_int(j[1], path[1]), k0 = read_int(j[2], path[2]), k1 = read_int(j[3], path[3]);
  if (q0 < 0 || q1 < q0) fail_at(path, ": rows [", q0, ", ", q1, ") are not a range (0 <= q0 <= q1)");
  if (k0 < 0 || k1 < k0) fail_at(path, ": columns [", k0, ", ", k1, ") are not a range (0 <= k0 <= k1)");
  AttentionEntry e;
  e.q_start = q0;
  e.q_len = q1 - q0;
  e.kv_start = k0;
  e.kv_len = k1 - k0;
  e.band = {read_band_end(j[4], path[4], Band::unbounded_lo), read_band_end(j[5], path[5], Band::unbounded_hi)};
  return e;
}

/// attn.entries: per rank, per query shard (as many as seqlens_q lists), its
/// entries; hp_attn.entries likewise per document (`rows` names "seqlens").
inline std::vector<std::vector<std::vector<AttentionEntry>>> read_entries(const json& j, const JsonPath& path,
                                                                          const std::vector<std::vector<std::int64_t>>& seqlens_q,
                                                                          std::string_view rows = "seqlens_q") {
  read_array(j, path);
  if (j.size() != seqlens_q.size()) fail_at(path, " has ", entries(j.size()), ", but ", rows, " has ", seqlens_q.size());
  std::vector<std::vector<std::vector<AttentionEntry>>> out(j.size());
  for (std::size_t d = 0; d < j.size(); ++d) {
    read_array(j[d], path[d]);
    if (j[d].size() != seqlens_q[d].size()) fail_at(path[d], " has ", entries(j[d].size()), ", but ", rows, "[", d, "] has ", seqlens_q[d].size());
    out[d].resize(j[d].size());
    for (std::size_t q = 0; q < j[d].size(); ++q) {
      const json& list = read_array(j[d][q], path[d][q]);
      for (std::size_t e = 0; e < list.size(); ++e) out[d][q].push_back(read_entry(list[e], path[d][q][e]));
    }
  }
  return out;
}

/// One entry as [q0, q1, k0, k1, lo, hi], open ends null.
inline json entries_json(const AttentionEntry& e) {
  return json::array({e.q_start, e.q_start + e.q_len, e.kv_start, e.kv_start + e.kv_len, e.band.bounded_below() ? json(e.band.lo) : json(nullptr),
                      e.band.bounded_above() ? json(e.band.hi) : json(nullptr)});
}

/// Lists of entries (per query shard or document, and per rank above that) as nested arrays.
template <class T>
json entries_json(const std::vector<T>& rows) {
  json out = json::array();
  for (const T& row : rows) out.push_back(entries_json(row));
  return out;
}

}  // namespace detail

namespace detail {

template <class Layout, class T>
using LayoutFields = std::initializer_list<std::pair<std::string_view, T Layout::*>>;
using IntRows = std::vector<std::vector<std::int64_t>>;

/// A layout's per-rank lists: `rows` (integer lists a rank) and `ints` (an
/// integer a rank), each as long as `ranks` (one of `rows`, key `ranks_key`);
/// then its mask (optional: causal when absent) and entries (optional, one
/// list per item of `ranks`).
template <class Layout>
void read_layout_lists(const json& j, const JsonPath& path, Layout& a, LayoutFields<Layout, IntRows> rows,
                       LayoutFields<Layout, std::vector<std::int64_t>> ints, IntRows Layout::*ranks, std::string_view ranks_key) {
  for (const auto& [key, field] : rows) a.*field = read_int_rows(*member(j, path, key, true), path / key);
  for (const auto& [key, field] : ints) a.*field = read_int_vector(*member(j, path, key, true), path / key);
  a.mask = read_plan_mask(j, path);
  const std::size_t W = (a.*ranks).size();
  const auto check = [&](std::string_view key, std::size_t n) {
    if (n != W) fail_at(path / key, " has ", entries(n), ", but ", ranks_key, " has ", W);
  };
  for (const auto& [key, field] : rows)
    if (field != ranks) check(key, (a.*field).size());
  for (const auto& [key, field] : ints) check(key, (a.*field).size());
  if (const json* e = member(j, path, "entries", false)) a.entries = read_entries(*e, path / "entries", a.*ranks, ranks_key);
}

}  // namespace detail

inline AttentionLayout attention_layout_from_json(const nlohmann::json& j, std::string_view name = "attn") {
  const auto root = detail::JsonPath::root("attention layout");
  const auto named = root / name;
  const detail::JsonPath& path = name.empty() ? root : named;
  detail::read_object(j, path);
  using A = AttentionLayout;
  A a;
  detail::read_layout_lists<A>(j, path, a, {{"seqlens_q", &A::seqlens_q}, {"seqlens_kv", &A::seqlens_kv}, {"cu_seqlens_q", &A::cu_seqlens_q},
                                            {"cu_seqlens_kv", &A::cu_seqlens_kv}},
                               {{"max_seqlen_q", &A::max_seqlen_q}, {"max_seqlen_kv", &A::max_seqlen_kv}}, &A::seqlens_q, "seqlens_q");
  return a;
}

/// Section 2f's hp_attn as to_json writes it.
inline HeadParallelLayout head_parallel_layout_from_json(const nlohmann::json& j, std::string_view name = "hp_attn") {
  const auto root = detail::JsonPath::root("head-parallel layout");
  const auto named = root / name;
  const detail::JsonPath& path = name.empty() ? root : named;
  detail::read_object(j, path);
  detail::check_keys(j, path, "a head-parallel layout", {"degree", "documents", "seqlens", "cu_seqlens", "max_seqlen", "group_rank", "mask", "entries"});
  using A = HeadParallelLayout;
  A a;
  a.degree = detail::read_int(*detail::member(j, path, "degree", true), path / "degree");
  detail::read_layout_lists<A>(j, path, a, {{"documents", &A::documents}, {"seqlens", &A::seqlens}, {"cu_seqlens", &A::cu_seqlens}},
                               {{"max_seqlen", &A::max_seqlen}, {"group_rank", &A::group_rank}}, &A::seqlens, "seqlens");
  return a;
}

/// {"fwd", "rev"} as to_json writes it.
inline QueryMetadata query_metadata_from_json(const nlohmann::json& j) {
  const auto root = detail::JsonPath::root("query metadata");
  detail::read_object(j, root);
  return {metadata_from_json(*detail::member(j, root, "fwd", true), "fwd"),
          metadata_from_json(*detail::member(j, root, "rev", true), "rev")};
}

/// {"q_fwd", "q_rev", "kv_fwd", "kv_rev", "attn"} as to_json writes it.
inline QkvMetadata qkv_metadata_from_json(const nlohmann::json& j) {
  const auto root = detail::JsonPath::root("qkv metadata");
  detail::read_object(j, root);
  QkvMetadata q;
  q.q_fwd = metadata_from_json(*detail::member(j, root, "q_fwd", true), "q_fwd");
  q.q_rev = metadata_from_json(*detail::member(j, root, "q_rev", true), "q_rev");
  q.kv_fwd = metadata_from_json(*detail::member(j, root, "kv_fwd", true), "kv_fwd");
  q.kv_rev = metadata_from_json(*detail::member(j, root, "kv_rev", true), "kv_rev");
  q.attn = attention_layout_from_json(*detail::member(j, root, "attn", true), "attn");
  if (!j.contains("hp_attn") && !j.contains("hp_fwd") && !j.contains("hp_rev")) return q;  // no head-parallel document (section 2f)
  q.hp_fwd = metadata_from_json(*detail::member(j, root, "hp_fwd", true), "hp_fwd");
  q.hp_rev = metadata_from_json(*detail::member(j, root, "hp_rev", true), "hp_rev");
  q.hp_attn = head_parallel_layout_from_json(*detail::member(j, root, "hp_attn", true), "hp_attn");
  return q;
}

// nlohmann-json's adl_serializer hooks: `j.get<cpdispatch::Metadata>()`.
inline void from_json(const nlohmann::json& j, Metadata& m) { m = metadata_from_json(j); }
inline void from_json(const nlohmann::json& j, AttentionLayout& a) { a = attention_layout_from_json(j, ""); }
inline void from_json(const nlohmann::json& j, QueryMetadata& q) { q = query_metadata_from_json(j); }
inline void from_json(const nlohmann::json& j, QkvMetadata& q) { q = qkv_metadata_from_json(j); }

// ---------------------------------------------------------------- writing
// nlohmann-json's adl_serializer hooks: `nlohmann::json j = metadata;`.

namespace detail {

/// The fields of a Metadata object (global or one rank's slice), each
/// already in its JSON shape; an absent mask is null.
struct MetadataFields {
  std::int64_t world_size = 0;
  bool has_copies = false;
  std::size_t num_copies = 1;
  nlohmann::json dst_rank, dst_offset, seq_len, num_recv_tokens, num_seqs;
  nlohmann::json seq_recv_mask, mask_copies, recv_seq_lens;  // null when absent
};

/// The format's keys (absent ones null, masks 0/1) plus world_size,
/// has_copies, num_copies (C, 1 for 2-D) and mask_copies (C of
/// seq_recv_mask, or null): they keep empty shapes exact on a round trip.
inline nlohmann::json metadata_object(MetadataFields f) {
  nlohmann::json j = {{"world_size", f.world_size}, {"has_copies", f.has_copies}, {"num_copies", f.num_copies}};
  for (const auto& [key, value] : {std::pair<const char*, nlohmann::json*>{"dst_rank", &f.dst_rank}, {"dst_offset", &f.dst_offset}, {"seq_len", &f.seq_len},
                                   {"num_recv_tokens", &f.num_recv_tokens}, {"num_seqs", &f.num_seqs}, {"seq_recv_mask", &f.seq_recv_mask},
                                   {"mask_copies", &f.mask_copies}, {"recv_seq_lens", &f.recv_seq_lens}}) {
    j[key] = std::move(*value);
  }
  return j;
}

}  // namespace detail

/// A Metadata object (detail::metadata_object's keys) of the whole plan.
inline void to_json(nlohmann::json& j, const Metadata& m) {
  using detail::tensor_to_json;
  const bool masked = m.seq_recv_mask.has_value();
  j = detail::metadata_object({m.world_size, m.has_copies(), m.num_copies(), tensor_to_json(m.dst_rank), tensor_to_json(m.dst_offset),
                               tensor_to_json(m.seq_len), tensor_to_json(m.num_recv_tokens), tensor_to_json(m.num_seqs),
                               masked ? tensor_to_json(*m.seq_recv_mask) : nlohmann::json(nullptr),
                               masked ? nlohmann::json(m.seq_recv_mask->size(2)) : nlohmann::json(nullptr),
                               m.recv_seq_lens ? tensor_to_json(*m.recv_seq_lens) : nlohmann::json(nullptr)});
}

namespace detail {

/// An attention layout's fields (global: per rank; one rank's: its row).
/// Entries only for a plan with slices: without, the layout reads as it always has.
template <class Layout>
nlohmann::json attention_object(const Layout& a) {
  nlohmann::json j = {{"seqlens_q", a.seqlens_q},       {"seqlens_kv", a.seqlens_kv},     {"cu_seqlens_q", a.cu_seqlens_q},
                      {"cu_seqlens_kv", a.cu_seqlens_kv}, {"max_seqlen_q", a.max_seqlen_q}, {"max_seqlen_kv", a.max_seqlen_kv}};
  j["mask"] = mask_to_json(a.mask);
  if (!a.entries.empty()) j["entries"] = entries_json(a.entries);
  return j;
}

/// A head-parallel layout's fields, likewise.
template <class Layout>
nlohmann::json head_parallel_object(const Layout& a) {
  nlohmann::json j = {{"degree", a.degree},         {"documents", a.documents},   {"seqlens", a.seqlens},
                      {"cu_seqlens", a.cu_seqlens}, {"max_seqlen", a.max_seqlen}, {"group_rank", a.group_rank}};
  j["mask"] = mask_to_json(a.mask);
  if (!a.entries.empty()) j["entries"] = entries_json(a.entries);
  return j;
}

}  // namespace detail

inline void to_json(nlohmann::json& j, const AttentionLayout& a) { j = detail::attention_object(a); }

inline void to_json(nlohmann::json& j, const QueryMetadata& q) { j = {{"fwd", q.fwd}, {"rev", q.rev}}; }

inline void to_json(nlohmann::json& j, const HeadParallelLayout& a) { j = detail::head_parallel_object(a); }

inline void to_json(nlohmann::json& j, const RankHeadParallelLayout& a) { j = detail::head_parallel_object(a); }

inline void to_json(nlohmann::json& j, const QkvMetadata& q) {
  j = {{"q_fwd", q.q_fwd}, {"q_rev", q.q_rev}, {"kv_fwd", q.kv_fwd}, {"kv_rev", q.kv_rev}, {"attn", q.attn}};
  if (q.hp_attn.empty()) return;  // no head-parallel document: the output reads as it always has
  j["hp_fwd"] = q.hp_fwd;
  j["hp_rev"] = q.hp_rev;
  j["hp_attn"] = q.hp_attn;
}

namespace detail {

/// `values` as [n] (one per entry) or [n][copies].
inline nlohmann::json rows_of(const std::vector<std::int64_t>& values, std::size_t copies, bool nested) {
  if (!nested) return values;
  nlohmann::json out = nlohmann::json::array();
  for (std::size_t i = 0; i + copies <= values.size() && copies > 0; i += copies) {
    out.push_back(std::vector<std::int64_t>(values.begin() + static_cast<std::ptrdiff_t>(i),
                                            values.begin() + static_cast<std::ptrdiff_t>(i + copies)));
  }
  return out;
}

}  // namespace detail

/// One rank's slice as the Metadata object of its row: dst_rank and
/// dst_offset [n] or [n][C], seq_len [n], num_recv_tokens the row of W + 1,
/// num_seqs the count, seq_recv_mask [shards][C] and recv_seq_lens [shards]
/// or null; plus rank, world_size, has_copies, num_copies, mask_copies.
inline void to_json(nlohmann::json& j, const RankMetadata& m) {
  const bool masked = m.seq_recv_mask.has_value();
  j = detail::metadata_object({m.world_size, m.has_copies, m.num_copies, detail::rows_of(m.dst_rank, m.num_copies, m.has_copies),
                               detail::rows_of(m.dst_offset, m.num_copies, m.has_copies), m.seq_len, m.num_recv_tokens, m.num_seqs,
                               masked ? detail::rows_of(*m.seq_recv_mask, m.mask_copies, true) : nlohmann::json(nullptr),
                               masked ? nlohmann::json(m.mask_copies) : nlohmann::json(nullptr),
                               m.recv_seq_lens ? nlohmann::json(*m.recv_seq_lens) : nlohmann::json(nullptr)});
  j["rank"] = m.rank;
}

inline void to_json(nlohmann::json& j, const RankAttentionLayout& a) { j = detail::attention_object(a); }

inline void to_json(nlohmann::json& j, const RankQkvMetadata& m) {
  j = {{"rank", m.q_fwd.rank}, {"q_fwd", m.q_fwd}, {"q_rev", m.q_rev}, {"kv_fwd", m.kv_fwd}, {"kv_rev", m.kv_rev}, {"attn", m.attn}};
  if (!m.has_head_parallel()) return;
  j["hp_fwd"] = m.hp_fwd;
  j["hp_rev"] = m.hp_rev;
  j["hp_attn"] = m.hp_attn;
}

inline void to_json(nlohmann::json& j, const RankQueryMetadata& m) { j = {{"rank", m.fwd.rank}, {"fwd", m.fwd}, {"rev", m.rev}}; }

inline nlohmann::json rank_metadata_to_json(const RankPlanMetadata& metadata) {
  return std::visit([](const auto& m) { return nlohmann::json(m); }, metadata);
}

/// Adds "kv_wire_fwd" and "kv_wire_rev" (section 2c) to a QKV metadata object.
inline void add_kv_wire(nlohmann::json& qkv, const KvWireMetadata& wire) {
  qkv["kv_wire_fwd"] = wire.fwd;
  qkv["kv_wire_rev"] = wire.rev;
}

/// Adds one rank's "kv_wire_fwd" and "kv_wire_rev" slices to its share's
/// JSON object (the rows get_slice gives, as for the other slices).
inline void add_kv_wire(nlohmann::json& share, const RankKvWire& wire) {
  share["kv_wire_fwd"] = wire.fwd;
  share["kv_wire_rev"] = wire.rev;
}

/// Rank `rank`'s share of a QKV plan with its slices of the deduplicated
/// exchange, planned without the global metadata (plan_qkv_for_rank and
/// plan_kv_wire_for_rank; one pass for a per-rank plan).
inline nlohmann::json rank_share_with_wire_to_json(const Plan& plan, std::int64_t rank, const PlanLimits& limits = {}) {
  RankQkvMetadata share;
  RankKvWire wire;
  if (const auto* p = std::get_if<QkvPlan>(&plan)) {
    RankPlanWorkspace workspace;
    plan_qkv_for_rank(*p, rank, share, workspace, &wire, limits);
  } else if (const auto* d = std::get_if<QkvDocumentsPlan>(&plan)) {
    share = plan_qkv_for_rank(*d, rank, limits);
    wire = plan_kv_wire_for_rank(*d, rank, limits);
  } else {
    detail::fail("plan_kv_wire_for_rank: deduplication applies to qkv plans (key-value copies); this is a query plan");
  }
  nlohmann::json out = share;
  add_kv_wire(out, wire);
  return out;
}

inline void to_json(nlohmann::json& j, const QueryPlan& p) {
  j = {{"kind", "query"},
       {"world_size", p.world_size},
       {"seq_len", detail::tensor_to_json(p.seq_len)},
       {"dispatch", detail::tensor_to_json(p.dispatch)}};
}

inline void to_json(nlohmann::json& j, const QkvPlan& p) { j = detail::struct_json(p); }

inline void to_json(nlohmann::json& j, const QkvDocumentsPlan& p) { j = detail::struct_json(p); }

inline nlohmann::json plan_to_json(const Plan& plan) {
  return std::visit([](const auto& p) { return nlohmann::json(p); }, plan);
}

inline nlohmann::json metadata_to_json(const PlanMetadata& metadata) {
  return std::visit([](const auto& m) { return nlohmann::json(m); }, metadata);
}

/// Pretty JSON text: objects one key a line, 2-space indent; an array stays on
/// one line while it fits in `width` columns, so rows of a tensor read as rows.
inline std::string to_pretty_string(const nlohmann::json& j, std::size_t width = 100) {
  std::string out;
  detail::write_pretty(j, 0, 0, width, out);
  return out;
}

}  // namespace cpdispatch
