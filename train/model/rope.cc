#include "train/model/rope.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numbers>
#include <vector>

#include "train/model/fused_kernels.h"

namespace trestle::train {
namespace {

// Llama 3.1: wavelengths longer than original_context / low_freq_factor are divided by factor, shorter than
// original_context / high_freq_factor kept, and those between blended smoothly.
at::Tensor llama3_scaled(const at::Tensor& inv_freq, const RopeScaling& r) {
  const double context = static_cast<double>(r.original_max_position_embeddings);
  const double low_wavelen = context / r.low_freq_factor, high_wavelen = context / r.high_freq_factor;
  at::Tensor wavelen = 2 * std::numbers::pi / inv_freq;
  at::Tensor scaled = at::where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq);
  at::Tensor smooth = (context / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  at::Tensor blended = (1 - smooth) * scaled / r.factor + smooth * scaled;
  at::Tensor medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen);
  return at::where(medium, blended, scaled);
}

// YaRN (as transformers computes it): each frequency blended between its interpolated (divided by factor) and its
// original value along a linear ramp over the dimensions whose wavelengths fall between beta_fast and beta_slow
// rotations of the original context.
at::Tensor yarn_scaled(const at::Tensor& inv_freq, double base, std::int64_t dim, const RopeScaling& r) {
  const double context = static_cast<double>(r.original_max_position_embeddings);
  auto correction_dim = [&](double rotations) {
    return static_cast<double>(dim) * std::log(context / (rotations * 2 * std::numbers::pi)) / (2 * std::log(base));
  };
  double low = correction_dim(r.beta_fast), high = correction_dim(r.beta_slow);
  if (r.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // no singular ramp
  at::Tensor ramp = ((at::arange(dim / 2, at::kFloat) - low) / (high - low)).clamp(0, 1);
  at::Tensor extrapolation = 1 - ramp;
  return inv_freq / r.factor * (1 - extrapolation) + inv_freq * extrapolation;
}

double yarn_mscale(double factor, double mscale) { return factor <= 1 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0; }

}  // namespace

double rope_attention_factor(const GptModelSpec& spec) {
  const RopeScaling& r = spec.rope_scaling;
  if (r.type != RopeScalingType::kYarn) return 1.0;
  if (r.mscale > 0 && r.mscale_all_dim > 0)
    return yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim);
  return yarn_mscale(r.factor, 1.0);
}

double yarn_softmax_scale_correction(const GptModelSpec& spec) {
  const RopeScaling& r = spec.rope_scaling;
  if (r.type != RopeScalingType::kYarn || r.mscale_all_dim <= 0) return 1.0;
  const double m = yarn_mscale(r.factor, r.mscale_all_dim);
  return m * m;
}

Status check_rotary_dims(const GptModelSpec& spec) {
  if (spec.hybrid() || (spec.rotary_dim() >= 2 && spec.rotary_dim() % 2 == 0)) return OkStatus();
  char text[200];
  std::snprintf(text, sizeof text,
                "RoPE needs an even number of rotary dims per head, at least 2: head dim (kv_channels) %lld x "
                "rotary_percent %g gives %lld",
                static_cast<long long>(spec.kv_channels), spec.rotary_percent,
                static_cast<long long>(spec.rotary_dim()));
  return Status::Error(text);
}

at::Tensor rope_inverse_frequencies(const GptModelSpec& spec) {
  // Multi-latent attention rotates its decoupled RoPE dims only; partial rotary the first dims of each head.
  const std::int64_t d = spec.rotary_dim();
  at::Tensor exponents = at::arange(0, d, 2, at::kLong).to(at::kFloat) / static_cast<double>(d);
  at::Tensor inv_freq = 1.0 / at::pow(spec.rotary_base, exponents);
  switch (spec.rope_scaling.type) {
    case RopeScalingType::kNone:
      return inv_freq;
    case RopeScalingType::kLinear:
      return inv_freq / spec.rope_scaling.factor;
    case RopeScalingType::kLlama3:
      return llama3_scaled(inv_freq, spec.rope_scaling);
    case RopeScalingType::kYarn:
      return yarn_scaled(inv_freq, spec.rotary_base, d, spec.rope_scaling);
  }
  return inv_freq;
}

at::Tensor proportional_rope_inverse_frequencies(double base, std::int64_t head_dim, double fraction) {
  const auto rotated = static_cast<std::int64_t>(std::floor(fraction * static_cast<double>(head_dim) / 2));
  const at::Tensor exponents = at::arange(0, 2 * rotated, 2, at::kLong).to(at::kFloat) / static_cast<double>(head_dim);
  const at::Tensor inv_freq = 1.0 / at::pow(base, exponents);
  return at::cat({inv_freq, at::zeros({head_dim / 2 - rotated}, at::kFloat)});
}

at::Tensor deinterleave_pairs(const at::Tensor& x) {
  const std::int64_t d = x.size(-1);
  std::vector<std::int64_t> pairs(x.sizes().begin(), x.sizes().end() - 1);
  pairs.push_back(d / 2);
  pairs.push_back(2);
  return x.reshape(pairs).transpose(-1, -2).reshape(x.sizes());
}

RopeTables rope_tables(const at::Tensor& inverse_frequencies, const at::Tensor& positions, double attention_factor) {
  at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * inverse_frequencies;  // [b, s, d/2]
  at::Tensor angles = at::cat({freqs, freqs}, -1).transpose(0, 1).unsqueeze(2);     // [s, b, 1, d]
  if (attention_factor == 1.0) return {angles.cos().contiguous(), angles.sin().contiguous()};
  return {(angles.cos() * attention_factor).contiguous(), (angles.sin() * attention_factor).contiguous()};
}

at::Tensor apply_rope(const at::Tensor& x, const RopeTables& tables, bool fused) {
  const at::Tensor &cos = tables.cos, &sin = tables.sin;
  if (fused && x.dim() == 4 && cos.dim() == 4 && supports(x) && cos.device() == x.device() && !cos.requires_grad() &&
      !sin.requires_grad())
    return fused_rope(x, cos, sin);
  const std::int64_t rot = cos.size(-1), head_dim = x.size(-1);
  if (rot < head_dim) return at::cat({apply_rope(x.narrow(-1, 0, rot), tables), x.narrow(-1, rot, head_dim - rot)}, -1);
  const std::int64_t half = x.size(-1) / 2;
  at::Tensor rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * tables.cos.to(x.scalar_type()) + rotated * tables.sin.to(x.scalar_type());
}

}  // namespace trestle::train
