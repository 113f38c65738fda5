// count_stored_mtp_layers: the multi-token-prediction layers a checkpoint's names hold, counted from 0 without a gap,
// whatever else (hostile or not) the names are.
#include "convert/sources/canonical_source.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace trestle {
namespace {

BridgedModel mtp_capable() {
  BridgedModel b;
  b.model.gated_delta_net = true;  // Qwen3-Next's kind: it can hold MTP layers
  return b;
}

TEST(CountStoredMtpLayersTest, CountsLayersFromZeroWholeOrAfterAPrefix) {
  BridgedModel b = mtp_capable();
  count_stored_mtp_layers(b, {"model.mtp.layers.0.eh_proj.weight", "mtp.layers.1.eh_proj.weight",
                              "mtp.layers.3.eh_proj.weight", "decoder.layers.0.mlp.linear_fc1.weight"});
  EXPECT_EQ(b.model.mtp_layers, 2);  // 0 and 1; 3 is past a gap
}

TEST(CountStoredMtpLayersTest, IgnoresNamesThatOnlyLookAlike) {
  BridgedModel b = mtp_capable();
  count_stored_mtp_layers(b, {"mtp.layers.eh_proj.weight", "xmtp.layers.0.eh_proj.weight",
                              "mtp.layers.-1.eh_proj.weight", "mtp.layers.0x.eh_proj.weight",
                              "mtp.layers.99999999999999999999.eh_proj.weight", "mtp.layers.0.eh_proj.weight.x"});
  EXPECT_EQ(b.model.mtp_layers, 0);
}

TEST(CountStoredMtpLayersTest, LeavesADescribedCountAndModelsWithoutMtpAlone) {
  BridgedModel described = mtp_capable();
  described.model.mtp_layers = 3;
  count_stored_mtp_layers(described, {"mtp.layers.0.eh_proj.weight"});
  EXPECT_EQ(described.model.mtp_layers, 3);
  BridgedModel plain;
  count_stored_mtp_layers(plain, {"mtp.layers.0.eh_proj.weight"});
  EXPECT_EQ(plain.model.mtp_layers, 0);
}

// (in one pass: counting layer by layer over every name would not finish)
TEST(CountStoredMtpLayersTest, ManyLayersAreCounted) {
  BridgedModel b = mtp_capable();
  std::vector<std::string> names;
  for (int k = 0; k < 200000; ++k) names.push_back("mtp.layers." + std::to_string(k) + ".eh_proj.weight");
  count_stored_mtp_layers(b, names);
  EXPECT_EQ(b.model.mtp_layers, 200000);
}

}  // namespace
}  // namespace trestle
