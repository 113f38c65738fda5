// Megatron's fp16 loss scaler state: written as DynamicGradScaler.state_dict() (a one-element float32 'scale' tensor
// and two int trackers) into a torch.save archive and read back; a constant scaler's {} reads as none; malformed
// states are refused by name.
#include "convert/bridge/megatron_grad_scaler.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace trestle {
namespace {

std::span<const std::byte> as_bytes(const std::string& s) { return std::as_bytes(std::span(s.data(), s.size())); }

// `scaler` saved under 'grad_scaler' of a torch.save archive, read back.
Result<std::optional<nlohmann::json>> round_trip(PickleDocument& doc, PickleValue* scaler,
                                                 const std::vector<std::string>& storages, std::string& bytes) {
  TRESTLE_ASSIGN_OR_RETURN(bytes,
                           torch_save_object_bytes(doc.dict({{doc.string("grad_scaler"), scaler}}), "c", storages));
  TRESTLE_ASSIGN_OR_RETURN(const TorchSaveArchive archive, TorchSaveArchive::parse(as_bytes(bytes), "common.pt"));
  return read_megatron_grad_scaler(archive.root()->get("grad_scaler"), archive, "common.pt");
}

TEST(MegatronGradScaler, RoundTripsADynamicScalersStateWithItsScaleAsATensor) {
  const nlohmann::json state = {{"scale", 262144.0}, {"growth_tracker", 2}, {"hysteresis_tracker", -1}};
  ASSERT_TRUE(is_megatron_grad_scaler_state(state));
  PickleDocument doc;
  std::vector<std::string> storages;
  PickleValue* scaler = megatron_grad_scaler_object(doc, state, storages);
  ASSERT_EQ(storages.size(), 1u);
  EXPECT_EQ(storages[0].size(), 4u);  // one float32
  std::string bytes;
  auto read = round_trip(doc, scaler, storages, bytes);
  ASSERT_TRUE(read.ok()) << read.status().message();
  ASSERT_TRUE(read->has_value());
  EXPECT_EQ(**read, state);
  auto archive = TorchSaveArchive::parse(as_bytes(bytes), "common.pt");
  ASSERT_TRUE(archive.ok());
  auto tensor = archive->tensor(archive->root()->get("grad_scaler")->get("scale"));
  ASSERT_TRUE(tensor.ok() && tensor->has_value());
  EXPECT_EQ((*tensor)->dtype, DType::kF32);
  EXPECT_EQ((*tensor)->shape, Shape{1});
}

TEST(MegatronGradScaler, AConstantScalersEmptyStateIsNone) {
  PickleDocument doc;
  std::string bytes;
  auto read = round_trip(doc, doc.dict(), {}, bytes);
  ASSERT_TRUE(read.ok()) << read.status().message();
  EXPECT_FALSE(read->has_value());
}

TEST(MegatronGradScaler, MalformedStatesAreRefusedByName) {
  auto refused = [](std::vector<std::pair<const char*, double>> fields, const std::string& needle) {
    PickleDocument doc;
    std::vector<std::pair<PickleValue*, PickleValue*>> entries;
    for (const auto& [key, value] : fields)
      entries.emplace_back(doc.string(key), std::string_view(key) == "scale"
                                                ? doc.real(value)
                                                : doc.integer(static_cast<std::int64_t>(value)));
    std::string bytes;
    auto read = round_trip(doc, doc.dict(std::move(entries)), {}, bytes);
    ASSERT_FALSE(read.ok()) << needle;
    EXPECT_NE(read.status().message().find("common.pt: 'grad_scaler'"), std::string::npos) << read.status().message();
    EXPECT_NE(read.status().message().find(needle), std::string::npos) << read.status().message();
  };
  refused({{"growth_tracker", 0}, {"hysteresis_tracker", 2}}, "no 'scale'");
  refused({{"scale", -4.0}, {"growth_tracker", 0}, {"hysteresis_tracker", 2}}, "finite positive");
  refused({{"scale", 1e300 * 1e300}, {"growth_tracker", 0}, {"hysteresis_tracker", 2}}, "finite positive");
  refused({{"scale", 8.0}, {"growth_tracker", -1}, {"hysteresis_tracker", 2}}, "'growth_tracker'");
  refused({{"scale", 8.0}, {"growth_tracker", 0}}, "'hysteresis_tracker' is missing");
  // A scale tensor of two elements.
  PickleDocument doc;
  std::vector<std::string> storages = {std::string(8, '\0')};
  PickleValue* scaler = doc.dict({{doc.string("scale"), torch_tensor_value(doc, DType::kF32, Shape{2}, 0)},
                                  {doc.string("growth_tracker"), doc.integer(0)},
                                  {doc.string("hysteresis_tracker"), doc.integer(2)}});
  std::string bytes;
  auto read = round_trip(doc, scaler, storages, bytes);
  ASSERT_FALSE(read.ok());
  EXPECT_NE(read.status().message().find("one-element float tensor"), std::string::npos) << read.status().message();
  EXPECT_FALSE(is_megatron_grad_scaler_state({{"scale", 0.0}, {"growth_tracker", 0}, {"hysteresis_tracker", 2}}));
  EXPECT_FALSE(is_megatron_grad_scaler_state({{"scale", 2.0}, {"hysteresis_tracker", 2}}));
}

}  // namespace
}  // namespace trestle
