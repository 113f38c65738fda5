#include "tools/bench/bench_state_dict.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace trestle::cli {
namespace {

constexpr std::int64_t kVocab = 32000;
constexpr std::int64_t kWidths[] = {8192, 5120, 4096, 2048, 1024, 512, 256};

LlamaShape llama_of_width(std::int64_t hidden) {
  LlamaShape s;
  s.hidden = hidden;
  s.head_dim = hidden >= 4096 ? 128 : 64;
  s.heads = hidden / s.head_dim;
  s.kv_heads = std::max<std::int64_t>(1, s.heads / 4);
  s.intermediate = (8 * hidden / 3 + 255) / 256 * 256;  // Llama's SwiGLU width, rounded up to a multiple of 256
  s.vocab = kVocab;
  s.layers = 1;
  return s;
}

std::uint64_t elements_per_layer(const LlamaShape& s) {
  const auto h = static_cast<std::uint64_t>(s.hidden);
  const auto kv = static_cast<std::uint64_t>(s.kv_heads * s.head_dim);
  return 2 * h * h + 2 * kv * h + 3 * static_cast<std::uint64_t>(s.intermediate) * h + 2 * h;
}

std::uint64_t elements_outside_layers(const LlamaShape& s) {
  return 2 * static_cast<std::uint64_t>(s.vocab * s.hidden) + static_cast<std::uint64_t>(s.hidden);
}

}  // namespace

LlamaShape llama_shape_for_bytes(std::uint64_t target_bytes, DType dtype) {
  const std::uint64_t target = target_bytes / dtype_size(dtype);
  for (const std::int64_t width : kWidths) {
    LlamaShape s = llama_of_width(width);
    const std::uint64_t fixed = elements_outside_layers(s), per_layer = elements_per_layer(s);
    if (target <= fixed) continue;
    const std::uint64_t layers = (target - fixed + per_layer / 2) / per_layer;
    // Real models have roughly one layer per 128-256 hidden units (TinyLlama 2048/22, Llama-2-7B 4096/32).
    if (layers < static_cast<std::uint64_t>(width / 256)) continue;
    s.layers = static_cast<std::int64_t>(layers);
    return s;
  }
  // Below a few tens of MB: the narrowest model with one layer, its vocabulary cut to fill the rest.
  LlamaShape s = llama_of_width(kWidths[std::size(kWidths) - 1]);
  const std::uint64_t rest = target > elements_per_layer(s) ? target - elements_per_layer(s) : 0;
  s.vocab = std::max<std::int64_t>(1, static_cast<std::int64_t>(rest / (2 * static_cast<std::uint64_t>(s.hidden))));
  return s;
}

std::vector<TensorSpec> llama_tensor_specs(const LlamaShape& s, DType dtype) {
  const std::int64_t h = s.hidden, kv = s.kv_heads * s.head_dim, ffn = s.intermediate;
  std::vector<TensorSpec> specs = {{"model.embed_tokens.weight", dtype, {s.vocab, h}}};
  for (std::int64_t i = 0; i < s.layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    specs.push_back({p + "input_layernorm.weight", dtype, {h}});
    specs.push_back({p + "self_attn.q_proj.weight", dtype, {h, h}});
    specs.push_back({p + "self_attn.k_proj.weight", dtype, {kv, h}});
    specs.push_back({p + "self_attn.v_proj.weight", dtype, {kv, h}});
    specs.push_back({p + "self_attn.o_proj.weight", dtype, {h, h}});
    specs.push_back({p + "post_attention_layernorm.weight", dtype, {h}});
    specs.push_back({p + "mlp.gate_proj.weight", dtype, {ffn, h}});
    specs.push_back({p + "mlp.up_proj.weight", dtype, {ffn, h}});
    specs.push_back({p + "mlp.down_proj.weight", dtype, {h, ffn}});
  }
  specs.push_back({"model.norm.weight", dtype, {h}});
  specs.push_back({"lm_head.weight", dtype, {s.vocab, h}});
  return specs;
}

namespace {

// xorshift64*: fast, and plenty random for bytes nobody reads for meaning.
void fill_random(std::byte* data, std::size_t bytes) {
  std::uint64_t state = 0x9E3779B97F4A7C15ull;
  // Each 16-bit lane keeps a random sign and mantissa under a fixed exponent: finite values near +-0.01 in bf16.
  constexpr std::uint64_t kKeep = 0x807F807F807F807Full, kExponent = 0x3C003C003C003C00ull;
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    const std::uint64_t word = ((state * 0x2545F4914F6CDD1Dull) & kKeep) | kExponent;
    std::memcpy(data + i, &word, 8);
  }
  if (i < bytes) std::memset(data + i, 0, bytes - i);
}

}  // namespace

StateDict::StateDict(std::vector<TensorSpec> specs) : specs_(std::move(specs)) {
  std::uint64_t cursor = 0;
  for (const auto& s : specs_) {
    offsets_.push_back(cursor);
    cursor = align_up(cursor + s.nbytes(), kIoAlignment);
    total_bytes_ += s.nbytes();
  }
  arena_ = AlignedBuffer(cursor);
  fill_random(arena_.data(), arena_.size());
}

}  // namespace trestle::cli
