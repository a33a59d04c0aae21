#include "rlfleet/tensor.h"

#include <stdexcept>

namespace rlfleet {

using common::v1::DType;

std::size_t itemsize(DType dtype) {
  switch (dtype) {
    case DType::D_TYPE_INT8:
    case DType::D_TYPE_UINT8:
    case DType::D_TYPE_BOOL:
      return 1;
    case DType::D_TYPE_FLOAT16:
    case DType::D_TYPE_BFLOAT16:
    case DType::D_TYPE_INT16:
    case DType::D_TYPE_UINT16:
      return 2;
    case DType::D_TYPE_FLOAT32:
    case DType::D_TYPE_INT32:
    case DType::D_TYPE_UINT32:
      return 4;
    case DType::D_TYPE_FLOAT64:
    case DType::D_TYPE_INT64:
    case DType::D_TYPE_UINT64:
      return 8;
    default:
      throw std::invalid_argument("tensor dtype is unset or unknown (" +
                                  std::to_string(static_cast<int>(dtype)) + ")");
  }
}

std::string dtype_name(DType dtype) {
  switch (dtype) {
    case DType::D_TYPE_FLOAT32: return "float32";
    case DType::D_TYPE_FLOAT64: return "float64";
    case DType::D_TYPE_FLOAT16: return "float16";
    case DType::D_TYPE_BFLOAT16: return "bfloat16";
    case DType::D_TYPE_INT8: return "int8";
    case DType::D_TYPE_INT16: return "int16";
    case DType::D_TYPE_INT32: return "int32";
    case DType::D_TYPE_INT64: return "int64";
    case DType::D_TYPE_UINT8: return "uint8";
    case DType::D_TYPE_UINT16: return "uint16";
    case DType::D_TYPE_UINT32: return "uint32";
    case DType::D_TYPE_UINT64: return "uint64";
    case DType::D_TYPE_BOOL: return "bool";
    default: return "unspecified";
  }
}

namespace {

std::int64_t product(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (std::int64_t extent : shape) {
    if (extent < 0) throw std::invalid_argument("tensor shape has a negative extent");
    n *= extent;
  }
  return n;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

template <class T>
T load(const std::string& data, std::size_t index) {
  T value;
  std::memcpy(&value, data.data() + index * sizeof(T), sizeof(T));
  return value;
}

float half_to_float(std::uint16_t h) {
  // IEEE binary16 -> binary32, subnormals and inf/nan included.
  std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x3ffu;
  std::uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

}  // namespace

Tensor::Tensor(DType dtype, std::vector<std::int64_t> shape, std::string data)
    : dtype_(dtype), shape_(std::move(shape)), data_(std::move(data)) {
  const std::size_t expected = static_cast<std::size_t>(product(shape_)) * itemsize(dtype_);
  if (data_.size() != expected) {
    throw std::invalid_argument("tensor of " + dtype_name(dtype_) + shape_text(shape_) +
                                " needs " + std::to_string(expected) + " bytes, got " +
                                std::to_string(data_.size()));
  }
}

Tensor Tensor::of_bools(const std::vector<bool>& values) {
  std::string data(values.size(), '\0');
  for (std::size_t i = 0; i < values.size(); ++i) data[i] = values[i] ? 1 : 0;
  return Tensor(DType::D_TYPE_BOOL, {static_cast<std::int64_t>(values.size())}, std::move(data));
}

Tensor Tensor::from_proto(const common::v1::Tensor& proto) {
  return Tensor(proto.dtype(), {proto.shape().begin(), proto.shape().end()}, proto.data());
}

common::v1::Tensor Tensor::to_proto() const {
  common::v1::Tensor proto;
  proto.set_dtype(dtype_);
  for (std::int64_t extent : shape_) proto.add_shape(extent);
  proto.set_data(data_);
  return proto;
}

std::int64_t Tensor::size() const { return product(shape_); }

void Tensor::check_dtype(DType expected) const {
  if (dtype_ != expected) {
    throw std::invalid_argument("tensor is " + dtype_name(dtype_) + ", not " +
                                dtype_name(expected));
  }
}

std::vector<std::int64_t> Tensor::to_int64() const {
  const auto n = static_cast<std::size_t>(size());
  std::vector<std::int64_t> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    switch (dtype_) {
      case DType::D_TYPE_INT8: out[i] = load<std::int8_t>(data_, i); break;
      case DType::D_TYPE_INT16: out[i] = load<std::int16_t>(data_, i); break;
      case DType::D_TYPE_INT32: out[i] = load<std::int32_t>(data_, i); break;
      case DType::D_TYPE_INT64: out[i] = load<std::int64_t>(data_, i); break;
      case DType::D_TYPE_UINT8: out[i] = load<std::uint8_t>(data_, i); break;
      case DType::D_TYPE_BOOL: out[i] = load<std::uint8_t>(data_, i) != 0; break;
      case DType::D_TYPE_UINT16: out[i] = load<std::uint16_t>(data_, i); break;
      case DType::D_TYPE_UINT32: out[i] = load<std::uint32_t>(data_, i); break;
      case DType::D_TYPE_UINT64: out[i] = static_cast<std::int64_t>(load<std::uint64_t>(data_, i)); break;
      default:
        throw std::invalid_argument("tensor is " + dtype_name(dtype_) + ", not an integer dtype");
    }
  }
  return out;
}

std::vector<float> Tensor::to_float32() const {
  if (dtype_ == DType::D_TYPE_FLOAT32) return values<float>();
  const auto n = static_cast<std::size_t>(size());
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    switch (dtype_) {
      case DType::D_TYPE_FLOAT64: out[i] = static_cast<float>(load<double>(data_, i)); break;
      case DType::D_TYPE_FLOAT16: out[i] = half_to_float(load<std::uint16_t>(data_, i)); break;
      case DType::D_TYPE_BFLOAT16: {
        const std::uint32_t bits = static_cast<std::uint32_t>(load<std::uint16_t>(data_, i)) << 16;
        std::memcpy(&out[i], &bits, sizeof(float));
        break;
      }
      default: {
        // Integer dtypes: via int64 (exact for every value a discrete space holds).
        std::vector<std::int64_t> ints = to_int64();
        for (std::size_t j = 0; j < n; ++j) out[j] = static_cast<float>(ints[j]);
        return out;
      }
    }
  }
  return out;
}

}  // namespace rlfleet
