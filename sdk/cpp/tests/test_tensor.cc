#include <gtest/gtest.h>

#include <cmath>

#include "rlfleet/tensor.h"

using rlfleet::Tensor;
using rlfleet::common::v1::DType;

TEST(Tensor, OfKeepsValuesShapeAndDtype) {
  const Tensor t = Tensor::of(std::vector<float>{1.5f, -2.0f, 3.0f, 4.0f, 5.0f, 6.0f}, {2, 3});
  EXPECT_EQ(t.dtype(), DType::D_TYPE_FLOAT32);
  EXPECT_EQ(t.shape(), (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(t.size(), 6);
  EXPECT_EQ(t.data().size(), 24u);
  EXPECT_EQ(t.values<float>(), (std::vector<float>{1.5f, -2.0f, 3.0f, 4.0f, 5.0f, 6.0f}));
}

TEST(Tensor, WireBytesAreLittleEndianRowMajor) {
  const Tensor t = Tensor::of(std::vector<std::int32_t>{1, 258}, {2});
  EXPECT_EQ(t.data(), std::string("\x01\x00\x00\x00\x02\x01\x00\x00", 8));
}

TEST(Tensor, ByteCountMustMatchShape) {
  EXPECT_THROW(Tensor(DType::D_TYPE_FLOAT32, {2, 2}, std::string(12, '\0')),
               std::invalid_argument);
  EXPECT_THROW(Tensor::of(std::vector<float>{1, 2, 3}, {2, 2}), std::invalid_argument);
  EXPECT_THROW(Tensor(DType::D_TYPE_UNSPECIFIED, {1}, std::string(1, '\0')),
               std::invalid_argument);
}

TEST(Tensor, ProtoRoundTrip) {
  const Tensor t = Tensor::of(std::vector<std::int64_t>{7, -8, 9}, {3, 1});
  const auto proto = t.to_proto();
  EXPECT_EQ(proto.dtype(), DType::D_TYPE_INT64);
  ASSERT_EQ(proto.shape_size(), 2);
  EXPECT_EQ(proto.shape(0), 3);
  const Tensor back = Tensor::from_proto(proto);
  EXPECT_EQ(back.values<std::int64_t>(), (std::vector<std::int64_t>{7, -8, 9}));
  EXPECT_EQ(back.shape(), t.shape());
}

TEST(Tensor, BoolsAreOneBytePerElement) {
  const Tensor t = Tensor::of_bools({true, false, true});
  EXPECT_EQ(t.dtype(), DType::D_TYPE_BOOL);
  EXPECT_EQ(t.data(), std::string("\x01\x00\x01", 3));
  EXPECT_EQ(t.to_int64(), (std::vector<std::int64_t>{1, 0, 1}));
}

TEST(Tensor, IntegerDtypesWidenToInt64) {
  EXPECT_EQ(Tensor::of(std::vector<std::int8_t>{-1, 2}, {2}).to_int64(),
            (std::vector<std::int64_t>{-1, 2}));
  EXPECT_EQ(Tensor::of(std::vector<std::uint16_t>{65535}, {1}).to_int64(),
            (std::vector<std::int64_t>{65535}));
  EXPECT_THROW(Tensor::of(std::vector<float>{1}, {1}).to_int64(), std::invalid_argument);
}

TEST(Tensor, ValuesChecksTheDtype) {
  const Tensor t = Tensor::of(std::vector<std::int64_t>{1}, {1});
  EXPECT_THROW(t.values<float>(), std::invalid_argument);
}

TEST(Tensor, HalfPrecisionToFloat32) {
  // float16 1.0 = 0x3c00, -2.5 = 0xc100, smallest subnormal 0x0001; bfloat16 1.0 = 0x3f80.
  const Tensor half(DType::D_TYPE_FLOAT16, {3}, std::string("\x00\x3c\x00\xc1\x01\x00", 6));
  const auto values = half.to_float32();
  EXPECT_FLOAT_EQ(values[0], 1.0f);
  EXPECT_FLOAT_EQ(values[1], -2.5f);
  EXPECT_FLOAT_EQ(values[2], std::ldexp(1.0f, -24));
  const Tensor bf16(DType::D_TYPE_BFLOAT16, {1}, std::string("\x80\x3f", 2));
  EXPECT_FLOAT_EQ(bf16.to_float32()[0], 1.0f);
  EXPECT_FLOAT_EQ(Tensor::of(std::vector<double>{0.25}, {1}).to_float32()[0], 0.25f);
  EXPECT_FLOAT_EQ(Tensor::of(std::vector<std::int32_t>{-3}, {1}).to_float32()[0], -3.0f);
}
