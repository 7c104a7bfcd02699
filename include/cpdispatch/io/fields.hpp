#pragma once
// The fields of the plan format's QKV structs (docs/plan-format.md, section
// 3), one table per struct: each key with its member and the rules a reader
// applies. The JSON reader and writer (io/json.hpp) and the Python module's
// dict conversion walk these tables, so a field is added in one place.
//
// A table lists its keys in the order messages name them and readers read
// them; a rule may refer to a field before it (length_of), never after.

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpdispatch/plan/mask.hpp"
#include "cpdispatch/plan/plan.hpp"

namespace cpdispatch::fields {

/// What a reader checks of one field beyond its type.
struct Rule {
  bool required = true;  ///< absent (or null): a reader fails; else the member keeps its default and a writer omits that default
  std::int64_t at_least = std::numeric_limits<std::int64_t>::min();  ///< integers: the smallest value allowed
  std::string_view length_of = {};  ///< sequences: the earlier field whose value (an integer) or length (a sequence) is this one's length
};

/// One key of a struct: its name in the format and the member holding it.
template <class S, class T>
struct Field {
  using Struct = S;
  using Type = T;
  std::string_view key;
  T S::*member;
  Rule rule;
};

template <class S, class T>
constexpr Field<S, T> field(std::string_view key, T S::*member, Rule rule = {}) {
  return {key, member, rule};
}

/// A key with one allowed value and no member ("kind": "qkv"): optional to
/// read, always written.
struct Tag {
  std::string_view key;
  std::string_view value;
};

/// Table<S>::what names an S in messages ("a shard has ..."); fields lists its keys.
template <class S>
struct Table;

template <>
struct Table<DocumentShard> {
  static constexpr std::string_view what = "a shard";
  static constexpr auto fields =
      std::tuple{field("rank", &DocumentShard::rank), field("len", &DocumentShard::len), field("dst", &DocumentShard::dst)};
};

/// A document's optional "slices" (section 2e) are not in this table: a
/// slice's [qa, qb] and [ka, kb] pairs and its type name have no member of
/// their own, so io/json.hpp reads and writes them by hand (and the Python
/// module, which walks these tables, hands a dict with "slices" to the JSON
/// reader).
template <>
struct Table<PackedDocument> {
  static constexpr std::string_view what = "a document";
  static constexpr auto fields = std::tuple{field("shards", &PackedDocument::shards)};
};

template <>
struct Table<Document> {
  static constexpr std::string_view what = "a document";
  static constexpr auto fields = std::tuple{field("shard_len", &Document::shard_len), field("dst", &Document::dst, {.length_of = "shard_len"})};
};

template <>
struct Table<RankDocuments> {
  static constexpr std::string_view what = "a rank";
  static constexpr auto fields = std::tuple{field("docs", &RankDocuments::docs)};
};

/// The keys both QKV forms share, then the form's own list of work.
template <class Plan, class List>
constexpr auto qkv_plan_fields(std::string_view list_key, List Plan::*list) {
  return std::tuple{Tag{"kind", "qkv"},
                    field("world_size", &Plan::world_size, {.at_least = 1}),
                    field("max_cp_degree", &Plan::max_cp_degree, {.required = false, .at_least = 1}),
                    field("mask", &Plan::mask, {.required = false}),
                    field("dedup", &Plan::dedup, {.required = false}),
                    field(list_key, list, {.length_of = std::is_same_v<Plan, QkvPlan> ? "world_size" : ""})};
}

template <>
struct Table<QkvPlan> {
  static constexpr std::string_view what = "a qkv plan";
  static constexpr auto fields = qkv_plan_fields("ranks", &QkvPlan::ranks);
};

template <>
struct Table<QkvDocumentsPlan> {
  static constexpr std::string_view what = "a qkv plan";
  static constexpr auto fields = qkv_plan_fields("documents", &QkvDocumentsPlan::documents);
};

template <class S>
concept Tabled = requires { Table<S>::fields; };

inline constexpr std::string_view key_of(const Tag& t) { return t.key; }
template <class S, class T>
constexpr std::string_view key_of(const Field<S, T>& f) {
  return f.key;
}

/// Calls `f` on each entry of S's table, in order.
template <Tabled S, class F>
constexpr void for_each(F&& f) {
  std::apply([&](const auto&... entry) { (f(entry), ...); }, Table<S>::fields);
}

/// Calls `f` on entry `i` of S's table.
template <Tabled S, class F>
constexpr void visit(std::size_t i, F&& f) {
  std::size_t at = 0;
  for_each<S>([&](const auto& entry) {
    if (at++ == i) f(entry);
  });
}

template <Tabled S>
inline constexpr std::size_t size = std::tuple_size_v<std::decay_t<decltype(Table<S>::fields)>>;

/// S's keys in table order.
template <Tabled S>
constexpr std::array<std::string_view, size<S>> keys() {
  std::array<std::string_view, size<S>> out{};
  std::size_t i = 0;
  for_each<S>([&](const auto& entry) { out[i++] = key_of(entry); });
  return out;
}

/// The indices of S's table in key order (the order of a JSON object's keys).
template <Tabled S>
constexpr std::array<std::size_t, size<S>> sorted_order() {
  constexpr auto names = keys<S>();
  std::array<std::size_t, size<S>> out{};
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = i;
  for (std::size_t i = 1; i < out.size(); ++i)  // insertion sort: a handful of keys, and constexpr
    for (std::size_t k = i; k > 0 && names[out[k]] < names[out[k - 1]]; --k) std::swap(out[k], out[k - 1]);
  return out;
}

template <class T>
inline constexpr bool is_vector = false;
template <class T>
inline constexpr bool is_vector<std::vector<T>> = true;

/// What a length rule compares with: an integer field's value, or a
/// sequence field's size (is_size).
struct Bound {
  std::size_t value = 0;
  bool is_size = false;
};

/// The bound that field `key` of `s` sets (nullopt where the key names no
/// integer or sequence field).
template <Tabled S>
std::optional<Bound> bound_of(const S& s, std::string_view key) {
  std::optional<Bound> out;
  for_each<S>([&](const auto& entry) {
    if constexpr (!std::is_same_v<std::decay_t<decltype(entry)>, Tag>) {
      using T = typename std::decay_t<decltype(entry)>::Type;
      if (entry.key != key) return;
      if constexpr (std::is_same_v<T, std::int64_t>) out = Bound{static_cast<std::size_t>(s.*entry.member), false};
      if constexpr (is_vector<T>) out = Bound{(s.*entry.member).size(), true};
    }
  });
  return out;
}

/// Whether an optional field holds its default, which writers omit (a
/// sequence is always written: vector's == would not compile for structs
/// without one).
template <class S, class T>
bool is_default(const S& s, const Field<S, T>& f) {
  if constexpr (!is_vector<T>) {
    static const S fresh{};
    return !f.rule.required && s.*f.member == fresh.*f.member;
  } else {
    return false;
  }
}

}  // namespace cpdispatch::fields
