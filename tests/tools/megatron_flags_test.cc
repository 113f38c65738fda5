// The Megatron-LM flags of `trestle train` (tools/megatron_flags.h): the parsers of Megatron's layer patterns and
// window tuples, the value checks (exit 2 in the CLI) and the model checks (exit 1) against model descriptions built
// here like the converted DeepSeek-V3, Mixtral, GPT-OSS and Llama 3.1 of tests/interop/test_megatron_model_flags.py.
#include "tools/megatron_flags.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "tests/support/status_matchers.h"

namespace trestle::cli {
namespace {

// The flags as trestle train parses them (the few of its own these checks read declared beside them).
cxxopts::ParseResult parse(std::vector<std::string> words) {
  static cxxopts::Options spec = [] {
    cxxopts::Options s("megatron_flags_test");
    declare_megatron_flags(s);
    s.add_options()("bf16", "")("fp16", "")("seq-length", "", cxxopts::value<std::int64_t>())(
        "moe-aux-loss-coeff", "", cxxopts::value<std::vector<double>>()->default_value("0"));
    return s;
  }();
  words.insert(words.begin(), "train");
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  return spec.parse(static_cast<int>(argv.size()), argv.data());
}

Status values(std::vector<std::string> words) { return check_megatron_flag_values(parse(std::move(words))); }

Status model_flags(std::vector<std::string> words, const GptModelSpec& model) {
  return check_megatron_model_flags(parse(std::move(words)), model, "ckpt");
}

std::vector<std::int64_t> layers(std::string_view text) {
  const auto pattern = parse_layer_pattern(text);
  EXPECT_TRUE(pattern.ok()) << pattern.status().message();
  EXPECT_FALSE(pattern.ok() && pattern->every) << text << " parsed as an integer";
  return pattern.ok() ? pattern->layers : std::vector<std::int64_t>{};
}

TEST(MegatronLayerPattern, IntegersAsPythonsIntReadsThem) {
  for (const auto& [text, every] :
       std::vector<std::pair<std::string, std::int64_t>>{{"1", 1}, {"2", 2}, {" 3 ", 3}, {"+4", 4}}) {
    const auto pattern = parse_layer_pattern(text);
    ASSERT_TRUE(pattern.ok()) << pattern.status().message();
    EXPECT_EQ(pattern->every, every) << text;
  }
}

TEST(MegatronLayerPattern, ListExpressionsEvaluateAsPython) {
  std::vector<std::int64_t> deepseek(3, 0);
  deepseek.resize(61, 1);
  EXPECT_EQ(layers("[0]*3+[1]*58"), deepseek);
  EXPECT_EQ(layers("([0]*1+[1]*2)"), (std::vector<std::int64_t>{0, 1, 1}));
  EXPECT_EQ(layers("[1,0,1]"), (std::vector<std::int64_t>{1, 0, 1}));
  EXPECT_EQ(layers("([1]*3+[0]*1)*2"), (std::vector<std::int64_t>{1, 1, 1, 0, 1, 1, 1, 0}));
  EXPECT_EQ(layers("2*[1]+[0]*(1+1)"), (std::vector<std::int64_t>{1, 1, 0, 0}));
  EXPECT_EQ(layers("[1]*2*2"), (std::vector<std::int64_t>{1, 1, 1, 1}));
  EXPECT_EQ(layers("[1,]+[]+[0]*0"), (std::vector<std::int64_t>{1}));
  EXPECT_EQ(layers("[0,1+1]"), (std::vector<std::int64_t>{0, 2}));
}

TEST(MegatronLayerPattern, AnythingElseIsRefusedSayingWhy) {
  for (const auto& [text, why] : std::vector<std::pair<std::string, std::string>>{
           {"[0] * 3", "only digits, commas, brackets, parentheses, + and * may appear (no spaces)"},
           {"[0]*3+[1]*x", "only digits"},
           {"(1,2)", "not an integer N or a Python list expression"},
           {"", "not an integer N"},
           {"two", "not an integer N"},
           {"[(1,2)]", "a tuple, not a list"},
           {"[()]", "() is a tuple"},
           {"[[1],[0]]", "a list inside a list"},
           {"[1,0][1]", "a list is indexed"},
           {"[1]*[2]", "two lists are multiplied"},
           {"[1]+1", "a list and an integer are added"},
           {"[01]", "leading zero"},
           {"[1", "ends too early"},
           {"[1]]", "unexpected ']' at character 4"},
           {"[1,,0]", "unexpected ','"},
           {"[1]*99999999", "a number is too large"},
           {"[1]*1000*1000*2", "too"},
           {"[1]+", "ends too early"},
           {std::string(1000, '(') + "[1]" + std::string(1000, ')'), "nest too deeply"}}) {
    EXPECT_TRUE(fails_with(parse_layer_pattern(text), why)) << text;
  }
}

TEST(MegatronWindowSize, TwoIntegersInOrWithoutParentheses) {
  using Window = std::pair<std::int64_t, std::int64_t>;
  EXPECT_EQ(*parse_window_size("(128, 0)"), (Window{128, 0}));
  EXPECT_EQ(*parse_window_size("127,0"), (Window{127, 0}));
  EXPECT_EQ(*parse_window_size("(-1,-1)"), (Window{-1, -1}));
  for (const std::string text : {"128", "(1,2,3)", "(a,0)", "", "(1 0)", "1.5,0"})
    EXPECT_TRUE(fails_with(parse_window_size(text), "not two integers (left, right)")) << text;
  EXPECT_TRUE(fails_with(parse_window_size("(-2, 0)"), "a window is at least 0 positions"));
}

TEST(MegatronFlagValues, Fp8IsRefusedAndItsTuningFlagsHaveNoEffect) {
  EXPECT_TRUE(fails_with(values({"--fp8-format", "hybrid"}),
                         "--fp8-format hybrid: FP8 is not supported; Trestle trains in fp32, bf16 or fp16"));
  EXPECT_TRUE(fails_with(values({"--fp8-param-gather"}), "--fp8-param-gather: FP8 parameters"));
  const std::vector<std::string> tuning = {
      "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max", "--fp8-recipe", "delayed",
      "--fp8-margin",           "-1"};
  EXPECT_TRUE(values(tuning).ok());
  EXPECT_EQ(given_flags_without_effect(parse(tuning)),
            (std::vector<std::string>{"--fp8-recipe delayed", "--fp8-margin -1", "--fp8-amax-history-len 1024",
                                      "--fp8-amax-compute-algo max"}));
  EXPECT_TRUE(fails_with(values({"--fp8-amax-compute-algo", "mean"}), "not one of most_recent, max"));
  EXPECT_TRUE(fails_with(values({"--fp8-amax-history-len", "-1"}), "must not be negative"));
}

TEST(MegatronFlagValues, TheRouterPrecisionIsFp32OrFp64) {
  EXPECT_TRUE(values({"--moe-router-dtype", "fp32"}).ok());
  EXPECT_TRUE(values({"--moe-router-dtype", "fp32", "--bf16"}).ok());
  EXPECT_TRUE(values({"--moe-router-dtype", "fp64", "--fp16"}).ok());
  EXPECT_TRUE(fails_with(values({"--moe-router-dtype", "bf16"}), "not one of fp32, fp64"));
}

TEST(MegatronFlagValues, AHybridPatternIsOneLetterPerLayerUnderOneName) {
  EXPECT_TRUE(values({"--hybrid-layer-pattern", "M-M*-ME"}).ok());
  EXPECT_TRUE(values({"--hybrid-override-pattern", "M*"}).ok());
  EXPECT_TRUE(fails_with(values({"--hybrid-layer-pattern", "M*", "--hybrid-override-pattern", "M*"}),
                         "--hybrid-override-pattern and --hybrid-layer-pattern: give one"));
  EXPECT_TRUE(fails_with(values({"--hybrid-layer-pattern", "M-|M*"}), "pipeline stage boundaries ('|')"));
  EXPECT_TRUE(fails_with(values({"--hybrid-layer-pattern", "M*/MM"}), "MTP patterns ('/') are not taken"));
  EXPECT_TRUE(fails_with(values({"--hybrid-layer-pattern", "M*D"}), "'D' is not one of M (Mamba)"));
  EXPECT_TRUE(fails_with(values({"--hybrid-layer-pattern", ""}), "--hybrid-layer-pattern : empty"));
}

TEST(MegatronFlagValues, LoadBalancingTypesEachWithItsCoefficient) {
  EXPECT_TRUE(values({"--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01"}).ok());
  EXPECT_TRUE(values({"--moe-router-load-balancing-type", "none"}).ok());
  EXPECT_TRUE(values({"--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0.01"}).ok());
  EXPECT_TRUE(values({"--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4"}).ok());
  EXPECT_TRUE(values({"--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "1e-3"}).ok());
  for (const std::string type : {"sinkhorn", "quantile_balancing"})
    EXPECT_TRUE(fails_with(values({"--moe-router-load-balancing-type", type}),
                           "--moe-router-load-balancing-type " + type + " is not supported"));
  EXPECT_TRUE(
      values({"--moe-router-load-balancing-type", "seq_aux_loss,global_aux_loss", "--moe-aux-loss-coeff", "1e-4,1e-3"})
          .ok());
  EXPECT_TRUE(
      fails_with(values({"--moe-router-load-balancing-type", "aux_loss,seq_aux_loss"}),
                 "--moe-router-load-balancing-type aux_loss seq_aux_loss takes 2 --moe-aux-loss-coeff value(s), "
                 "one for each type, as Megatron requires; 1 given"));
  EXPECT_TRUE(
      fails_with(values({"--moe-router-load-balancing-type", "aux_loss,aux_loss", "--moe-aux-loss-coeff", "1e-2,1e-3"}),
                 "aux_loss is given twice"));
  EXPECT_TRUE(
      fails_with(values({"--moe-router-load-balancing-type", "aux_loss,sinkhorn", "--moe-aux-loss-coeff", "1e-2,1e-3"}),
                 "--moe-router-load-balancing-type sinkhorn is not supported"));
  EXPECT_TRUE(fails_with(values({"--moe-aux-loss-coeff", "1e-2,1e-3"}),
                         "--moe-aux-loss-coeff: one coefficient for Megatron's default load balancing"));
  EXPECT_TRUE(fails_with(values({"--moe-router-load-balancing-type", "switch"}), "not one of aux_loss"));
  EXPECT_TRUE(fails_with(values({"--moe-router-force-load-balancing"}), "random logits"));
  EXPECT_TRUE(fails_with(values({"--moe-router-group-topk", "2"}), "needs --moe-router-num-groups"));
  EXPECT_TRUE(fails_with(values({"--moe-router-group-topk", "4", "--moe-router-num-groups", "2"}),
                         "more than --moe-router-num"));
}

TEST(MegatronFlagValues, AttentionCombinationsMegatronRefuses) {
  EXPECT_TRUE(fails_with(values({"--rope-type", "yarn"}),
                         "--rope-type yarn: Megatron takes it with "
                         "--multi-latent-attention only"));
  EXPECT_TRUE(values({"--rope-type", "yarn", "--multi-latent-attention"}).ok());
  EXPECT_TRUE(fails_with(values({"--rope-type", "ntk"}), "not one of rope, yarn"));
  EXPECT_TRUE(fails_with(values({"--softmax-type", "sink"}), "not one of vanilla, off-by-one, learnable"));
  EXPECT_TRUE(fails_with(values({"--window-size", "128"}), "--window-size: 128: not two integers"));
  EXPECT_TRUE(fails_with(values({"--moe-layer-freq", "[0]*3 + [1]"}), "--moe-layer-freq: [0]*3 + [1]: only digits"));
  EXPECT_TRUE(fails_with(values({"--moe-layer-freq", "[2]*4"}), "holds 2 (0: dense, 1: MoE)"));
  EXPECT_TRUE(fails_with(values({"--moe-layer-freq", "0"}), "--moe-layer-freq 0 must be at least 1"));
  EXPECT_TRUE(values({"--window-attn-skip-freq", "[2,0]"}).ok());  // Megatron windows any non-zero entry
  EXPECT_TRUE(fails_with(values({"--quick-geglu", "--swiglu"}), "exclude each other"));
  EXPECT_TRUE(fails_with(values({"--no-position-embedding"}), "with --position-embedding-type rope only"));
  EXPECT_TRUE(values({"--no-position-embedding", "--position-embedding-type", "rope"}).ok());
  EXPECT_TRUE(fails_with(values({"--q-lora-rank", "-1"}), "--q-lora-rank must not be negative"));
}

TEST(MegatronFlagValues, NoEffectFlagsAreNamedWithTheirValues) {
  const std::vector<std::string> flags = {"--attention-softmax-in-fp32",
                                          "--no-mmap-bin-files",
                                          "--tiktoken-pattern",
                                          "v2",
                                          "--logging-level",
                                          "40",
                                          "--auto-detect-ckpt-format",
                                          "--record-memory-history",
                                          "--memory-snapshot-path",
                                          "/tmp/snapshot.pickle",
                                          "--cuda-graph-impl",
                                          "local",
                                          "--recompute-activations",
                                          "--recompute-modules",
                                          "mlp,moe",
                                          "--init-model-with-meta-device",
                                          "--moe-flex-dispatcher-backend",
                                          "hybridep",
                                          "--enable-gpt-oss",
                                          "--export-force-local-attention"};
  EXPECT_TRUE(values(flags).ok());
  const auto named = given_flags_without_effect(parse(flags));
  for (const std::string word : {"--recompute-modules mlp moe", "--tiktoken-pattern v2", "--logging-level 40",
                                 "--cuda-graph-impl local", "--enable-gpt-oss"})
    EXPECT_NE(std::find(named.begin(), named.end(), word), named.end()) << word;
  EXPECT_EQ(named.size(), 14u);
  EXPECT_TRUE(
      fails_with(values({"--recompute-modules", "mlp,attention"}), "--recompute-modules attention: not one of"));
  EXPECT_TRUE(fails_with(values({"--tiktoken-pattern", "v3"}), "not one of v1, v2"));
  EXPECT_TRUE(fails_with(values({"--cuda-graph-impl", "full"}), "not one of none, local, transformer_engine"));
  EXPECT_TRUE(fails_with(values({"--logging-level", "-1"}), "must not be negative"));
  for (const std::string flag : {"--recompute-modules", "--moe-router-load-balancing-type", "--moe-aux-loss-coeff",
                                 "--cp-comm-type", "--cuda-graph-modules", "--tokenizer-special-tokens"})
    EXPECT_NE(std::find(megatron_list_flags().begin(), megatron_list_flags().end(), flag), megatron_list_flags().end())
        << flag;
}

// Megatron-LM 0.19's training flags: those that choose how Megatron runs, writes or logs are accepted and named
// (numbers and several words too); the precision-aware optimizer takes fp32 states only; its old flags are refused
// with its own messages, and FP4 as FP8 is.
TEST(MegatronFlagValues, MegatronLm019FlagsAreAcceptedNamedOrRefused) {
  const std::vector<std::string> flags = {"--use-dist-ckpt",
                                          "--dist-ckpt-format",
                                          "torch_dist",
                                          "--ddp-average-in-collective",
                                          "--sgd-momentum",
                                          "0.95",
                                          "--cuda-graph-modules",
                                          "attn,moe_router",
                                          "--tokenizer-special-tokens",
                                          "<s>,</s>",
                                          "--use-precision-aware-optimizer",
                                          "--exp-avg-dtype",
                                          "fp32",
                                          "--no-one-logger",
                                          "--check-for-spiky-loss",
                                          "--local-rank",
                                          "3"};
  EXPECT_TRUE(values(flags).ok()) << values(flags).message();
  const auto named = given_flags_without_effect(parse(flags));
  for (const std::string word : {"--ddp-average-in-collective", "--sgd-momentum 0.95",
                                 "--cuda-graph-modules attn moe_router", "--tokenizer-special-tokens <s> </s>",
                                 "--exp-avg-dtype fp32", "--local-rank 3", "--dist-ckpt-format torch_dist"})
    EXPECT_NE(std::find(named.begin(), named.end(), word), named.end()) << word;
  EXPECT_EQ(named.size(), 11u);
  EXPECT_TRUE(values({"--exp-avg-dtype", "bf16"}).ok()) << "without the precision-aware optimizer Megatron ignores it";
  EXPECT_TRUE(fails_with(values({"--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16"}),
                         "--exp-avg-dtype bf16 (--use-precision-aware-optimizer): Trestle keeps"));
  EXPECT_TRUE(fails_with(values({"--exp-avg-dtype", "fp4"}), "not one of fp32, fp16, bf16, fp8"));
  EXPECT_TRUE(fails_with(values({"--cuda-graph-modules", "attention"}), "--cuda-graph-modules attention: not one of"));
  EXPECT_TRUE(fails_with(values({"--batch-size", "8"}),
                         "--batch-size argument is no longer valid, use "
                         "--micro-batch-size instead (Megatron-LM refuses it too)"));
  EXPECT_TRUE(fails_with(values({"--checkpoint-activations"}), "--checkpoint-activations is no longer valid"));
  EXPECT_TRUE(fails_with(values({"--warmup", "10"}), "use --lr-warmup-fraction instead"));
  EXPECT_TRUE(fails_with(values({"--model-parallel-size", "2"}), "use --tensor-model-parallel-size instead"));
  EXPECT_TRUE(fails_with(values({"--fp4-format", "nvfp4"}), "--fp4-format: FP4 is not supported"));
  EXPECT_TRUE(fails_with(values({"--fp16-lm-cross-entropy"}), "only support in fp16 mode"));
  EXPECT_TRUE(values({"--fp16-lm-cross-entropy", "--fp16"}).ok());
}

GptModelSpec llama() {
  GptModelSpec m;
  m.num_layers = 4;
  m.hidden_size = 64;
  m.ffn_hidden_size = 96;
  m.num_attention_heads = 4;
  m.num_query_groups = 2;
  m.kv_channels = 16;
  m.vocab_size = 4096;
  return m;
}

GptModelSpec llama3() {
  GptModelSpec m = llama();
  m.rotary_base = 500000;
  m.rope_scaling.type = RopeScalingType::kLlama3;
  m.rope_scaling.factor = 8;
  return m;
}

GptModelSpec mixtral() {
  GptModelSpec m = llama();
  m.ffn_hidden_size = 32;
  m.num_experts = 4;
  return m;
}

GptModelSpec deepseek_v3() {
  GptModelSpec m = mixtral();
  m.num_query_groups = 4;
  m.kv_channels = 12;
  m.num_experts = 8;
  m.q_lora_rank = 24;
  m.kv_lora_rank = 16;
  m.qk_head_dim = 8;
  m.qk_pos_emb_head_dim = 4;
  m.v_head_dim = 12;
  m.moe_first_dense_layers = 1;
  m.dense_ffn_hidden_size = 96;
  m.shared_expert_ffn_hidden_size = 32;
  m.moe_router_score_function = "sigmoid";
  m.moe_router_expert_bias = true;
  m.moe_router_num_groups = 2;
  m.moe_router_group_topk = 1;
  m.moe_router_topk_scaling_factor = 2.5;
  m.rope_scaling = {RopeScalingType::kYarn, 4.0, 1.0, 4.0, 8, 32.0, 1.0, 1.0, 1.0, true};
  return m;
}

GptModelSpec gpt_oss() {
  GptModelSpec m = mixtral();
  m.rotary_base = 150000;
  m.rope_scaling = {RopeScalingType::kYarn, 32.0, 1.0, 4.0, 4096, 32.0, 1.0, 0.0, 0.0, false};
  m.window_size = 8;
  m.mixed_attention = true;
  m.window_layers = {true, false, true, false};
  m.add_bias_linear = true;
  m.softmax_offset = true;
  m.quick_geglu = true;
  m.activation_clamp = 7.0;
  m.glu_linear_offset = 1.0;
  return m;
}

TEST(MegatronModelFlags, MultiLatentAttentionAndGroupLimitedRoutingDescribeDeepSeekV3) {
  const GptModelSpec m = deepseek_v3();
  EXPECT_TRUE(model_flags({"--multi-latent-attention",
                           "--q-lora-rank",
                           "24",
                           "--kv-lora-rank",
                           "16",
                           "--qk-head-dim",
                           "8",
                           "--qk-pos-emb-head-dim",
                           "4",
                           "--v-head-dim",
                           "12",
                           "--kv-channels",
                           "128",
                           "--qk-layernorm",
                           "--position-embedding-type",
                           "rope",
                           "--rope-type",
                           "yarn",
                           "--rotary-scaling-factor",
                           "4",
                           "--mscale",
                           "1.0",
                           "--mscale-all-dim",
                           "1.0",
                           "--moe-layer-freq",
                           "[0]*1+[1]*3",
                           "--moe-router-pre-softmax",
                           "--moe-router-num-groups",
                           "2",
                           "--moe-router-group-topk",
                           "1",
                           "--moe-router-score-function",
                           "sigmoid",
                           "--moe-router-enable-expert-bias",
                           "--moe-router-topk-scaling-factor",
                           "2.5"},
                          m)
                  .ok());
  EXPECT_TRUE(model_flags({"--moe-layer-freq", "([0]*1+[1]*3)"}, m).ok());
  GptModelSpec full_size = m;  // DeepSeek-V3's 61 layers, the first 3 dense, in its script's pattern
  full_size.num_layers = 61;
  full_size.moe_first_dense_layers = 3;
  EXPECT_TRUE(model_flags({"--moe-layer-freq", "[0]*3+[1]*58"}, full_size).ok());
  EXPECT_TRUE(fails_with(model_flags({"--moe-layer-freq", "[0]*1+[1]*60"}, full_size),
                         "makes the layers [0]*1+[1]*60 (1: MoE); the model's are [0]*3+[1]*58 (ckpt)"));
  for (const auto& [flags, why] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--q-lora-rank", "32"}, "--q-lora-rank 32 differs from the model's 24 (ckpt)"},
           {{"--kv-lora-rank", "512"}, "--kv-lora-rank 512 differs from the model's 16"},
           {{"--qk-pos-emb-head-dim", "64"}, "--qk-pos-emb-head-dim 64 differs from the model's 4"},
           {{"--v-head-dim", "128"}, "--v-head-dim 128 differs from the model's 12"},
           {{"--rotary-scaling-factor", "40"}, "--rotary-scaling-factor 40 differs from the model's 4"},
           {{"--mscale-all-dim", "0"}, "--mscale-all-dim 0 differs from the model's 1"},
           {{"--rope-type", "rope"}, "--rope-type rope differs from the model's yarn"},
           {{"--moe-layer-freq", "1"}, "--moe-layer-freq 1 makes the layers [1]*4 (1: MoE); the model's are [0,1,1,1]"},
           {{"--moe-layer-freq", "[0]*2+[1]*2"}, "makes the layers [0,0,1,1] (1: MoE); the model's are [0,1,1,1]"},
           {{"--moe-layer-freq", "[0]*1+[1]*2"}, "--moe-layer-freq [0]*1+[1]*2 gives 3 layers; the model has 4"},
           {{"--moe-router-group-topk", "2"}, "--moe-router-group-topk 2 differs from the model's 1"},
           {{"--moe-router-num-groups", "8"}, "--moe-router-num-groups 8 differs from the model's 2"}}) {
    EXPECT_TRUE(fails_with(model_flags(flags, m), why)) << flags[0];
  }
}

TEST(MegatronModelFlags, LatentAttentionWithPlainRopeKeepsMegatronsSoftmaxScaleInView) {
  GptModelSpec m = deepseek_v3();
  m.rope_scaling = RopeScaling{};
  EXPECT_TRUE(model_flags({"--rope-type", "rope", "--rotary-scaling-factor", "40"}, m).ok());
  EXPECT_TRUE(
      fails_with(model_flags({"--rope-type", "rope", "--rotary-scaling-factor", "40", "--mscale-all-dim", "1"}, m),
                 "scales multi-latent attention's softmax by mscale(factor, mscale_all_dim)²"));
  EXPECT_TRUE(fails_with(model_flags({"--rope-type", "yarn"}, m), "--rope-type yarn differs from the model's rope"));
  // Megatron's default rope type for multi-latent attention is yarn: a factor other than 1 is YaRN's.
  EXPECT_TRUE(fails_with(model_flags({"--rotary-scaling-factor", "40"}, m), "differs from the model's 1"));
}

TEST(MegatronModelFlags, MixtralsRouterAndAttention) {
  const GptModelSpec m = mixtral();
  EXPECT_TRUE(model_flags({"--moe-layer-freq", "1", "--q-lora-rank", "8", "--moe-router-group-topk", "0",
                           "--window-attn-skip-freq", "3", "--glu-linear-offset", "0", "--softmax-type", "vanilla"},
                          m)
                  .ok());
  // No routed scaling factor scales by 1 (megatron-core applies one only when set): a script's 1.0 describes it.
  EXPECT_TRUE(model_flags({"--moe-router-topk-scaling-factor", "1.0"}, m).ok());
  EXPECT_TRUE(fails_with(model_flags({"--moe-router-topk-scaling-factor", "2"}, m),
                         "--moe-router-topk-scaling-factor 2 differs from the model's 1"));
  for (const auto& [flags, why] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--moe-router-pre-softmax"}, "--moe-router-pre-softmax: the model's router takes the softmax after"},
           {{"--multi-latent-attention"}, "--multi-latent-attention: the model's attention is not multi-latent"},
           {{"--moe-layer-freq", "2"}, "makes the layers [1,0,1,0] (1: MoE); the model's are [1]*4"},
           {{"--activation-func-clamp-value", "7"}, "differs from the model's none (no clamp)"},
           {{"--softmax-type", "learnable"}, "--softmax-type learnable differs from the model's vanilla"},
           {{"--window-size", "(7, 0)"}, "--window-size (7, 0) differs from the model's none (no sliding window)"},
           {{"--quick-geglu"}, "--quick-geglu: the model's MLP is not quick GeGLU"},
           {{"--glu-linear-offset", "1"}, "--glu-linear-offset 1 differs from the model's 0"},
           {{"--moe-router-num-groups", "2", "--moe-router-group-topk", "1"}, "--moe-router-group-topk 1 differs"}}) {
    EXPECT_TRUE(fails_with(model_flags(flags, m), why)) << flags[0];
  }
  EXPECT_TRUE(model_flags({"--moe-router-pre-softmax"}, llama()).ok());  // a dense model: Megatron reads no --moe-*
}

TEST(MegatronModelFlags, GptOssWindowsSinksYarnAndQuickGeglu) {
  const GptModelSpec m = gpt_oss();
  EXPECT_TRUE(model_flags({"--position-embedding-type",
                           "yarn",
                           "--rope-type",
                           "rope",
                           "--rotary-scaling-factor",
                           "32",
                           "--mscale",
                           "1.0",
                           "--mscale-all-dim",
                           "0.0",
                           "--yarn-original-max-position-embeddings",
                           "4096",
                           "--yarn-beta-fast",
                           "32",
                           "--yarn-beta-slow",
                           "1",
                           "--no-yarn-correction-range-round-to-int",
                           "--window-size",
                           "(7, 0)",
                           "--window-attn-skip-freq",
                           "2",
                           "--softmax-type",
                           "learnable",
                           "--quick-geglu",
                           "--glu-linear-offset",
                           "1.0",
                           "--activation-func-clamp-value",
                           "7.0",
                           "--add-qkv-bias"},
                          m)
                  .ok());
  EXPECT_TRUE(model_flags({"--window-size", "7,0", "--window-attn-skip-freq", "[1,0,1,0]"}, m).ok());
  for (const auto& [flags, why] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--position-embedding-type", "rope"}, "--position-embedding-type rope differs from the model's yarn"},
           {{"--use-rotary-position-embeddings"}, "'s RoPE is YaRN"},
           {{"--position-embedding-type", "yarn", "--rotary-scaling-factor", "40"}, "differs from the model's 32"},
           {{"--position-embedding-type", "yarn", "--mscale", "0.5"}, "--mscale 0.5 differs from the model's 1"},
           {{"--position-embedding-type", "yarn", "--yarn-correction-range-round-to-int"},
            "'s YaRN does not round its correction range"},
           {{"--position-embedding-type", "yarn", "--yarn-original-max-position-embeddings", "131072"},
            "differs from the model's 4096"},
           {{"--window-size", "(127, 0)"},
            "--window-size (127, 0) differs from the model's (7, 0): a window of 8 positions"},
           {{"--window-size", "(7, 7)"}, "differs from the model's (7, 0)"},
           {{"--window-size", "(-1, 0)"}, "differs from the model's (7, 0)"},
           {{"--window-size", "(7, 0)"},
            "--window-size with no --window-attn-skip-freq windows the layers [1]*4 (1: windowed); the model's are "
            "[1,0,1,0]"},
           {{"--window-size", "(7, 0)", "--window-attn-skip-freq", "3"}, "windows the layers [1,1,0,1]"},
           {{"--window-size", "(7, 0)", "--window-attn-skip-freq", "[1,0,1]"}, "gives 3 layers; the model has 4"},
           {{"--softmax-type", "off-by-one"}, "--softmax-type off-by-one differs from the model's learnable"},
           {{"--swiglu"}, "--swiglu: the model's MLP is not SwiGLU"},
           {{"--glu-linear-offset", "0"}, "--glu-linear-offset 0 differs from the model's 1"},
           {{"--activation-func-clamp-value", "0.2"}, "--activation-func-clamp-value 0.2 differs from the model's 7"},
           {{"--disable-bias-linear"}, "the model's linear layers have biases"}}) {
    EXPECT_TRUE(fails_with(model_flags(flags, m), why)) << flags[0] << " " << (flags.size() > 1 ? flags[1] : "");
  }
  // Without --window-size Megatron has no window and reads no --window-attn-skip-freq: nothing to compare.
  EXPECT_TRUE(model_flags({"--window-attn-skip-freq", "3"}, m).ok());
}

TEST(MegatronModelFlags, Llama31RopeScaling) {
  const GptModelSpec m = llama3();
  EXPECT_TRUE(
      model_flags({"--use-rope-scaling", "--position-embedding-type", "rope", "--rotary-base", "500000"}, m).ok());
  EXPECT_TRUE(model_flags({"--use-rope-scaling", "--rope-scaling-factor", "8"}, m).ok());
  EXPECT_TRUE(model_flags({"--rope-scaling-factor", "32"}, m).ok());  // read only with --use-rope-scaling
  EXPECT_TRUE(fails_with(model_flags({"--use-rope-scaling", "--rope-scaling-factor", "32"}, m),
                         "--rope-scaling-factor 32 differs from the model's 8"));
  GptModelSpec llama32 = m;
  llama32.rope_scaling.factor = 32;
  EXPECT_TRUE(fails_with(model_flags({"--use-rope-scaling"}, llama32),
                         "--use-rope-scaling's --rope-scaling-factor 8 differs from the model's 32"));
  GptModelSpec other = m;
  other.rope_scaling.original_max_position_embeddings = 4096;
  EXPECT_TRUE(fails_with(model_flags({"--use-rope-scaling"}, other),
                         "original_max_position_embeddings 4096; Megatron's are 1, 4 and 8192"));
  EXPECT_TRUE(fails_with(model_flags({"--use-rope-scaling"}, llama()),
                         "--use-rope-scaling: the model's RoPE has no Llama 3.1 scaling (its scaling: none)"));
  EXPECT_TRUE(fails_with(model_flags({"--position-embedding-type", "yarn"}, m),
                         "--position-embedding-type yarn differs from the model's rope"));
}

// --use-checkpoint-args: Megatron's load_args_from_checkpoint sets these from the checkpoint over the command line
// (force=True); the sizes it fills in only where a script leaves them out stay checked.
TEST(MegatronModelFlags, CheckpointArgsTakeTheForcedFlagsFromTheModel) {
  const GptModelSpec m = llama3();
  const std::vector<std::string> forced = {"--rotary-base",      "10000", "--normalization",         "LayerNorm",
                                           "--num-query-groups", "16",    "--group-query-attention", "--qk-layernorm"};
  const std::vector<std::string> sized = {"--hidden-size", "12345"};
  EXPECT_FALSE(check_megatron_model_flags(parse(forced), m, "ckpt").ok());
  EXPECT_FALSE(check_megatron_model_flags(parse({"--rotary-base", "10000"}), m, "ckpt").ok());
  EXPECT_TRUE(check_megatron_model_flags(parse({"--rotary-base", "10000"}), m, "ckpt", true).ok());
  EXPECT_TRUE(check_megatron_model_flags(
                  parse({"--normalization", "LayerNorm", "--num-query-groups", "16", "--group-query-attention"}), m,
                  "ckpt", true)
                  .ok());
  EXPECT_TRUE(fails_with(check_megatron_model_flags(parse(sized), m, "ckpt", true),
                         "--hidden-size 12345 differs from the model's"));
  EXPECT_TRUE(forced_by_checkpoint_args("swiglu") && forced_by_checkpoint_args("moe-router-topk"));
  EXPECT_FALSE(forced_by_checkpoint_args("hidden-size") || forced_by_checkpoint_args("kv-channels"));
}

TEST(MegatronModelFlags, ModelOptScriptsRopeVocabularyAndModelClass) {
  const GptModelSpec m = llama();
  EXPECT_TRUE(model_flags({"--rotary-seq-len-interpolation-factor", "1", "--no-rope-freq", "[0]*4",
                           "--export-model-type", "GPTModel", "--padded-vocab-size", std::to_string(m.vocab_size + 64)},
                          m)
                  .ok());
  GptModelSpec linear = m;
  linear.rope_scaling.type = RopeScalingType::kLinear;
  linear.rope_scaling.factor = 4;
  EXPECT_TRUE(model_flags({"--rotary-seq-len-interpolation-factor", "4"}, linear).ok());
  for (const auto& [flags, model, why] : std::vector<std::tuple<std::vector<std::string>, GptModelSpec, std::string>>{
           {{"--rotary-seq-len-interpolation-factor", "2"}, m, "differs from the model's RoPE, which has no linear"},
           {{"--rotary-seq-len-interpolation-factor", "2"}, linear, "differs from the model's linear scaling factor 4"},
           {{"--rotary-interleaved"}, m, "--rotary-interleaved: the model's RoPE rotates the two halves"},
           {{"--no-rope-freq", "2"}, m, "--no-rope-freq 2 makes the layers [0,1,0,1] (1: no RoPE)"},
           {{"--no-rope-freq", "[1]+[0]*3"}, m, "makes the layers [1,0,0,0] (1: no RoPE); the model's all use RoPE"},
           {{"--no-rope-freq", "[0]*3"}, m, "gives 3 layers; the model has 4"},
           {{"--no-rope-freq", "3"}, m, "the model's 4 layers do not divide by it"},
           {{"--padded-vocab-size", std::to_string(m.vocab_size - 1)}, m, "is less than the model's vocabulary"},
           {{"--export-model-type", "HybridModel"}, m, "--export-model-type HybridModel differs from the model's "},
           {{"--qk-l2-norm"}, m, "--qk-l2-norm: the model's queries and keys are not L2-normed"},
           {{"--export-moe-apply-probs-on-input"}, mixtral(), "weigh its experts' outputs, not their inputs"}}) {
    EXPECT_TRUE(fails_with(model_flags(flags, model), why)) << flags[0] << " " << (flags.size() > 1 ? flags[1] : "");
  }
}

TEST(MegatronModelFlags, GatedDeltaNetLayersAndGatesDescribeQwen3Next) {
  GptModelSpec m = llama();
  m.linear_attention_layers = {true, true, true, false};
  m.linear_conv_kernel_dim = 4;
  m.linear_key_head_dim = 128;
  m.linear_value_head_dim = 128;
  m.linear_num_key_heads = 16;
  m.linear_num_value_heads = 32;
  m.attention_output_gate = true;
  EXPECT_TRUE(
      model_flags({"--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "4",
                   "--linear-conv-kernel-dim", "4", "--linear-key-head-dim", "128", "--linear-value-head-dim", "128",
                   "--linear-num-key-heads", "16", "--linear-num-value-heads", "32", "--attention-output-gate"},
                  m)
          .ok());
  EXPECT_TRUE(model_flags({"--linear-attention-freq", "[1]*3+[0]"}, m).ok());
  for (const auto& [flags, why] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--linear-attention-freq", "2"},
            "makes the layers [1,0,1,0] (1: Gated DeltaNet); the model's are "
            "[1,1,1,0]"},
           {{"--linear-num-key-heads", "8"}, "--linear-num-key-heads 8 differs from the model's 16"},
           {{"--experimental-attention-variant", "dsa"}, "differs from the model's gated_delta_net"}}) {
    EXPECT_TRUE(fails_with(model_flags(flags, m), why)) << flags[0];
  }
  const GptModelSpec plain = llama();
  EXPECT_TRUE(model_flags({"--linear-key-head-dim", "8"}, plain).ok());  // Megatron reads it only for Gated DeltaNet
  EXPECT_TRUE(fails_with(model_flags({"--experimental-attention-variant", "gated_delta_net"}, plain),
                         "differs from the model's none"));
  EXPECT_TRUE(fails_with(model_flags({"--linear-attention-freq", "4"}, plain), "the model has no Gated DeltaNet"));
  EXPECT_TRUE(fails_with(model_flags({"--attention-output-gate"}, plain), "the model's attention output is not gated"));
  EXPECT_TRUE(fails_with(model_flags({"--moe-shared-expert-gate"}, mixtral()), "the model's shared expert is not"));
}

// Megatron-LM's communication and overlap choices: accepted, named, and a context-parallel communication kind that
// Megatron does not offer is refused.
TEST(MegatronFlagValues, CommunicationChoicesAreAcceptedAndChecked) {
  EXPECT_TRUE(values({"--cp-comm-type", "p2p", "a2a+p2p", "--no-overlap-p2p-communication",
                      "--fsdp-manual-registration", "--overlap-param-gather-with-optimizer-step",
                      "--no-align-param-gather", "--disable-symmetric-registration"})
                  .ok());
  EXPECT_TRUE(fails_with(values({"--cp-comm-type", "ring"}), "not one of p2p, a2a, allgather, a2a+p2p"));
}

TEST(MegatronFlagValues, ModelOptScriptsValues) {
  EXPECT_TRUE(values({"--moe-shared-expert-overlap", "--moe-layer-recompute", "--export-model-type", "MambaModel",
                      "--no-rope-freq", "([0]*3+[1])*2"})
                  .ok());
  EXPECT_TRUE(fails_with(values({"--export-model-type", "BertModel"}), "not one of GPTModel, HybridModel, MambaModel"));
  EXPECT_TRUE(fails_with(values({"--no-rope-freq", "[0,2]"}), "holds 2 (0: RoPE, 1: none)"));
  EXPECT_TRUE(fails_with(values({"--padded-vocab-size", "0"}), "--padded-vocab-size must be at least 1"));
  EXPECT_TRUE(fails_with(values({"--rotary-seq-len-interpolation-factor", "0"}), "must be at least 1"));
  EXPECT_TRUE(fails_with(values({"--linear-attention-freq", "[1,2]"}), "holds 2 (0: attention, 1: Gated DeltaNet)"));
  EXPECT_TRUE(fails_with(values({"--experimental-attention-variant", "mamba"}), "not one of gated_delta_net, dsa"));
  EXPECT_TRUE(fails_with(values({"--linear-key-head-dim", "-1"}), "--linear-key-head-dim must not be negative"));
  EXPECT_TRUE(values({"--dataloader-type", "single"}).ok());
  EXPECT_TRUE(fails_with(values({"--dataloader-type", "cyclic"}), "cyclic's reshuffled epochs"));
  EXPECT_TRUE(fails_with(values({"--dataloader-type", "random"}), "not one of single, cyclic, external"));
}

// Megatron-LM 0.16.1 spellings of what Trestle takes (found in its parser), accepted and named; flags whose meaning
// Trestle does not train, refused saying why (they were "Option does not exist"); the hybrid ratios beside a pattern,
// which Megatron then only compares, accepted.
TEST(MegatronFlagValues, Megatron016SpellingsAndRefusalsWithReasons) {
  const std::vector<std::string> accepted = {"--disable-async-tensor-model-parallel-allreduce",
                                             "--disable-ckpt-fully-parallel-save",
                                             "--tokenizer-hf-use-fast",
                                             "--legacy-tokenizer",
                                             "--rerun-mode",
                                             "disabled",
                                             "--save-retain-interval",
                                             "10",
                                             "--distributed-timeout-seconds-after-init",
                                             "600",
                                             "--use-torch-fsdp2",
                                             "--spec",
                                             "megatron.core.models.mamba.mamba_layer_specs",
                                             "mamba_stack_spec"};
  EXPECT_TRUE(values(accepted).ok()) << values(accepted).message();
  const auto named = given_flags_without_effect(parse(accepted));
  EXPECT_NE(std::find(named.begin(), named.end(), "--rerun-mode disabled"), named.end());
  EXPECT_TRUE(fails_with(values({"--rerun-mode", "sometimes"}), "not one of"));
  EXPECT_TRUE(fails_with(values({"--spec", "my.module", "my_spec"}), "not one of"));
  for (const auto& [flags, says] :
       {std::pair<std::vector<std::string>, std::string>{{"--full-validation"}, "--full-validation: refused"},
        {{"--data-parallel-random-init"}, "one model is trained here"},
        {{"--fp32-residual-connection"}, "stays in the training dtype"},
        {{"--openai-gelu"}, "--openai-gelu: refused"},
        {{"--init-method-xavier-uniform"}, "--init-method-std"},
        {{"--moe-input-jitter-eps", "0.01"}, "not jittered"},
        {{"--yaml-cfg", "a.yaml"}, "give them as flags"},
        {{"--hybrid-attention-ratio", "0.25"}, "give the layers' pattern"}})
    EXPECT_TRUE(fails_with(values(flags), says)) << flags[0];
  EXPECT_TRUE(
      values({"--hybrid-attention-ratio", "0.25", "--hybrid-mlp-ratio", "0.5", "--hybrid-override-pattern", "M*M-"})
          .ok());
}

// Megatron-FSDP's flags (its DeepSeek-V3 example script passes them), NVIDIA's in-process restart and the Muon and FIM
// tuning flags are accepted and named as without effect; the FSDP dtypes that would change the arithmetic, the FIM and
// SFT datasets and upcycling are refused saying why.
TEST(MegatronFlagValues, MegatronFsdpInProcessRestartAndDatasetVariants) {
  const std::vector<std::string> accepted = {"--use-megatron-fsdp",
                                             "--data-parallel-sharding-strategy",
                                             "optim_grads_params",
                                             "--fsdp-double-buffer",
                                             "--megatron-fsdp-main-params-dtype",
                                             "fp32",
                                             "--megatron-fsdp-main-grads-dtype",
                                             "auto",
                                             "--megatron-fsdp-grad-comm-dtype",
                                             "fp32",
                                             "--fsdp-manual-registration",
                                             "--inprocess-restart",
                                             "--inprocess-granularity",
                                             "rank",
                                             "--muon-scale-mode",
                                             "spectral",
                                             "--fim-rate",
                                             "0.5"};
  EXPECT_TRUE(values(accepted).ok()) << values(accepted).message();
  const auto named = given_flags_without_effect(parse(accepted));
  for (const std::string word : {"--data-parallel-sharding-strategy optim_grads_params", "--fsdp-double-buffer",
                                 "--inprocess-granularity rank", "--megatron-fsdp-main-grads-dtype auto"})
    EXPECT_NE(std::find(named.begin(), named.end(), word), named.end()) << word;
  EXPECT_TRUE(fails_with(values({"--data-parallel-sharding-strategy", "full"}), "not one of no_shard, optim"));
  EXPECT_TRUE(fails_with(values({"--megatron-fsdp-main-params-dtype", "bf16"}), "master weights in fp32"));
  EXPECT_TRUE(fails_with(values({"--megatron-fsdp-grad-comm-dtype", "bf16"}), "--grad-reduce-in-bf16"));
  EXPECT_TRUE(fails_with(values({"--muon-tp-mode", "sideways"}), "not one of blockwise"));
  for (const auto& [flags, says] :
       {std::pair<std::vector<std::string>, std::string>{{"--fim-data"}, "fill-in-the-middle"},
        {{"--sft"}, "supervised fine-tuning"},
        {{"--moe-use-upcycling"}, "upcycling a dense checkpoint"}})
    EXPECT_TRUE(fails_with(values(flags), says)) << flags[0];
}

}  // namespace
}  // namespace trestle::cli

namespace trestle::cli {
namespace {

// A script's model flags that leave out numbers the model does not share with Megatron-LM's defaults (validate_args
// fills in a RoPE base of 10000, epsilon 1e-5, hidden / heads channels, 4 h or, with --swiglu, 2/3 of it rounded to
// 64 for the MLP): each is named, as Megatron would build another model from the script.
TEST(MegatronDefaultsUnlike, NamesTheNumbersMegatronWouldFillIn) {
  GptModelSpec m;
  m.num_layers = 2;
  m.hidden_size = 64;
  m.num_attention_heads = 4;
  m.num_query_groups = 4;
  m.kv_channels = 32;
  m.ffn_hidden_size = 96;
  m.rotary_base = 500000;
  m.norm_epsilon = 1e-6;
  m.qk_layernorm = true;
  const std::vector<std::string> described = {"--num-layers",
                                              "2",
                                              "--hidden-size",
                                              "64",
                                              "--normalization",
                                              "RMSNorm",
                                              "--position-embedding-type",
                                              "rope",
                                              "--swiglu",
                                              "--untie-embeddings-and-output-weights",
                                              "--disable-bias-linear"};
  std::string listed;
  for (const auto& flag : megatron_defaults_unlike(parse(described), m)) listed += flag + "\n";
  for (const char* expected :
       {"--rotary-base 500000 (Megatron's default: 10000)", "--norm-epsilon 1e-06 (Megatron's default: 1e-5)",
        "--kv-channels 32 (Megatron's default: hidden size / heads, 16)",
        "--ffn-hidden-size 96 (Megatron's default here: 128)", "--qk-layernorm"})
    EXPECT_NE(listed.find(expected), std::string::npos) << expected << "\n" << listed;
  std::vector<std::string> given = described;
  for (const char* word : {"--rotary-base", "500000", "--norm-epsilon", "1e-6", "--kv-channels", "32",
                           "--ffn-hidden-size", "96", "--qk-layernorm"})
    given.push_back(word);
  EXPECT_TRUE(megatron_defaults_unlike(parse(given), m).empty());
}

}  // namespace
}  // namespace trestle::cli
