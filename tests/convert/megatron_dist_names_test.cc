// torch_dist key mapping (stacked [L] / per-layer keys, experts' [E] axis, padded vocab) and Megatron args <-> model:
// the args Trestle writes read back as the same model, and args from Megatron-LM choose the right architecture.
#include "convert/bridge/megatron_dist_names.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "convert/bridge/bridge_model_json.h"
#include "convert/bridge/megatron_args.h"
#include "convert/formats/torch/pickle_reader.h"
#include "convert/formats/torch/pickle_writer.h"
#include "tests/support/status_matchers.h"

namespace trestle {
namespace {

using json = nlohmann::json;

BridgeModel model_for(const std::string& architecture, bool tied = false) {
  json c = {{"architectures", {architecture}},
            {"hidden_size", 32},
            {"intermediate_size", 48},
            {"num_hidden_layers", 4},
            {"num_attention_heads", 4},
            {"num_key_value_heads", 1},
            {"head_dim", 8},  // (Qwen3's default is 128)
            {"vocab_size", 100},
            {"max_position_embeddings", 64},
            {"tie_word_embeddings", tied},
            {"rope_theta", 500000.0},
            {"rms_norm_eps", 1e-6},
            {"torch_dtype", "bfloat16"}};
  if (architecture == "MixtralForCausalLM") {
    c["num_local_experts"] = 4;
    c["num_experts_per_tok"] = 2;
  }
  return bridge_model_from_config(parse_hf_config(c, "config.json").value()).value();
}

const BridgeTensor& tensor(const BridgePlan& p, const std::string& name) {
  const auto it =
      std::find_if(p.tensors.begin(), p.tensors.end(), [&](const BridgeTensor& t) { return t.name == name; });
  EXPECT_NE(it, p.tensors.end()) << name;
  return *it;
}

TEST(MegatronDistNamesTest, StackedLayersPrependTheLayerAxis) {
  const auto plan =
      make_bridge_plan(model_for("LlamaForCausalLM"), NormNaming::kTransformerEngine, ExpertLayout::kOriginal).value();
  const BridgeTensor& fc1 = tensor(plan, "decoder.layers.2.mlp.linear_fc1.weight");
  const DistPlacement p = dist_placement(fc1, LayerKeys::kStacked, NormNaming::kTransformerEngine, 4, 0);
  EXPECT_EQ(p.key, "decoder.layers.mlp.linear_fc1.weight");
  EXPECT_EQ(dist_global_shape(p, fc1, 256), (Shape{4, 96, 32}));
  // TP rank 1 of 2 holds up rows [72, 96) of the global [all gate; all up]: the same box under the layer index.
  const Box box = dist_box(p, Box{{72, 0}, {24, 32}});
  EXPECT_EQ(box, (Box{{2, 72, 0}, {1, 24, 32}}));

  const DistPlacement per_layer = dist_placement(fc1, LayerKeys::kPerLayer, NormNaming::kTransformerEngine, 4, 0);
  EXPECT_EQ(per_layer.key, "decoder.layers.2.mlp.linear_fc1.weight");
  EXPECT_EQ(dist_box(per_layer, Box{{72, 0}, {24, 32}}), (Box{{72, 0}, {24, 32}}));
}

TEST(MegatronDistNamesTest, VocabIsPaddedAndModelTensorsKeepTheirNames) {
  const auto plan =
      make_bridge_plan(model_for("LlamaForCausalLM"), NormNaming::kLocal, ExpertLayout::kOriginal).value();
  const BridgeTensor& embedding = tensor(plan, "embedding.word_embeddings.weight");
  const DistPlacement p = dist_placement(embedding, LayerKeys::kStacked, NormNaming::kTransformerEngine, 4, 0);
  EXPECT_EQ(p.key, "embedding.word_embeddings.weight");
  EXPECT_EQ(dist_global_shape(p, embedding, 256), (Shape{256, 32}));
  const BridgeTensor& norm = tensor(plan, "decoder.layers.0.input_layernorm.weight");
  const DistPlacement stacked = dist_placement(norm, LayerKeys::kStacked, NormNaming::kTransformerEngine, 4, 0);
  EXPECT_EQ(stacked.key, "decoder.layers.input_layernorm.weight");
  EXPECT_EQ(dist_global_shape(stacked, norm, 256), (Shape{4, 32}));
}

TEST(MegatronDistNamesTest, ExpertsGetALayerAndAnExpertAxis) {
  const auto plan =
      make_bridge_plan(model_for("MixtralForCausalLM"), NormNaming::kTransformerEngine, ExpertLayout::kOriginal)
          .value();
  const BridgeTensor& fc2 = tensor(plan, "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight");
  const DistPlacement p = dist_placement(fc2, LayerKeys::kStacked, NormNaming::kTransformerEngine, 4, 4);
  EXPECT_EQ(p.key, "decoder.layers.mlp.experts.experts.linear_fc2.weight");
  EXPECT_EQ(dist_global_shape(p, fc2, 128), (Shape{4, 4, 32, 48}));
  EXPECT_EQ(dist_box(p, Box{{0, 24}, {32, 24}}), (Box{{1, 3, 0, 24}, {1, 1, 32, 24}}));
  const DistPlacement per_layer = dist_placement(fc2, LayerKeys::kPerLayer, NormNaming::kTransformerEngine, 4, 4);
  EXPECT_EQ(per_layer.key, "decoder.layers.1.mlp.experts.experts.linear_fc2.weight");
  EXPECT_EQ(per_layer.leading, (Shape{4}));
  // An MoE layer's pre-MLP norm: TE spec keeps its name, the local spec saves it under fc1's fused-norm name.
  const BridgeTensor& norm = tensor(plan, "decoder.layers.1.pre_mlp_layernorm.weight");
  EXPECT_EQ(dist_placement(norm, LayerKeys::kStacked, NormNaming::kTransformerEngine, 4, 4).key,
            "decoder.layers.pre_mlp_layernorm.weight");
  EXPECT_EQ(dist_placement(norm, LayerKeys::kStacked, NormNaming::kLocal, 4, 4).key,
            "decoder.layers.mlp.linear_fc1.layer_norm_weight");
  const BridgeTensor& router = tensor(plan, "decoder.layers.1.mlp.router.weight");
  EXPECT_EQ(dist_placement(router, LayerKeys::kStacked, NormNaming::kTransformerEngine, 4, 4).key,
            "decoder.layers.mlp.router.weight");
}

// Qwen3-VL's vision tower as Megatron-Bridge names and saves it: Megatron-Core's layer names, the fused QKV per head,
// the blocks and deepstack mergers stacked with a [count] axis, an _extra_state per linear module.
TEST(MegatronDistNamesTest, Qwen3VlVisionTowerIsAStackedTransformerBlock) {
  const json text = {{"hidden_size", 32},          {"intermediate_size", 40}, {"num_hidden_layers", 2},
                     {"num_attention_heads", 4},   {"num_key_value_heads", 2}, {"head_dim", 8},
                     {"vocab_size", 301},          {"rms_norm_eps", 1e-6},     {"rope_theta", 10000.0}};
  const json vision = {{"depth", 3},       {"hidden_size", 16},          {"intermediate_size", 24},
                       {"num_heads", 2},   {"out_hidden_size", 32},      {"patch_size", 4},
                       {"spatial_merge_size", 2}, {"num_position_embeddings", 16},
                       {"deepstack_visual_indexes", {0, 2}}};
  const json c = {{"architectures", {"Qwen3VLForConditionalGeneration"}}, {"model_type", "qwen3_vl"},
                  {"text_config", text}, {"vision_config", vision}, {"tie_word_embeddings", false}};
  const auto model = bridge_model_from_config(parse_hf_config(c, "config.json").value());
  ASSERT_TRUE(model.ok()) << model.status().message();
  const auto plan = make_bridge_plan(*model, NormNaming::kTransformerEngine, ExpertLayout::kOriginal).value();
  const VisionStacks stacks = vision_stacks(plan);
  EXPECT_EQ(stacks.layers, 3);
  EXPECT_EQ(stacks.mergers, 2);

  // Hugging Face's qkv is [all q; all k; all v] (2 heads of 8 rows); Megatron's per head [q_h; k_h; v_h].
  const BridgeTensor& qkv = tensor(plan, "vision_model.decoder.layers.1.self_attention.linear_qkv.weight");
  EXPECT_EQ(plan.hf[qkv.runs[0].hf_index].name, "model.visual.blocks.1.attn.qkv.weight");
  std::vector<std::int64_t> hf_rows;
  for (const ElementRun& r : qkv.runs) hf_rows.push_back(r.hf_offset / 16);
  EXPECT_EQ(hf_rows, (std::vector<std::int64_t>{0, 16, 32, 8, 24, 40}));
  const BridgeTensor& norm = tensor(plan, "vision_model.decoder.layers.1.mlp.linear_fc1.layer_norm_bias");
  EXPECT_EQ(plan.hf[norm.runs[0].hf_index].name, "model.visual.blocks.1.norm2.bias");

  DistPlacement p = dist_placement(qkv, LayerKeys::kStacked, NormNaming::kTransformerEngine, 2, 0);
  stack_vision_placement(p, stacks);
  EXPECT_EQ(p.key, "vision_model.decoder.layers.self_attention.linear_qkv.weight");
  EXPECT_EQ(dist_global_shape(p, qkv, 384), (Shape{3, 48, 16}));
  EXPECT_EQ(module_extra_state_key(qkv, p, 0), "vision_model.decoder.layers.self_attention.linear_qkv._extra_state/shard_1_3");
  const BridgeTensor& merger = tensor(plan, "vision_model.decoder.deepstack_merger_list.1.linear_fc2.weight");
  DistPlacement m = dist_placement(merger, LayerKeys::kStacked, NormNaming::kTransformerEngine, 2, 0);
  stack_vision_placement(m, stacks);
  EXPECT_EQ(m.key, "vision_model.decoder.deepstack_merger_list.linear_fc2.weight");
  EXPECT_EQ(dist_box(m, Box{{0, 0}, {32, 64}}), (Box{{1, 0, 0}, {1, 32, 64}}));
  EXPECT_EQ(module_extra_state_key(merger, m, 0),
            "vision_model.decoder.deepstack_merger_list.linear_fc2._extra_state/shard_1_2");
  // The final merger and the patch embedding are modules of their own.
  const BridgeTensor& final_fc1 = tensor(plan, "vision_model.merger.linear_fc1.weight");
  DistPlacement f = dist_placement(final_fc1, LayerKeys::kStacked, NormNaming::kTransformerEngine, 2, 0);
  stack_vision_placement(f, stacks);
  EXPECT_EQ(f.key, "vision_model.merger.linear_fc1.weight");
  EXPECT_EQ(module_extra_state_key(final_fc1, f, 0), "vision_model.merger.linear_fc1._extra_state/shard_0_1");
  const BridgeTensor& patch = tensor(plan, "vision_model.patch_embed.proj.weight");
  DistPlacement e = dist_placement(patch, LayerKeys::kStacked, NormNaming::kTransformerEngine, 2, 0);
  stack_vision_placement(e, stacks);
  EXPECT_TRUE(e.leading.empty());
  EXPECT_EQ(module_extra_state_key(patch, e, 0), std::nullopt);
}

TEST(MegatronDistNamesTest, NonModelKeys) {
  EXPECT_TRUE(is_non_model_dist_key("decoder.layers.self_attention.linear_qkv._extra_state"));
  EXPECT_TRUE(is_non_model_dist_key("decoder.layers.self_attention.linear_qkv._extra_state/shard_0_2"));
  EXPECT_TRUE(is_non_model_dist_key("rng_state/shard_0.0_1.1"));
  // optimizer state is mapped (or refused), never skipped as non-model
  EXPECT_FALSE(is_non_model_dist_key("optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"));
  EXPECT_FALSE(is_non_model_dist_key("optimizer.distributed.dp_group_idx_0.param_state"));
  EXPECT_FALSE(is_non_model_dist_key("decoder.layers.mlp.linear_fc1.weight"));
  const auto dense = extra_state_keys(1, 4, 0, false);
  ASSERT_EQ(dense.size(), 4u);
  EXPECT_EQ(dense[0], "decoder.layers.self_attention.linear_qkv._extra_state/shard_1_4");
  EXPECT_EQ(dense[3], "decoder.layers.mlp.linear_fc2._extra_state/shard_1_4");
  const auto moe = extra_state_keys(1, 2, 4, false);
  ASSERT_EQ(moe.size(), 2u + 2 * 4);
  EXPECT_EQ(moe.back(), "decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_1.3_2.4");
  const auto shared = extra_state_keys(1, 2, 4, true);  // Qwen2-MoE's shared expert: two more linear modules
  ASSERT_EQ(shared.size(), 2u + 2 * 4 + 2);
  EXPECT_EQ(shared.back(), "decoder.layers.mlp.shared_experts.linear_fc2._extra_state/shard_1_2");
  for (const auto& k : dense) EXPECT_TRUE(is_non_model_dist_key(k)) << k;
}

// Megatron-Core's model-space optimizer keys: the weight's stacked key (or per-layer key, expert axis, TE norm name)
// after optimizer.state.<state>; Trestle's names after optimizer.<state>.
TEST(MegatronDistNamesTest, OptimizerKeysFollowTheirWeights) {
  const auto plan =
      make_bridge_plan(model_for("MixtralForCausalLM"), NormNaming::kLocal, ExpertLayout::kOriginal).value();
  const auto te =
      make_bridge_plan(model_for("MixtralForCausalLM"), NormNaming::kTransformerEngine, ExpertLayout::kOriginal)
          .value();
  const BridgeTensor& expert = tensor(te, "decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight");
  const DistPlacement p = dist_placement(expert, LayerKeys::kStacked, NormNaming::kLocal, 4, 4);
  EXPECT_EQ(dist_optimizer_key("exp_avg", p.key),
            "optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc2.weight");
  EXPECT_EQ(p.index, (Shape{3, 1}));
  const BridgeTensor& norm = tensor(te, "decoder.layers.0.pre_mlp_layernorm.weight");
  EXPECT_EQ(dist_optimizer_key("fp32_param", dist_placement(norm, LayerKeys::kPerLayer, NormNaming::kLocal, 4, 4).key),
            "optimizer.state.fp32_param.decoder.layers.0.mlp.linear_fc1.layer_norm_weight");
  EXPECT_EQ(trestle_optimizer_name("exp_avg_sq", tensor(plan, "embedding.word_embeddings.weight").name),
            "optimizer.exp_avg_sq.embedding.word_embeddings.weight");
  // fp32 masters: Megatron's fp32_param is preferred, the distributed optimizer's fully_reshardable `param` also read
  std::vector<std::string> trestle, megatron;
  for (const auto& s : dist_optimizer_states()) {
    trestle.push_back(s.trestle);
    megatron.push_back(s.megatron);
  }
  EXPECT_EQ(trestle, (std::vector<std::string>{"exp_avg", "exp_avg_sq", "fp32_param", "fp32_param"}));
  EXPECT_EQ(megatron, (std::vector<std::string>{"exp_avg", "exp_avg_sq", "fp32_param", "param"}));
}

TEST(MegatronDistNamesTest, StepValueFromAnyNumericDType) {
  const float f = 41.9999f;  // torch's Adam keeps the step as a float tensor
  EXPECT_EQ(step_value(DType::kF32, std::as_bytes(std::span(&f, 1))).value(), 42);
  const std::int64_t i = 1234567890123;
  EXPECT_EQ(step_value(DType::kI64, std::as_bytes(std::span(&i, 1))).value(), i);
  const std::int32_t j = 7;
  EXPECT_EQ(step_value(DType::kI32, std::as_bytes(std::span(&j, 1))).value(), 7);
  EXPECT_TRUE(fails_with(step_value(DType::kI64, std::as_bytes(std::span(&j, 1))),
                         "a step counter must be one element"));  // wrong size
  const bool b = true;
  EXPECT_TRUE(fails_with(step_value(DType::kBool, std::as_bytes(std::span(&b, 1))), "a step counter of dtype bool"));
}

// The Namespace Trestle writes, pickled and parsed back as Megatron-LM would hand it over, describes the same model.
Result<BridgedModel> roundtrip_args(const BridgedModel& b) {
  PickleDocument doc;
  doc.set_root(megatron_args(doc, b));
  TRESTLE_ASSIGN_OR_RETURN(const std::string bytes, write_pickle(doc.root(), 2));
  TRESTLE_ASSIGN_OR_RETURN(auto parsed, parse_pickle(bytes));
  return bridged_model_from_args(parsed.root(), "args.pkl");
}

// A padding multiple outside 1 .. 2^30 is refused where it is read from args (it was converted with exit 0 into a
// checkpoint every reader refused), and a writer refuses a description its readers would.
TEST(MegatronArgsTest, APaddingMultipleOutOfRangeIsRefusedWhereReadAndWritten) {
  BridgedModel b;
  b.model = model_for("LlamaForCausalLM");
  EXPECT_TRUE(checked_bridged_model_json(b, "out").ok());
  b.layout.make_vocab_size_divisible_by = 0;
  PickleDocument doc;
  doc.set_root(megatron_args(doc, b));
  auto parsed = parse_pickle(write_pickle(doc.root(), 2).value());
  ASSERT_TRUE(parsed.ok());
  EXPECT_TRUE(
      fails_with(megatron_layout_from_args(parsed->root(), "common.pt"),
                 "common.pt: args.make_vocab_size_divisible_by must be an integer from 1 to 1073741824, not 0"));
  EXPECT_TRUE(fails_with(checked_bridged_model_json(b, "out"),
                         "out (the model description to be written) (model.parallel): layout "
                         "'make_vocab_size_divisible_by' must be an integer from 1"));
}

TEST(MegatronArgsTest, WrittenArgsDescribeTheSameModel) {
  for (const auto& [arch, tied] : std::vector<std::pair<std::string, bool>>{{"LlamaForCausalLM", false},
                                                                            {"LlamaForCausalLM", true},
                                                                            {"Qwen2ForCausalLM", true},
                                                                            {"Qwen3ForCausalLM", false},
                                                                            {"MixtralForCausalLM", false}}) {
    BridgedModel b;
    b.model = model_for(arch, tied);
    b.layout.tp = 2;
    b.layout.pp = 2;
    b.layout.vpp = 2;
    b.layout.make_vocab_size_divisible_by = 64;
    auto back = roundtrip_args(b);
    ASSERT_TRUE(back.ok()) << arch << ": " << back.status().message();
    const auto& c = back->model.hf;
    EXPECT_EQ(back->model.architecture, arch);
    EXPECT_EQ(c.num_layers, 4);
    EXPECT_EQ(c.hidden_size, 32);
    EXPECT_EQ(c.num_kv_heads, 1) << arch;
    EXPECT_EQ(c.head_dim, 8);
    EXPECT_EQ(c.vocab_size, 100);
    EXPECT_EQ(c.tie_word_embeddings, tied);
    EXPECT_EQ(back->model.ffn_hidden_size, 48);
    EXPECT_EQ(c.rope_theta, 500000.0);
    EXPECT_EQ(c.dtype, "bfloat16");
    EXPECT_EQ(back->layout.tp, 2);
    EXPECT_EQ(back->layout.vpp, 2);
    EXPECT_EQ(back->layout.make_vocab_size_divisible_by, 64);
    if (arch == "MixtralForCausalLM") {
      EXPECT_EQ(c.num_experts, 4);
      EXPECT_EQ(c.experts_per_token, 2);
    }
  }
}

// A value of another type than the key's (as a hand-edited or foreign pickle has) is refused naming the key and what
// was expected, where the readers took the fallback (normalization=5 read as RMSNorm, bf16=1 as not bf16).
TEST(MegatronArgsTest, ArgsOfTheWrongTypeAreRefusedNamed) {
  for (const auto& [key, expected] : std::vector<std::pair<std::string, std::string>>{
           {"normalization", "args.normalization is 5, expected a string"},
           {"bf16", "args.bf16 is 5, expected True or False"},
           {"norm_epsilon", "args.norm_epsilon is 'x', expected a number"},
           {"tensor_model_parallel_size", "args.tensor_model_parallel_size is 'x', expected an integer"}}) {
    BridgedModel b;
    b.model = model_for("LlamaForCausalLM");
    PickleDocument doc;
    PickleValue* ns = megatron_args(doc, b);
    bool replaced = false;
    for (auto& [k, v] : ns->state->entries)
      if (k->text == key) {
        v = key == "normalization" || key == "bf16" ? doc.integer(5) : doc.string("x");
        replaced = true;
      }
    ASSERT_TRUE(replaced) << key;
    EXPECT_TRUE(fails_with(bridged_model_from_args(ns, "common.pt"), "common.pt: " + expected)) << key;
  }
  // None stays "not given", as Megatron-LM's own args hold it for options left out.
  BridgedModel b;
  b.model = model_for("LlamaForCausalLM");
  PickleDocument doc;
  PickleValue* ns = megatron_args(doc, b);
  for (auto& [k, v] : ns->state->entries)
    if (k->text == "qk_layernorm" || k->text == "kv_channels") v = doc.none();
  EXPECT_TRUE(bridged_model_from_args(ns, "common.pt").ok());
}

TEST(MegatronArgsTest, UnsupportedOrMissingArgsAreNamed) {
  PickleDocument doc;
  auto ns = [&](std::vector<std::pair<PickleValue*, PickleValue*>> fields) {
    return doc.object(doc.global("argparse", "Namespace"), doc.tuple({}), doc.dict(std::move(fields)),
                      PickleCall::kNewObj);
  };
  auto missing = bridged_model_from_args(ns({{doc.string("swiglu"), doc.boolean(true)}}), "rank.pt");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("rank.pt: args has no 'num_layers'"), std::string::npos)
      << missing.status().message();
  auto gelu = bridged_model_from_args(ns({{doc.string("swiglu"), doc.boolean(false)}}), "rank.pt");
  ASSERT_FALSE(gelu.ok());
  EXPECT_NE(gelu.status().message().find("without swiglu"), std::string::npos) << gelu.status().message();
  auto none = bridged_model_from_args(nullptr, "common.pt");
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("--hf-config"), std::string::npos);
}

}  // namespace
}  // namespace trestle
