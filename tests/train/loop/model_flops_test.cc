// The FLOPs per token behind MFU against Megatron-LM's own count: each expected figure is what
// megatron/training/training.py's num_floating_point_operations (NVIDIA/Megatron-LM at d98e8a6, 2026-08-22) returned,
// divided by batch × seq_length, for the same sizes given as its args.
#include "train/loop/model_flops.h"

#include <gtest/gtest.h>

namespace trestle::train {
namespace {

GptModelSpec dense(std::int64_t hidden, std::int64_t layers, std::int64_t ffn, std::int64_t heads, std::int64_t groups,
                   std::int64_t kv_channels) {
  GptModelSpec s;
  s.hidden_size = hidden;
  s.num_layers = layers;
  s.ffn_hidden_size = ffn;
  s.num_attention_heads = heads;
  s.num_query_groups = groups;
  s.kv_channels = kv_channels;
  s.vocab_size = 1000;  // the padded vocabulary is the function's argument
  return s;
}

TEST(ModelFlopsTest, LlamaAsMegatronCountsIt) {
  // TinyLlama's shape (`bench train --preset llama-1b`). By hand: per layer 6 · (2048 · (2048 + 2 · 256) + 2048 ·
  // 2048) for the projections + 6 · 2048 · 2048 for causal attention (half the scores) + 6 · 3 · 2048 · 5632 for the
  // gated MLP, 22 layers, + 6 · 2048 · 32000 for the output layer.
  const GptModelSpec s = dense(2048, 22, 5632, 32, 4, 64);
  EXPECT_DOUBLE_EQ(model_flops_per_token(s, 2048, 32000), 6760169472.0);
  // The full score matrix (Megatron's count before 2025-03) would be 7313817600: MFU 8% higher than it is.
}

TEST(ModelFlopsTest, MixtureOfExpertsCountsTheRoutedExpertsAndTheSharedOne) {
  GptModelSpec s = dense(1024, 8, 2816, 16, 4, 64);  // `--preset mixtral-small`
  s.num_experts = 8;
  s.moe_router_topk = 2;
  EXPECT_DOUBLE_EQ(model_flops_per_token(s, 2048, 32000), 1253572608.0);
}

TEST(ModelFlopsTest, GatedAttentionAndGatedDeltaNetLayers) {
  GptModelSpec mha = dense(512, 4, 1536, 8, 8, 96);  // heads · kv_channels wider than hidden
  mha.attention_output_gate = true;
  EXPECT_DOUBLE_EQ(model_flops_per_token(mha, 1000, 4224), 135217152.0);

  GptModelSpec next = dense(512, 4, 256, 8, 2, 64);  // Qwen3-Next's layout: three Gated DeltaNet layers, then one
  next.attention_output_gate = true;
  next.num_experts = 8;
  next.moe_router_topk = 3;
  next.shared_expert_ffn_hidden_size = 384;
  next.linear_attention_layers = {true, true, true, false};
  next.linear_key_head_dim = 32;
  next.linear_value_head_dim = 48;
  next.linear_num_key_heads = 4;
  next.linear_num_value_heads = 8;
  next.linear_conv_kernel_dim = 4;
  EXPECT_DOUBLE_EQ(model_flops_per_token(next, 512, 4096), 76624896.0);
}

// Multi-latent attention's sizes on `s` (queries through one linear_q_proj).
GptModelSpec with_latent_attention(GptModelSpec s) {
  s.kv_lora_rank = 128;
  s.qk_head_dim = 48;
  s.qk_pos_emb_head_dim = 16;
  s.v_head_dim = 40;
  return s;
}

TEST(ModelFlopsTest, LatentAttentionDenseFirstLayersAndMultiTokenPrediction) {
  GptModelSpec s = with_latent_attention(dense(640, 5, 192, 10, 10, 64));  // DeepSeek-V3's layout
  s.q_lora_rank = 320;
  s.num_experts = 16;
  s.moe_router_topk = 4;
  s.moe_first_dense_layers = 2;
  s.dense_ffn_hidden_size = 1024;
  s.shared_expert_ffn_hidden_size = 192;
  s.mtp_num_layers = 1;
  EXPECT_DOUBLE_EQ(model_flops_per_token(s, 700, 8192), 180125568.0);

  const GptModelSpec plain_queries = with_latent_attention(dense(640, 3, 1280, 10, 10, 64));
  EXPECT_DOUBLE_EQ(model_flops_per_token(plain_queries, 700, 8192), 97915584.0);
}

TEST(ModelFlopsTest, HybridMambaModels) {
  GptModelSpec s = dense(1024, 8, 3072, 8, 2, 128);  // Nemotron-H's mixers: Mamba, MLP, attention, experts
  s.hybrid_layers = "M-M*-M-E";
  s.squared_relu = true;
  s.mamba_num_heads = 32;
  s.mamba_head_dim = 64;
  s.mamba_state_dim = 64;
  s.mamba_num_groups = 4;
  s.num_experts = 8;
  s.moe_router_topk = 2;
  s.dense_ffn_hidden_size = 3072;
  s.shared_expert_ffn_hidden_size = 1024;
  EXPECT_DOUBLE_EQ(model_flops_per_token(s, 1024, 16384), 455540736.0);

  GptModelSpec latent = s;  // experts in a latent space of 256
  latent.num_layers = 4;
  latent.hybrid_layers = "M*EE";
  latent.ffn_hidden_size = 768;
  latent.moe_latent_size = 256;
  EXPECT_DOUBLE_EQ(model_flops_per_token(latent, 1024, 16384), 207421440.0);
}

}  // namespace
}  // namespace trestle::train
