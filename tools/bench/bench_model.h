// Benchmark fixtures shared by the conversion and reshard benchmarks: a generated Llama-shaped bf16 Hugging Face model
// on disk, and the CLI that converts it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/status.h"
#include "tools/bench/bench_state_dict.h"

namespace trestle::cli {

// A Llama shape near `bytes` whose layers split over pp and KV heads and ffn over tp.
Result<LlamaShape> llama_shape_for_layout(std::uint64_t bytes, int tp, int pp);
// Writes config.json and sharded safetensors (1 GB shards) of random bf16 weights into dir.
Status write_llama_hf_model(const std::string& dir, const LlamaShape& shape);
// A DeepSeek-V3-shaped model (multi-latent attention, one dense layer, then MoE layers of many small experts with a
// shared expert and the router's correction bias) near `bytes`, its layers splitting over pp and its heads and
// experts over tp and ep.
struct DeepSeekShape {
  std::int64_t hidden = 1024, heads = 16, q_lora = 384, kv_lora = 256, nope = 64, rope = 32, v = 64;
  std::int64_t dense_ffn = 2816, expert_ffn = 256, experts = 64, per_token = 6, groups = 8, group_topk = 3;
  std::int64_t layers = 0, vocab = 32000;
};
Result<DeepSeekShape> deepseek_shape_for_layout(std::uint64_t bytes, int tp, int pp, int ep);
// Writes config.json and sharded safetensors (1 GB shards) of random weights (bf16; the correction bias fp32).
Status write_deepseek_hf_model(const std::string& dir, const DeepSeekShape& shape);

// A GLM-4.5-shaped model (grouped-query attention with q/k/v biases and q/k norms, RoPE over half of each 128-dim
// head, one dense layer, then MoE layers of many small experts with a shared expert and the router's correction bias)
// near `bytes`, its layers splitting over pp, its KV heads over tp and its experts over ep.
struct GlmShape {
  std::int64_t hidden = 1024, heads = 16, kv_heads = 4, head_dim = 128;
  std::int64_t dense_ffn = 2816, expert_ffn = 256, experts = 64, per_token = 8;
  std::int64_t layers = 0, vocab = 32000;
};
Result<GlmShape> glm_shape_for_layout(std::uint64_t bytes, int tp, int pp, int ep);
// Writes config.json and sharded safetensors (1 GB shards) of random weights (bf16; the correction bias fp32).
Status write_glm_hf_model(const std::string& dir, const GlmShape& shape);

// A Qwen3-Next-shaped model: Gated DeltaNet layers at the real widths (16 key heads of 128, 32 value heads of 128,
// a 4-wide convolution) with every 4th layer (and the last) full attention with the output gate (16 heads of 256, 2
// KV heads, RoPE over a quarter), each layer's MoE of small experts plus a gated shared expert; near `bytes`, its
// layers splitting over pp, its heads over tp and its experts over ep.
struct Qwen3NextShape {
  std::int64_t hidden = 1024, heads = 16, kv_heads = 2, head_dim = 256;
  std::int64_t key_heads = 16, value_heads = 32, key_dim = 128, value_dim = 128, conv = 4;
  std::int64_t expert_ffn = 256, experts = 32, per_token = 8;
  std::int64_t layers = 0, vocab = 32000;
  bool full_attention(std::int64_t layer) const { return layer % 4 == 3 || layer == layers - 1; }
};
Result<Qwen3NextShape> qwen3_next_shape_for_layout(std::uint64_t bytes, int tp, int pp, int ep);
// Writes config.json and sharded safetensors (1 GB shards) of random bf16 weights, experts per expert as the hub's
// checkpoints store them.
Status write_qwen3_next_hf_model(const std::string& dir, const Qwen3NextShape& shape);

// A Nemotron-H-shaped hybrid: Mamba-2 layers at Nemotron-H's widths (64 heads of 64 = twice the hidden size, state
// 128, 8 groups, a 4-wide convolution) alternating with squared-ReLU MLP layers, every 7th layer attention (16 heads
// of 128, 8 KV heads), as Nemotron-H's M-M-M*- pattern; near `bytes`, its layers splitting over pp, its heads and
// groups over tp.
struct NemotronHShape {
  std::int64_t hidden = 2048, heads = 16, kv_heads = 8, head_dim = 128, ffn = 10752;
  std::int64_t mamba_heads = 64, mamba_head_dim = 64, state = 128, groups = 8, conv = 4;
  std::int64_t layers = 0, vocab = 32000;
  char kind(std::int64_t layer) const { return "M-M-M*-"[layer % 7]; }
  std::string pattern() const {
    std::string p;
    for (std::int64_t i = 0; i < layers; ++i) p += kind(i);
    return p;
  }
};
Result<NemotronHShape> nemotron_h_shape_for_layout(std::uint64_t bytes, int tp, int pp);
// Writes config.json (transformers 5's layers_block_type) and sharded safetensors of random bf16 weights.
Status write_nemotron_h_hf_model(const std::string& dir, const NemotronHShape& shape);

// A Gemma-4-shaped text model at the E4B's widths (hidden 2560, 8 heads of 256 with 2 KV heads, every 6th layer and
// the last full attention with heads of 512 whose keys are their values, an MLP of 10240, per-layer inputs of 256,
// the last third of the layers sharing earlier keys and values with a double-wide MLP), a 32000 vocabulary; near
// `bytes`, its layers splitting over pp and its KV heads over tp.
struct Gemma4Shape {
  std::int64_t hidden = 2560, heads = 8, kv_heads = 2, head_dim = 256, global_head_dim = 512, ffn = 10240;
  std::int64_t per_layer = 256, layers = 0, kv_shared = 0, vocab = 32000;
  bool full(std::int64_t layer) const { return (layer + 1) % 6 == 0 || layer == layers - 1; }
  bool shared(std::int64_t layer) const { return layer >= layers - kv_shared; }
};
Result<Gemma4Shape> gemma4_shape_for_layout(std::uint64_t bytes, int tp, int pp);
// Writes config.json and sharded safetensors of random bf16 weights (tied embeddings, as Gemma 4 has them).
Status write_gemma4_hf_model(const std::string& dir, const Gemma4Shape& shape);

// A Qwen3-VL-shaped model at the 4B's widths: the language model (hidden 2560, 32 heads of 128 with 8 KV heads and
// q/k norms, an MLP of 9728, a 32000 vocabulary, untied) and the vision tower (blocks of hidden 1024 with 16 heads and an
// MLP of 4096, patches of 16 x 16 x 2 over 3 channels merged 2 x 2 into the language model's width, two deepstack
// mergers); near `bytes`, two thirds of it language layers splitting over pp and its KV heads over tp, the rest
// vision blocks (at least 2).
struct Qwen3VlShape {
  std::int64_t hidden = 2560, heads = 32, kv_heads = 8, head_dim = 128, ffn = 9728, vocab = 32000, layers = 0;
  std::int64_t vision_hidden = 1024, vision_heads = 16, vision_ffn = 4096, patch = 16, temporal = 2, merge = 2;
  std::int64_t positions = 2304, depth = 0;
  std::vector<std::int64_t> deepstack() const { return {0, depth / 2}; }
};
Result<Qwen3VlShape> qwen3_vl_shape_for_layout(std::uint64_t bytes, int tp, int pp);
// Writes config.json (text_config, vision_config) and sharded safetensors of random bf16 weights.
Status write_qwen3_vl_hf_model(const std::string& dir, const Qwen3VlShape& shape);

// A Gemma-3-with-vision-shaped model at the 4B's widths: the language model (hidden 2560, 8 heads of 256 with 4 KV heads
// and q/k norms, Gemma's four norms per layer, an MLP of 10240, five windowed layers to each global one, a 32000
// vocabulary, tied) and the SigLIP vision tower (layers of hidden 1152 with 16 heads and an MLP of 4304, 896-pixel
// images of 14-pixel patches, no pooling head) with the multi-modal projector; near `bytes`, two thirds of it language
// layers splitting over pp and its KV heads over tp, the rest vision layers (at least 2).
struct Gemma3VlShape {
  std::int64_t hidden = 2560, heads = 8, kv_heads = 4, head_dim = 256, ffn = 10240, vocab = 32000, layers = 0;
  std::int64_t vision_hidden = 1152, vision_heads = 16, vision_ffn = 4304, image = 896, patch = 14, depth = 0;
};
Result<Gemma3VlShape> gemma3_vl_shape_for_layout(std::uint64_t bytes, int tp, int pp);
// Writes config.json (text_config, vision_config) and sharded safetensors of random bf16 weights, named as
// transformers saves Gemma3ForConditionalGeneration (language_model.model.*, vision_tower.*, multi_modal_projector.*).
Status write_gemma3_vl_hf_model(const std::string& dir, const Gemma3VlShape& shape);

// The `trestle` CLI beside this executable, whose commands the benchmarks run as children.
Result<std::string> trestle_exe();

}  // namespace trestle::cli
