// The zero-copy bridge between Trestle tensor views and at::Tensor.
#include "ckpt/torch_tensor.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "ckpt/dtype_cast.h"

namespace trestle {
namespace {

// The torch type each Trestle dtype must map to, written out independently of ckpt/torch_tensor.cc.
struct TorchRow {
  DType dtype;
  c10::ScalarType torch;
};

constexpr TorchRow kTorchTypes[] = {
    {DType::kBool, c10::ScalarType::Bool},
    {DType::kU8, c10::ScalarType::Byte},
    {DType::kI8, c10::ScalarType::Char},
    {DType::kI16, c10::ScalarType::Short},
    {DType::kU16, c10::ScalarType::UInt16},
    {DType::kI32, c10::ScalarType::Int},
    {DType::kU32, c10::ScalarType::UInt32},
    {DType::kI64, c10::ScalarType::Long},
    {DType::kU64, c10::ScalarType::UInt64},
    {DType::kF16, c10::ScalarType::Half},
    {DType::kBF16, c10::ScalarType::BFloat16},
    {DType::kF32, c10::ScalarType::Float},
    {DType::kF64, c10::ScalarType::Double},
    {DType::kF8E4M3, c10::ScalarType::Float8_e4m3fn},
    {DType::kF8E5M2, c10::ScalarType::Float8_e5m2},
};

// Casts between floating types give torch's .to() bits: a double goes to f16 and bf16 through float (c10::Half and
// c10::BFloat16 are made from float), so a value just above a half-way point rounds as torch rounds it (1 + 2^-11 +
// 2^-40 is 1.0 in torch; straight from double it was 1 + 2^-10).
TEST(CastElementsTest, DoubleToHalfAndBFloat16RoundAsTorch) {
  const std::vector<double> values = {1.0004882812500002,
                                      -2.0009765625000004,
                                      1.0 + 0x1p-11 + 0x1p-40,
                                      1.0 + 0x1p-8 + 0x1p-40,
                                      65519.99,
                                      1e-8,
                                      -3.0e-5,
                                      0.1,
                                      1e300};
  const at::Tensor source = at::tensor(values, at::kDouble);
  for (const auto& [dtype, scalar] : {std::pair{DType::kF16, at::kHalf}, std::pair{DType::kBF16, at::kBFloat16}}) {
    const at::Tensor expected = source.to(scalar);
    at::Tensor cast = at::empty_like(expected);
    ASSERT_TRUE(cast_elements(DType::kF64, std::as_bytes(std::span(values)), dtype,
                              std::as_writable_bytes(std::span(static_cast<std::byte*>(cast.data_ptr()),
                                                               static_cast<std::size_t>(cast.nbytes()))))
                    .ok());
    EXPECT_TRUE(at::equal(cast.view(at::kShort), expected.view(at::kShort))) << cast << expected;
  }
}

TEST(TorchDTypeTest, MapsEveryDTypeAndBack) {
  ASSERT_EQ(std::size(kTorchTypes), std::size(kAllDTypes));
  std::set<c10::ScalarType> seen;
  for (const auto& row : kTorchTypes) {
    SCOPED_TRACE(std::string(dtype_name(row.dtype)));
    EXPECT_EQ(to_torch_dtype(row.dtype), row.torch);
    auto back = from_torch_dtype(row.torch);
    ASSERT_TRUE(back.ok()) << back.status().message();
    EXPECT_EQ(*back, row.dtype);
    EXPECT_EQ(c10::elementSize(row.torch), dtype_size(row.dtype));
    seen.insert(row.torch);
  }
  EXPECT_EQ(seen.size(), std::size(kTorchTypes));
}

TEST(TorchDTypeTest, TorchNameMatchesTorchsOwnSpelling) {
  // Our torch names are Python's spellings of the types the adapter maps to.
  EXPECT_EQ(torch_name(*from_torch_dtype(at::kBFloat16)), "torch.bfloat16");
  EXPECT_EQ(torch_name(*from_torch_dtype(at::kHalf)), "torch.float16");
  EXPECT_EQ(torch_name(*from_torch_dtype(at::kChar)), "torch.int8");
  EXPECT_EQ(torch_name(*from_torch_dtype(at::kByte)), "torch.uint8");
  EXPECT_EQ(torch_name(*from_torch_dtype(at::kFloat8_e4m3fn)), "torch.float8_e4m3fn");
}

TEST(TorchDTypeTest, UnsupportedTorchTypesFail) {
  for (auto type : {c10::ScalarType::ComplexFloat, c10::ScalarType::ComplexDouble, c10::ScalarType::QInt8,
                    c10::ScalarType::Float8_e4m3fnuz, c10::ScalarType::Float8_e5m2fnuz}) {
    auto result = from_torch_dtype(type);
    ASSERT_FALSE(result.ok()) << c10::toString(type);
    EXPECT_NE(result.status().message().find(c10::toString(type)), std::string::npos) << result.status().message();
  }
}

// One element per dtype, as little-endian bytes, with the value torch must read from them. Values are chosen so that
// a swapped mapping (f16/bf16, e4m3/e5m2, signed/unsigned) reads a different number.
struct ValueRow {
  DType dtype;
  std::vector<std::uint8_t> bytes;
  double value;
};

const std::vector<ValueRow>& value_rows() {
  static const std::vector<ValueRow> rows = {
      {DType::kBool, {0x01}, 1.0},
      {DType::kU8, {0xFE}, 254.0},
      {DType::kI8, {0xFE}, -2.0},
      {DType::kI16, {0xFE, 0xFF}, -2.0},
      {DType::kU16, {0xFE, 0xFF}, 65534.0},
      {DType::kI32, {0xFE, 0xFF, 0xFF, 0xFF}, -2.0},
      {DType::kU32, {0xFE, 0xFF, 0xFF, 0xFF}, 4294967294.0},
      {DType::kI64, {0xFE, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF}, -2.0},
      {DType::kU64, {0, 0, 0, 0, 0, 0, 0, 0x80}, 9223372036854775808.0},
      {DType::kF16, {0x00, 0x3C}, 1.0},
      {DType::kBF16, {0x80, 0x3F}, 1.0},
      {DType::kF32, {0x00, 0x00, 0x80, 0x3F}, 1.0},
      {DType::kF64, {0, 0, 0, 0, 0, 0, 0xF0, 0x3F}, 1.0},
      {DType::kF8E4M3, {0x38}, 1.0},
      {DType::kF8E5M2, {0x3C}, 1.0},
  };
  return rows;
}

TEST(AsTorchTensorTest, ZeroCopyForEveryDType) {
  for (DType d : kAllDTypes) {
    SCOPED_TRACE(std::string(dtype_name(d)));
    std::vector<std::byte> buffer(2 * 3 * dtype_size(d));
    const ConstTensorView view{d, {2, 3}, buffer.data()};
    const at::Tensor t = as_torch_tensor(view);
    EXPECT_EQ(t.data_ptr(), static_cast<void*>(buffer.data()));
    EXPECT_EQ(t.scalar_type(), to_torch_dtype(d));
    EXPECT_EQ(t.sizes().vec(), (std::vector<std::int64_t>{2, 3}));
    EXPECT_TRUE(t.is_contiguous());
    EXPECT_TRUE(t.device().is_cpu());
    EXPECT_EQ(static_cast<std::size_t>(t.nbytes()), buffer.size());
  }
}

TEST(AsTorchTensorTest, ReadsTheBytesAsTheRightType) {
  for (const auto& row : value_rows()) {
    SCOPED_TRACE(std::string(dtype_name(row.dtype)));
    ASSERT_EQ(row.bytes.size(), dtype_size(row.dtype));
    std::vector<std::uint8_t> bytes = row.bytes;
    const at::Tensor t = as_torch_tensor({row.dtype, {}, reinterpret_cast<const std::byte*>(bytes.data())});
    EXPECT_EQ(t.dim(), 0);
    EXPECT_EQ(t.data_ptr(), static_cast<void*>(bytes.data()));
    EXPECT_EQ(t.to(at::kDouble).item<double>(), row.value);
  }
}

TEST(AsTorchTensorTest, SharesMemoryBothWays) {
  std::vector<float> data = {1, 2, 3, 4, 5, 6};
  at::Tensor t = as_torch_tensor({DType::kF32, {3, 2}, reinterpret_cast<const std::byte*>(data.data())});
  data[4] = 42;  // a write to the memory shows through the tensor
  EXPECT_EQ(t[2][0].item<float>(), 42.0f);
  EXPECT_EQ(t.sum().item<float>(), 1 + 2 + 3 + 4 + 42 + 6);
}

TEST(AsTorchTensorTest, EmptyAndScalarShapes) {
  std::vector<std::byte> buffer(8);
  const at::Tensor empty = as_torch_tensor({DType::kF32, {0, 3}, buffer.data()});
  EXPECT_EQ(empty.sizes().vec(), (std::vector<std::int64_t>{0, 3}));
  EXPECT_EQ(empty.numel(), 0);
  const at::Tensor scalar = as_torch_tensor({DType::kI64, {}, buffer.data()});
  EXPECT_EQ(scalar.dim(), 0);
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(scalar.data_ptr(), static_cast<void*>(buffer.data()));
}

TEST(ViewOfTest, ZeroCopyForEveryDType) {
  for (const auto& row : kTorchTypes) {
    SCOPED_TRACE(std::string(dtype_name(row.dtype)));
    const at::Tensor t = at::empty({4, 5}, at::TensorOptions().dtype(row.torch));
    auto view = view_of(t);
    ASSERT_TRUE(view.ok()) << view.status().message();
    EXPECT_EQ(static_cast<void*>(view->data), t.data_ptr());
    EXPECT_EQ(view->dtype, row.dtype);
    EXPECT_EQ(view->shape, (Shape{4, 5}));
    EXPECT_EQ(view->nbytes(), static_cast<std::size_t>(t.nbytes()));
    // And back again: the same memory, the same type.
    const at::Tensor again = as_torch_tensor(*view);
    EXPECT_EQ(again.data_ptr(), t.data_ptr());
    EXPECT_EQ(again.scalar_type(), row.torch);
  }
}

TEST(ViewOfTest, WritesThroughTheViewReachTheTensor) {
  at::Tensor t = at::zeros({2, 2}, at::kInt);
  auto view = view_of(t);
  ASSERT_TRUE(view.ok());
  const std::int32_t seven = 7;
  std::memcpy(view->data + 3 * sizeof(std::int32_t), &seven, sizeof seven);
  EXPECT_EQ(t[1][1].item<int>(), 7);
}

TEST(ViewOfTest, ContiguousSliceStartsAtItsOffset) {
  const at::Tensor base = at::arange(12, at::kFloat).reshape({3, 4});
  const at::Tensor row = base[1];
  auto view = view_of(row);
  ASSERT_TRUE(view.ok()) << view.status().message();
  EXPECT_EQ(static_cast<void*>(view->data), static_cast<void*>(base.data_ptr<float>() + 4));
  EXPECT_EQ(view->shape, (Shape{4}));
  float first = 0;
  std::memcpy(&first, view->data, sizeof first);
  EXPECT_EQ(first, 4.0f);
}

TEST(ViewOfTest, ScalarAndEmptyTensors) {
  const at::Tensor scalar = at::scalar_tensor(3.5, at::kDouble);
  auto view = view_of(scalar);
  ASSERT_TRUE(view.ok());
  EXPECT_TRUE(view->shape.empty());
  EXPECT_EQ(view->nbytes(), 8u);
  const at::Tensor empty = at::empty({0, 3}, at::kBFloat16);
  auto empty_view = view_of(empty);
  ASSERT_TRUE(empty_view.ok());
  EXPECT_EQ(empty_view->shape, (Shape{0, 3}));
  EXPECT_EQ(empty_view->nbytes(), 0u);
}

TEST(ViewOfTest, RejectsNonContiguousTensors) {
  const at::Tensor base = at::arange(12, at::kFloat).reshape({3, 4});
  for (const at::Tensor& t :
       {base.t(), base.slice(1, 0, 4, 2), at::ones({1, 4}).expand({3, 4}), base.unsqueeze(0).permute({2, 0, 1})}) {
    ASSERT_FALSE(t.is_contiguous());
    auto view = view_of(t);
    ASSERT_FALSE(view.ok());
    EXPECT_NE(view.status().message().find("contiguous"), std::string::npos) << view.status().message();
  }
}

TEST(ViewOfTest, RejectsTensorsOffTheCpu) {
  const at::Tensor meta = at::empty({2, 3}, at::TensorOptions().dtype(at::kFloat).device(at::kMeta));
  auto view = view_of(meta);
  ASSERT_FALSE(view.ok());
  EXPECT_NE(view.status().message().find("meta"), std::string::npos) << view.status().message();
  EXPECT_NE(view.status().message().find("CPU"), std::string::npos) << view.status().message();
}

TEST(ViewOfTest, RejectsTypesWithoutATrestleDType) {
  auto view = view_of(at::zeros({2}, at::kComplexFloat));
  ASSERT_FALSE(view.ok());
  EXPECT_NE(view.status().message().find("no Trestle equivalent"), std::string::npos) << view.status().message();
}

}  // namespace
}  // namespace trestle
