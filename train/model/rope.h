// Rotary position embedding: the inverse frequencies of a model (base, and the linear or Llama 3.1 scaling its spec
// carries), cos/sin tables for a batch's positions, and the rotation of query and key heads (the non-interleaved
// "rotate half" form Megatron-Core and Hugging Face share). Frequencies and tables are fp32.
#pragma once

#include <ATen/Tensor.h>

#include "parallel/layout/model_spec.h"

namespace trestle::train {

// [head_dim / 2] fp32: 1 / base^(2i / head_dim), then scaled.
at::Tensor rope_inverse_frequencies(const GptModelSpec& spec);

struct RopeTables {
  at::Tensor cos;  // [seq, batch, 1, head_dim]
  at::Tensor sin;
};
// positions [batch, seq] (integer) -> tables for those positions.
RopeTables rope_tables(const at::Tensor& inverse_frequencies, const at::Tensor& positions);

// x [seq, batch, heads, head_dim] -> x·cos + rotate_half(x)·sin, in x's dtype.
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& tables);

}  // namespace trestle::train
