// A Llama-shaped state dict for benchmarks: Hugging Face tensor names and realistic sizes for a target byte count,
// with random values generated once into one page-aligned allocation that the tensors view.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "ckpt/aligned_buffer.h"
#include "convert/formats/safetensors/safetensors_writer.h"

namespace trestle::cli {

struct LlamaShape {
  std::int64_t hidden = 0;
  std::int64_t intermediate = 0;
  std::int64_t layers = 0;
  std::int64_t heads = 0;
  std::int64_t kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t vocab = 0;
};

// The widest Llama (hidden 256 .. 8192, head_dim 64 or 128, SwiGLU, untied embeddings) whose layer count stays
// plausible for its width, with as many layers as bring it near target_bytes.
LlamaShape llama_shape_for_bytes(std::uint64_t target_bytes, DType dtype);
// Names and shapes in Hugging Face order: embed_tokens, then each layer, then norm and lm_head.
std::vector<TensorSpec> llama_tensor_specs(const LlamaShape& shape, DType dtype);

// Tensors laid out back to back (each 4 KiB-aligned) in one buffer filled with finite random values.
class StateDict {
 public:
  explicit StateDict(std::vector<TensorSpec> specs);

  const std::vector<TensorSpec>& specs() const { return specs_; }
  std::size_t size() const { return specs_.size(); }
  std::uint64_t total_bytes() const { return total_bytes_; }
  std::span<const std::byte> bytes(std::size_t i) const { return {arena_.data() + offsets_[i], specs_[i].nbytes()}; }

 private:
  std::vector<TensorSpec> specs_;
  std::vector<std::uint64_t> offsets_;
  std::uint64_t total_bytes_ = 0;
  AlignedBuffer arena_;
};

}  // namespace trestle::cli
