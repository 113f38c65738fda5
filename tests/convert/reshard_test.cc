// Resharding a full training state (model, Adam moments, fp32 master weights as distributed-optimizer flat shards,
// a step counter) between layouts: every tensor stays bit-equal in canonical space, the target's pieces are where
// the layout rules put them, and an Adam step taken shard by shard at the new layout equals the step taken on the
// source's canonical tensors bit for bit.
#include "convert/reshard.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "ckpt/dtype_cast.h"
#include "ckpt/layout_save.h"
#include "ckpt/load.h"
#include "convert/bridge/bridge_model_json.h"
#include "convert/bridge/hf_config.h"
#include "convert/bridge_convert.h"
#include "convert/checkpoint_diff.h"
#include "convert/formats/safetensors/safetensors_checkpoint.h"
#include "convert/formats/safetensors/safetensors_writer.h"
#include "convert/formats/torch/dcp_checkpoint.h"
#include "convert/sources/canonical_source.h"
#include "convert/torch_dist_writer.h"
#include "parallel/layout/placement.h"
#include "tests/support/global_tensor.h"

namespace trestle {
namespace {

Result<ReshardReport> reshard_path(const std::string& src, const std::string& dst, const ReshardOptions& options) {
  TRESTLE_ASSIGN_OR_RETURN(auto source, open_trestle_source(src, {}));
  return reshard_to_trestle(*source, dst, options);
}

namespace fs = std::filesystem;
using nlohmann::json;
using testing::global_indices;

const char* const kStates[] = {"exp_avg", "exp_avg_sq", "fp32_param"};

json llama_config() {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"hidden_size", 32},
          {"intermediate_size", 48},
          {"num_hidden_layers", 6},
          {"num_attention_heads", 8},
          {"num_key_value_heads", 4},
          {"vocab_size", 250},
          {"max_position_embeddings", 64},
          {"rms_norm_eps", 1e-5},
          {"rope_theta", 10000.0},
          {"tie_word_embeddings", false},
          {"hidden_act", "silu"},
          {"torch_dtype", "bfloat16"}};
}

json mixtral_config() {
  return {{"architectures", {"MixtralForCausalLM"}},
          {"model_type", "mixtral"},
          {"hidden_size", 32},
          {"intermediate_size", 40},
          {"num_hidden_layers", 4},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"vocab_size", 203},
          {"max_position_embeddings", 64},
          {"rms_norm_eps", 1e-5},
          {"rope_theta", 10000.0},
          {"tie_word_embeddings", false},
          {"num_local_experts", 4},
          {"num_experts_per_tok", 2},
          {"hidden_act", "silu"},
          {"torch_dtype", "bfloat16"}};
}

std::vector<std::byte> floats_as(DType dtype, const std::vector<float>& values) {
  std::vector<std::byte> out(values.size() * dtype_size(dtype));
  EXPECT_TRUE(cast_elements(DType::kF32, std::as_bytes(std::span(values)), dtype, out).ok());
  return out;
}

// A Hugging Face model directory with random bf16 weights under every name the bridge expects.
void write_hf_model(const fs::path& dir, const json& config) {
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << config.dump(2);
  const auto parsed = parse_hf_config(config, "config.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status().message();
  const auto model = bridge_model_from_config(*parsed);
  ASSERT_TRUE(model.ok()) << model.status().message();
  const auto plan = make_bridge_plan(*model, NormNaming::kTransformerEngine, ExpertLayout::kOriginal);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  std::vector<TensorSpec> specs;
  for (const auto& t : plan->hf) specs.push_back({t.name, DType::kBF16, t.shape});
  auto writer = SafetensorsWriter::create((dir / "model.safetensors").string(), specs, {});
  ASSERT_TRUE(writer.ok()) << writer.status().message();
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  for (const auto& s : specs) {
    std::vector<float> values(static_cast<std::size_t>(numel(s.shape)));
    for (auto& v : values) v = normal(rng);
    ASSERT_TRUE((*writer)->write(s.name, floats_as(DType::kBF16, values)).ok());
  }
  ASSERT_TRUE((*writer)->commit().ok());
}

float gradient(std::int64_t index) { return std::sin(0.37f * static_cast<float>(index)) * 0.01f; }

// One Adam step on element i (the reference every shard must reproduce bit for bit).
void adam(float& param, float& m, float& v, float g) {
  constexpr float lr = 1e-3f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
  constexpr int step = 4;
  m = b1 * m + (1 - b1) * g;
  v = b2 * v + (1 - b2) * g * g;
  const float m_hat = m / (1 - std::pow(b1, static_cast<float>(step)));
  const float v_hat = v / (1 - std::pow(b2, static_cast<float>(step)));
  param -= lr * m_hat / (std::sqrt(v_hat) + eps);
}

class Reshard : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("trestle_reshard_" + std::to_string(::getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  // HF model -> Trestle at `layout`, then a training state (weights + optimizer shards + step) at the same layout,
  // saved through the ckpt API (save_layout).
  fs::path make_training_state(const json& config, const ParallelLayout& layout) {
    const fs::path hf = root_ / "hf", model = root_ / "model", state = root_ / "state";
    write_hf_model(hf, config);
    HfToTrestleOptions convert;
    convert.layout = layout;
    convert.progress = false;
    convert.iteration = 40;
    const auto converted = convert_hf_to_trestle(hf.string(), model.string(), convert);
    EXPECT_TRUE(converted.ok()) << converted.status().message();

    auto reader = CheckpointReader::open(model.string());
    EXPECT_TRUE(reader.ok());
    auto bridged = bridged_model_from_json(reader->manifest().model, "manifest");
    EXPECT_TRUE(bridged.ok());
    const auto plan = make_bridge_plan(bridged->model, bridged->norms, bridged->experts);
    EXPECT_TRUE(plan.ok());
    std::vector<LayoutTensor> tensors;
    std::vector<PlacedTensor> placed;
    canonical_.clear();
    for (const auto& t : plan->tensors) {
      const DType dtype = reader->manifest().tensors.at(t.name).dtype;
      std::vector<std::byte> weight(static_cast<std::size_t>(numel(t.shape)) * dtype_size(dtype));
      const LoadRequest request{t.name, Piece{whole_box(t.shape), std::nullopt}, weight.data()};
      EXPECT_TRUE(reader->load({&request, 1}).ok());
      tensors.push_back({t.name, dtype, t.shape});
      placed.push_back({&t, Holding::kModelWeight, t.shape});
      canonical_[t.name] = weight;
      std::vector<float> master(static_cast<std::size_t>(numel(t.shape)));
      EXPECT_TRUE(cast_elements(dtype, weight, DType::kF32, std::as_writable_bytes(std::span(master))).ok());
      std::vector<float> m(master.size()), v(master.size());
      for (std::size_t i = 0; i < m.size(); ++i) {
        m[i] = std::cos(0.11f * static_cast<float>(i) + static_cast<float>(t.name.size())) * 1e-3f;
        v[i] = m[i] * m[i] + 1e-7f;
      }
      const std::vector<float>* values[] = {&m, &v, &master};
      for (int s = 0; s < 3; ++s) {
        const std::string name = std::string("optimizer.") + kStates[s] + "." + t.name;
        tensors.push_back({name, DType::kF32, t.shape});
        placed.push_back({&t, Holding::kOptimizerShard, t.shape});
        canonical_[name] = floats_as(DType::kF32, *values[s]);
      }
    }
    tensors.push_back({"optimizer.step", DType::kI64, {}});
    placed.push_back({nullptr, Holding::kEveryRank, {}});
    const std::int64_t step = 3;
    canonical_["optimizer.step"] = std::vector<std::byte>(sizeof step);
    std::memcpy(canonical_["optimizer.step"].data(), &step, sizeof step);

    const auto ranks = place_on_ranks(placed, megatron_spec(bridged->model, bridged->norms), layout);
    EXPECT_TRUE(ranks.ok()) << ranks.status().message();
    bridged->layout = layout;
    CheckpointInfo info;
    info.iteration = 40;
    info.layout = layout_sizes_to_json(layout);
    info.model = bridged_model_to_json(*bridged);
    info.training = {{"consumed_samples", 1280}};
    auto fill = [&](const RankPiece& piece, std::span<std::byte> out) -> Status {
      const LayoutTensor& t = tensors[piece.tensor];
      const auto& bytes = canonical_.at(t.name);
      const std::size_t size = dtype_size(t.dtype);
      const auto indices = global_indices(t.shape, piece.piece);
      for (std::size_t i = 0; i < indices.size(); ++i)
        std::memcpy(out.data() + i * size, bytes.data() + static_cast<std::size_t>(indices[i]) * size, size);
      return OkStatus();
    };
    LayoutSaveOptions options;
    options.progress = false;
    const auto saved = save_layout(state.string(), info, tensors, *ranks, fill, options);
    EXPECT_TRUE(saved.ok()) << saved.status().message();
    return state;
  }

  fs::path reshard(const fs::path& from, const std::string& name, const LayoutChange& change) {
    const fs::path out = root_ / name;
    ReshardOptions options;
    options.change = change;
    options.progress = false;
    const auto report = reshard_path(from.string(), out.string(), options);
    EXPECT_TRUE(report.ok()) << name << ": " << report.status().message();
    return out;
  }

  // Bit-equal to the source in canonical space, laid out as the layout says, and the same Adam step per shard.
  void check(const fs::path& source, const fs::path& target, const ParallelLayout& expected) {
    auto a = open_trestle_source(source.string(), {});
    auto b = open_trestle_source(target.string(), {});
    ASSERT_TRUE(a.ok() && b.ok());
    const auto diff = diff_checkpoints(**a, **b);
    ASSERT_TRUE(diff.ok()) << diff.status().message();
    for (const auto& t : diff->tensors) EXPECT_EQ(t.kind, TensorDiff::Kind::kEqual) << target << ": " << t.name;
    EXPECT_EQ(diff->tensors.size(), canonical_.size());

    auto reader = CheckpointReader::open(target.string());
    ASSERT_TRUE(reader.ok());
    const Manifest& manifest = reader->manifest();
    EXPECT_EQ(manifest.world_size, expected.world_size());
    EXPECT_EQ(manifest.layout, layout_sizes_to_json(expected));
    EXPECT_EQ(manifest.iteration, 40);
    EXPECT_EQ(manifest.training.value("consumed_samples", 0), 1280);
    auto bridged = bridged_model_from_json(manifest.model, "manifest");
    ASSERT_TRUE(bridged.ok());
    EXPECT_EQ(layout_to_json(bridged->layout), layout_to_json(expected));
    check_adam_step(*reader, *bridged, expected);
  }

  void check_adam_step(const CheckpointReader& reader, const BridgedModel& bridged, const ParallelLayout& layout) {
    const auto plan = make_bridge_plan(bridged.model, bridged.norms, bridged.experts);
    ASSERT_TRUE(plan.ok());
    std::vector<PlacedTensor> placed;
    for (const auto& t : plan->tensors) placed.push_back({&t, Holding::kOptimizerShard, t.shape});
    const auto ranks = place_on_ranks(placed, megatron_spec(bridged.model, bridged.norms), layout);
    ASSERT_TRUE(ranks.ok());
    for (std::size_t w = 0; w < plan->tensors.size(); ++w) {
      const BridgeTensor& t = plan->tensors[w];
      const auto n = static_cast<std::size_t>(numel(t.shape));
      // The reference: the step on the source's canonical tensors.
      std::vector<float> p(n), m(n), v(n);
      std::memcpy(p.data(), canonical_.at("optimizer.fp32_param." + t.name).data(), n * 4);
      std::memcpy(m.data(), canonical_.at("optimizer.exp_avg." + t.name).data(), n * 4);
      std::memcpy(v.data(), canonical_.at("optimizer.exp_avg_sq." + t.name).data(), n * 4);
      for (std::size_t i = 0; i < n; ++i) adam(p[i], m[i], v[i], gradient(static_cast<std::int64_t>(i)));
      // The same step taken by each rank of the new layout on the shards it loads; the TP pieces of the dp ranks
      // together must cover every element once per replica group.
      std::vector<float> stepped(n, std::nanf(""));
      std::vector<int> covered(n, 0);
      for (const auto& rank : *ranks) {
        for (const auto& piece : rank) {
          if (piece.tensor != w) continue;
          const auto indices = global_indices(t.shape, piece.piece);
          std::vector<float> sp(indices.size()), sm(indices.size()), sv(indices.size());
          const LoadRequest requests[] = {
              {"optimizer.fp32_param." + t.name, piece.piece, reinterpret_cast<std::byte*>(sp.data())},
              {"optimizer.exp_avg." + t.name, piece.piece, reinterpret_cast<std::byte*>(sm.data())},
              {"optimizer.exp_avg_sq." + t.name, piece.piece, reinterpret_cast<std::byte*>(sv.data())}};
          ASSERT_TRUE(reader.load(requests).ok());
          for (std::size_t i = 0; i < indices.size(); ++i) {
            adam(sp[i], sm[i], sv[i], gradient(indices[i]));
            stepped[static_cast<std::size_t>(indices[i])] = sp[i];
            ++covered[static_cast<std::size_t>(indices[i])];
          }
        }
      }
      ASSERT_EQ(std::memcmp(stepped.data(), p.data(), n * 4), 0)
          << t.name << " at tp " << layout.tp << " dp " << layout.dp();
      // Each TP rank's optimizer holds its piece once over its dp (or, for experts, expert-dp) ranks; replicated
      // weights (norms, routers) are held by every TP rank.
      const int copies = t.split == TpSplit::kReplicated ? layout.tp : 1;
      for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(covered[i], copies) << t.name << " element " << i;
    }
  }

  fs::path root_;
  std::map<std::string, std::vector<std::byte>> canonical_;
};

ParallelLayout layout_of(int tp, int pp, int dp, int ep = 1, int vpp = 1, std::int64_t first = 0,
                         std::int64_t last = 0) {
  ParallelLayout l;
  l.tp = tp;
  l.pp = pp;
  l.data_parallel = dp;
  l.ep = ep;
  l.vpp = vpp;
  l.first_stage_layers = first;
  l.last_stage_layers = last;
  return l;
}

TEST_F(Reshard, DenseModelAcrossTpPpVppAndDp) {
  const auto source = make_training_state(llama_config(), layout_of(2, 2, 2));
  // tp up, pp and dp down
  const auto a = reshard(source, "tp4_pp1_dp1", {.tp = 4, .pp = 1, .dp = 1});
  check(source, a, layout_of(4, 1, 1));
  // tp down, uneven pipeline stages (1 + 4 + 1 layers)
  const auto b = reshard(source, "tp1_pp3_uneven", {.tp = 1, .pp = 3, .first_stage_layers = 1, .last_stage_layers = 1});
  check(source, b, layout_of(1, 3, 2, 1, 1, 1, 1));
  // virtual pipeline on
  const auto c = reshard(source, "tp2_pp2_vpp3", {.vpp = 3});
  check(source, c, layout_of(2, 2, 2, 1, 3));
  // virtual pipeline off again, from the vpp checkpoint, to one rank
  const auto d = reshard(c, "tp1_pp1_dp1", {.tp = 1, .pp = 1, .vpp = 1, .dp = 1});
  check(source, d, layout_of(1, 1, 1));
  // data parallel 2 -> 4: the distributed optimizer's shards move
  const auto e = reshard(source, "tp2_pp1_dp4", {.pp = 1, .dp = 4});
  check(source, e, layout_of(2, 1, 4));
}

TEST_F(Reshard, MoeModelAcrossEp) {
  const auto source = make_training_state(mixtral_config(), layout_of(1, 1, 2, 2));
  const auto a = reshard(source, "ep4_dp4", {.ep = 4, .dp = 4});
  check(source, a, layout_of(1, 1, 4, 4));
  const auto b = reshard(source, "tp2_pp2_ep1", {.tp = 2, .pp = 2, .ep = 1, .dp = 1});
  check(source, b, layout_of(2, 2, 1, 1));
  const auto c = reshard(b, "ep2_dp4", {.tp = 1, .pp = 1, .ep = 2, .dp = 4});
  check(source, c, layout_of(1, 1, 4, 2));
}

// Trestle training state -> torch_dist at another layout -> read back: every weight, Adam state and the step
// bit-equal in canonical space, under Megatron-Core's model-space optimizer keys; and torch_dist -> Trestle again at
// another layout equal too.
TEST_F(Reshard, ThroughTorchDist) {
  // Items of 1 MiB and more are read with O_DIRECT, smaller ones through the map: the wide model has both.
  json wide = llama_config();
  wide["hidden_size"] = 512;
  wide["intermediate_size"] = 1024;
  wide["vocab_size"] = 1500;
  const std::vector<std::tuple<json, ParallelLayout, ParallelLayout>> cases = {
      {llama_config(), layout_of(2, 2, 2), layout_of(4, 3, 1)},
      {mixtral_config(), layout_of(1, 1, 2, 2), layout_of(2, 2, 2, 2)},
      {wide, layout_of(2, 1, 1), layout_of(1, 2, 1)}};
  for (const auto& [config, from, to] : cases) {
    const auto source = make_training_state(config, from);
    auto trestle = open_trestle_source(source.string(), {});
    ASSERT_TRUE(trestle.ok()) << trestle.status().message();
    TorchDistWriteOptions write;
    write.layout = to;
    write.progress = false;
    const fs::path dist = root_ / "dist";
    const auto written = write_torch_dist(**trestle, dist.string(), write);
    ASSERT_TRUE(written.ok()) << written.status().message();
    EXPECT_NE(written->plan.find("Adam state tensors"), std::string::npos) << written->plan;
    EXPECT_NE(written->plan.find("step 3 in common.pt"), std::string::npos) << written->plan;
    auto dcp = DcpCheckpoint::open((dist / "iter_0000040").string());
    ASSERT_TRUE(dcp.ok()) << dcp.status().message();
    const DcpTensor* moment =
        dcp->metadata().find_tensor("optimizer.state.exp_avg_sq.decoder.layers.self_attention.linear_qkv.weight");
    const DcpTensor* master =
        dcp->metadata().find_tensor("optimizer.state.fp32_param.embedding.word_embeddings.weight");
    ASSERT_TRUE(moment && master) << written->plan;
    EXPECT_EQ(moment->shape, dcp->metadata().find_tensor("decoder.layers.self_attention.linear_qkv.weight")->shape);
    EXPECT_EQ(master->shape, dcp->metadata().find_tensor("embedding.word_embeddings.weight")->shape);  // padded vocab
    auto back = open_torch_dist_source(dist.string(), {});
    ASSERT_TRUE(back.ok()) << back.status().message();
    EXPECT_EQ(back->get()->iteration(), 40);
    EXPECT_EQ(back->get()->model().layout.tp, to.tp);
    EXPECT_EQ(back->get()->tensors().size(), trestle->get()->tensors().size());
    const auto diff = diff_checkpoints(**trestle, **back);
    ASSERT_TRUE(diff.ok()) << diff.status().message();
    EXPECT_TRUE(diff->identical());
    std::size_t optimizer = 0;
    for (const auto& t : diff->tensors) {
      EXPECT_EQ(t.kind, TensorDiff::Kind::kEqual) << t.name;
      optimizer += t.name.starts_with("optimizer.");
    }
    EXPECT_EQ(optimizer, 3 * (trestle->get()->tensors().size() - 1) / 4 + 1);  // 3 states per weight + the step
    SourceOptions model_only;
    model_only.model_only = true;
    auto weights = open_torch_dist_source(dist.string(), model_only);
    ASSERT_TRUE(weights.ok()) << weights.status().message();
    EXPECT_EQ(weights->get()->tensors().size(), (trestle->get()->tensors().size() - 1) / 4);
    ReshardOptions options;
    options.change = {.tp = 1, .pp = 2};
    options.progress = false;
    const fs::path again = root_ / "again";
    ASSERT_TRUE(reshard_to_trestle(**back, again.string(), options).ok());
    auto reread = open_trestle_source(again.string(), {});
    ASSERT_TRUE(reread.ok());
    const auto diff2 = diff_checkpoints(**back, **reread);
    ASSERT_TRUE(diff2.ok());
    EXPECT_TRUE(diff2->identical());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
}

// Hugging Face -> Trestle at tp 2 pp 2 -> Hugging Face: every tensor back bit for bit, in several shards. The model
// is large enough (34 MiB) that convert_to_hf reads it in several batches, the next on another thread while this one
// is written (the run scripts/sanitize repeats under TSan).
TEST_F(Reshard, BackToHuggingFaceBitExactAcrossReadBatches) {
  json config = llama_config();
  config["vocab_size"] = 16384;
  config["hidden_size"] = 512;
  config["num_hidden_layers"] = 2;
  const fs::path hf = root_ / "hf", model = root_ / "model", back = root_ / "back";
  write_hf_model(hf, config);
  HfToTrestleOptions to_trestle;
  to_trestle.layout = layout_of(2, 2, 1);
  to_trestle.progress = false;
  const auto converted = convert_hf_to_trestle(hf.string(), model.string(), to_trestle);
  ASSERT_TRUE(converted.ok()) << converted.status().message();
  const auto source = open_trestle_source(model.string(), {});
  ASSERT_TRUE(source.ok()) << source.status().message();
  ToHfOptions to_hf;
  to_hf.max_shard_bytes = 12u << 20;
  to_hf.progress = false;
  const auto report = convert_to_hf(**source, back.string(), to_hf);
  ASSERT_TRUE(report.ok()) << report.status().message();

  const auto original = SafetensorsCheckpoint::open(hf.string());
  const auto written = SafetensorsCheckpoint::open(back.string());
  ASSERT_TRUE(original.ok()) << original.status().message();
  ASSERT_TRUE(written.ok()) << written.status().message();
  EXPECT_GE(written->files().size(), 3u);
  ASSERT_EQ(written->names(), original->names());
  for (const auto& name : original->names()) {
    const auto a = original->view(name), b = written->view(name);
    ASSERT_TRUE(a.ok() && b.ok()) << name;
    EXPECT_EQ(a->dtype, b->dtype) << name;
    EXPECT_EQ(a->shape, b->shape) << name;
    ASSERT_EQ(a->nbytes(), b->nbytes()) << name;
    EXPECT_EQ(std::memcmp(a->data, b->data, a->nbytes()), 0) << name << " differs";
  }
}

TEST_F(Reshard, ErrorsNameTheProblem) {
  const auto source = make_training_state(llama_config(), layout_of(2, 1, 1));
  ReshardOptions options;
  options.progress = false;
  options.change.tp = 3;  // 4 KV groups do not split 3 ways
  auto report = reshard_path(source.string(), (root_ / "bad").string(), options);
  ASSERT_FALSE(report.ok());
  EXPECT_NE(report.status().message().find("not divisible by the tensor-parallel size (3)"), std::string::npos)
      << report.status().message();
  EXPECT_FALSE(fs::exists(root_ / "bad"));

  options.change = {};
  options.change.dp = 2;
  options.change.ep = 2;  // a dense model has no experts
  report = reshard_path(source.string(), (root_ / "bad").string(), options);
  ASSERT_FALSE(report.ok());
  EXPECT_NE(report.status().message().find("needs an MoE model"), std::string::npos) << report.status().message();

  fs::create_directories(root_ / "taken");
  std::ofstream(root_ / "taken" / "keep.txt") << "precious";
  options.change = {};
  options.change.tp = 1;
  report = reshard_path(source.string(), (root_ / "taken").string(), options);
  ASSERT_FALSE(report.ok());
  EXPECT_NE(report.status().message().find("not an empty directory"), std::string::npos);
  EXPECT_TRUE(fs::exists(root_ / "taken" / "keep.txt"));
}

}  // namespace
}  // namespace trestle
