#pragma once
// Element types: the one runtime tag for what a buffer holds, used by the
// typed collectives of every transport, the KV-gradient combine and the
// tensor-parallel layers.

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cpdispatch/float16.hpp"

namespace cpdispatch {

/// What a buffer's elements are (MPI/NCCL-style runtime tag, so transports
/// keep plain non-template members that gMock can mock).
enum class ElementType { int8, uint8, int32, int64, float32, float64, bfloat16, float16 };

/// Bytes of one element.
constexpr std::size_t element_size(ElementType t) noexcept {
  switch (t) {
    case ElementType::int8:
    case ElementType::uint8: return 1;
    case ElementType::bfloat16:
    case ElementType::float16: return 2;
    case ElementType::int32:
    case ElementType::float32: return 4;
    case ElementType::int64:
    case ElementType::float64: return 8;
  }
  return 0;
}

/// The type's name as messages print it ("bfloat16").
constexpr const char* element_name(ElementType t) noexcept {
  switch (t) {
    case ElementType::int8: return "int8";
    case ElementType::uint8: return "uint8";
    case ElementType::int32: return "int32";
    case ElementType::int64: return "int64";
    case ElementType::float32: return "float32";
    case ElementType::float64: return "float64";
    case ElementType::bfloat16: return "bfloat16";
    case ElementType::float16: return "float16";
  }
  return "?";
}

/// True for the floating-point types (sums of them depend on the order).
constexpr bool is_floating(ElementType t) noexcept {
  return t == ElementType::float32 || t == ElementType::float64 || t == ElementType::bfloat16 || t == ElementType::float16;
}

template <class T>
inline constexpr bool has_element_type_v =
    std::is_same_v<T, std::int8_t> || std::is_same_v<T, std::uint8_t> || std::is_same_v<T, std::int32_t> ||
    std::is_same_v<T, std::int64_t> || std::is_same_v<T, float> || std::is_same_v<T, double> ||
    std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>;

/// The ElementType of a C++ element type: `element_type_of<bfloat16>()`.
template <class T>
constexpr ElementType element_type_of() noexcept {
  static_assert(has_element_type_v<T>,
                "cpdispatch: element types are int8_t, uint8_t, int32_t, int64_t, float, double, bfloat16 or float16");
  if constexpr (std::is_same_v<T, std::int8_t>) return ElementType::int8;
  else if constexpr (std::is_same_v<T, std::uint8_t>) return ElementType::uint8;
  else if constexpr (std::is_same_v<T, std::int32_t>) return ElementType::int32;
  else if constexpr (std::is_same_v<T, std::int64_t>) return ElementType::int64;
  else if constexpr (std::is_same_v<T, float>) return ElementType::float32;
  else if constexpr (std::is_same_v<T, double>) return ElementType::float64;
  else if constexpr (std::is_same_v<T, bfloat16>) return ElementType::bfloat16;
  else return ElementType::float16;
}

}  // namespace cpdispatch
