// Megatron's learning-rate scheduler state: read from a common state dict into JSON, checked for Megatron's keys, and
// written back as the dict Megatron saves (round trip through a torch.save archive); malformed entries are refused by
// name.
#include "convert/bridge/megatron_scheduler.h"

#include <gtest/gtest.h>

#include <string>

#include "convert/formats/torch/torch_save.h"

namespace trestle {
namespace {

nlohmann::json megatron_state() {
  return {{"max_lr", 3e-4},
          {"lr_warmup_steps", 80},
          {"num_steps", 160},
          {"lr_decay_style", "cosine"},
          {"lr_decay_steps", 800},
          {"min_lr", 3e-5},
          {"start_wd", 0.1},
          {"end_wd", 0.1},
          {"wd_incr_style", "constant"},
          {"wd_incr_steps", 800}};
}

std::span<const std::byte> as_bytes(const std::string& s) { return std::as_bytes(std::span(s.data(), s.size())); }

TEST(MegatronScheduler, RoundTripsThroughACommonStateArchive) {
  const nlohmann::json state = megatron_state();
  ASSERT_TRUE(missing_megatron_scheduler_keys(state).empty());
  PickleDocument doc;
  PickleValue* common = doc.dict({{doc.string("iteration"), doc.integer(20)},
                                  {doc.string("opt_param_scheduler"), megatron_scheduler_object(doc, state)}});
  auto bytes = torch_save_object_bytes(common, "common");
  ASSERT_TRUE(bytes.ok()) << bytes.status().message();
  auto archive = TorchSaveArchive::parse(as_bytes(*bytes), "common.pt");
  ASSERT_TRUE(archive.ok()) << archive.status().message();
  const PickleValue* saved = archive->root()->get("opt_param_scheduler");
  ASSERT_NE(saved, nullptr);
  EXPECT_TRUE(saved->get("num_steps")->is(PickleKind::kInt));  // ints stay ints, floats floats, as Python has them
  EXPECT_TRUE(saved->get("max_lr")->is(PickleKind::kFloat));
  EXPECT_TRUE(saved->get("lr_decay_style")->is(PickleKind::kString));
  auto read = read_megatron_scheduler(archive->root(), "common.pt");
  ASSERT_TRUE(read.ok()) << read.status().message();
  ASSERT_TRUE(read->has_value());
  EXPECT_EQ(**read, state);
}

TEST(MegatronScheduler, ReadsTheOlderKeyAndNothingWhenAbsent) {
  PickleDocument doc;
  PickleValue* old = doc.dict({{doc.string("lr_scheduler"), doc.dict({{doc.string("num_iters"), doc.integer(5)},
                                                                      {doc.string("override"), doc.boolean(true)},
                                                                      {doc.string("note"), doc.none()}})}});
  auto read = read_megatron_scheduler(old, "c");
  ASSERT_TRUE(read.ok() && read->has_value());
  EXPECT_EQ(**read, (nlohmann::json{{"num_iters", 5}, {"override", true}, {"note", nullptr}}));
  EXPECT_EQ(missing_megatron_scheduler_keys(**read).size(), 10u);  // Megatron's keys are all missing
  auto none = read_megatron_scheduler(doc.dict({{doc.string("iteration"), doc.integer(1)}}), "c");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
}

TEST(MegatronScheduler, RefusesWhatIsNotAScalarByName) {
  PickleDocument doc;
  auto nested = read_megatron_scheduler(
      doc.dict({{doc.string("opt_param_scheduler"), doc.dict({{doc.string("max_lr"), doc.list({doc.real(1.0)})}})}}),
      "iter_0000002/common.pt");
  ASSERT_FALSE(nested.ok());
  EXPECT_NE(nested.status().message().find("iter_0000002/common.pt: 'opt_param_scheduler'['max_lr'] is list"),
            std::string::npos)
      << nested.status().message();
  auto not_dict = read_megatron_scheduler(doc.dict({{doc.string("opt_param_scheduler"), doc.integer(3)}}), "c.pt");
  ASSERT_FALSE(not_dict.ok());
  EXPECT_NE(not_dict.status().message().find("'opt_param_scheduler' is int, expected a dict"), std::string::npos)
      << not_dict.status().message();
  auto twice = read_megatron_scheduler(
      doc.dict({{doc.string("opt_param_scheduler"),
                 doc.dict({{doc.string("num_steps"), doc.integer(1)}, {doc.string("num_steps"), doc.integer(2)}})}}),
      "c.pt");
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.status().message().find("has the key 'num_steps' twice"), std::string::npos)
      << twice.status().message();
  nlohmann::json partial = megatron_state();
  partial.erase("wd_incr_style");
  partial["num_steps"] = nlohmann::json::array();
  EXPECT_EQ(missing_megatron_scheduler_keys(partial), (std::vector<std::string>{"num_steps", "wd_incr_style"}));
}

}  // namespace
}  // namespace trestle
