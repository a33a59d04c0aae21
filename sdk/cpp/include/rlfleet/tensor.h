// A dense array in the wire layout of rlfleet.common.v1.Tensor: a dtype, a shape and row-major
// little-endian bytes. Games fill one per tick (observations of N agents) and read one back
// (their actions); the bytes go onto the wire as they are.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "rlfleet/common/v1/tensor.pb.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "rlfleet_gamelink sends element bytes as they are in memory: it needs a little-endian CPU"
#endif

namespace rlfleet {

using DType = rlfleet::common::v1::DType;

// Bytes per element of `dtype`; throws std::invalid_argument for D_TYPE_UNSPECIFIED.
std::size_t itemsize(DType dtype);
// "float32", "int64", ... (the numpy names the server's error messages use).
std::string dtype_name(DType dtype);

// The DType of a C++ element type (float -> D_TYPE_FLOAT32, int64_t -> D_TYPE_INT64, ...).
template <class T>
constexpr DType dtype_of() {
  using common::v1::DType;
  if constexpr (std::is_same_v<T, float>) return DType::D_TYPE_FLOAT32;
  else if constexpr (std::is_same_v<T, double>) return DType::D_TYPE_FLOAT64;
  else if constexpr (std::is_same_v<T, std::int8_t>) return DType::D_TYPE_INT8;
  else if constexpr (std::is_same_v<T, std::int16_t>) return DType::D_TYPE_INT16;
  else if constexpr (std::is_same_v<T, std::int32_t>) return DType::D_TYPE_INT32;
  else if constexpr (std::is_same_v<T, std::int64_t>) return DType::D_TYPE_INT64;
  else if constexpr (std::is_same_v<T, std::uint8_t>) return DType::D_TYPE_UINT8;
  else if constexpr (std::is_same_v<T, std::uint16_t>) return DType::D_TYPE_UINT16;
  else if constexpr (std::is_same_v<T, std::uint32_t>) return DType::D_TYPE_UINT32;
  else if constexpr (std::is_same_v<T, std::uint64_t>) return DType::D_TYPE_UINT64;
  else static_assert(sizeof(T) == 0, "no rlfleet DType for this element type");
}

class Tensor {
 public:
  Tensor() = default;
  // Checks that data holds product(shape) * itemsize(dtype) bytes (std::invalid_argument).
  Tensor(DType dtype, std::vector<std::int64_t> shape, std::string data);

  // A tensor of `values` with `shape` (product(shape) must equal values.size()).
  template <class T>
  static Tensor of(const std::vector<T>& values, std::vector<std::int64_t> shape) {
    std::string data(values.size() * sizeof(T), '\0');
    if (!values.empty()) std::memcpy(data.data(), values.data(), data.size());
    return Tensor(dtype_of<T>(), std::move(shape), std::move(data));
  }
  // bool [values.size()], one byte per element (std::vector<bool> packs bits, so it gets its own).
  static Tensor of_bools(const std::vector<bool>& values);

  static Tensor from_proto(const common::v1::Tensor& proto);  // checks the byte count
  common::v1::Tensor to_proto() const;

  DType dtype() const { return dtype_; }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  const std::string& data() const { return data_; }
  std::int64_t size() const;  // number of elements

  // The elements as T; the dtype must be exactly T's (std::invalid_argument otherwise).
  template <class T>
  std::vector<T> values() const {
    check_dtype(dtype_of<T>());
    std::vector<T> out(data_.size() / sizeof(T));
    if (!out.empty()) std::memcpy(out.data(), data_.data(), data_.size());
    return out;
  }
  // The elements of any integer or bool dtype widened to int64 (discrete actions).
  std::vector<std::int64_t> to_int64() const;
  // The elements of any numeric dtype as float32 (continuous actions); float16/bfloat16 included.
  std::vector<float> to_float32() const;

 private:
  void check_dtype(DType expected) const;

  DType dtype_ = DType::D_TYPE_UNSPECIFIED;
  std::vector<std::int64_t> shape_;
  std::string data_;
};

}  // namespace rlfleet
