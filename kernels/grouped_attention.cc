#include "kernels/grouped_attention.h"

#include <ATen/ATen.h>
#include <ATen/SDPBackend.h>

namespace trestle::kernels {
namespace {

// The arguments scaled_dot_product_attention gets: on a GPU k and v as they are, with enable_gqa when they have fewer
// heads than q and a fused kernel takes them so (cuDNN and Flash for 16-bit inputs); else k and v expanded, which the
// memory-efficient kernel takes where it does not take enable_gqa (fp32: with it, LibTorch fell back to the math
// kernel), and the only form on other devices.
struct SdpaInputs {
  at::Tensor k, v;
  bool enable_gqa = false;
};

SdpaInputs sdpa_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& allowed, double scale) {
  const std::int64_t heads = q.size(1);
  if (k.size(1) == heads) return {k, v, false};
  if (q.is_cuda() && at::_fused_sdp_choice(q, k, v, allowed, 0.0, /*is_causal=*/!allowed, scale, /*enable_gqa=*/true) !=
                         static_cast<std::int64_t>(at::SDPBackend::math))
    return {k, v, true};
  return {expand_groups(k, heads), expand_groups(v, heads), false};
}

}  // namespace

at::Tensor expand_groups(const at::Tensor& t, std::int64_t heads) {
  const std::int64_t batch = t.size(0), groups = t.size(1), seq = t.size(2), dim = t.size(3);
  if (groups == heads) return t;
  return t.unsqueeze(2).expand({batch, groups, heads / groups, seq, dim}).reshape({batch, heads, seq, dim});
}

at::Tensor grouped_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::optional<at::Tensor>& allowed, double scale) {
  const SdpaInputs in = sdpa_inputs(q, k, v, allowed, scale);
  return at::scaled_dot_product_attention(q, in.k, in.v, allowed, 0.0, /*is_causal=*/!allowed, scale, in.enable_gqa);
}

std::int64_t grouped_attention_backend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const std::optional<at::Tensor>& allowed, double scale) {
  const SdpaInputs in = sdpa_inputs(q, k, v, allowed, scale);
  return at::_fused_sdp_choice(q, in.k, in.v, allowed, 0.0, /*is_causal=*/!allowed, scale, in.enable_gqa);
}

}  // namespace trestle::kernels
