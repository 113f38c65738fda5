#include "kernels/reference.h"

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/cpu/element_types.h"

namespace trestle::kernels {
namespace {

using cpu::Dtype;
using cpu::Glu;
using cpu::with_element_type;

template <typename T>
double get(const void* p, std::int64_t i) {
  return static_cast<double>(static_cast<float>(static_cast<const T*>(p)[i]));
}
template <typename T>
void put(void* p, std::int64_t i, double v) {
  static_cast<T*>(p)[i] = static_cast<T>(static_cast<float>(v));
}
// v as a tensor of T holds it.
template <typename T>
double rounded(double v) {
  return static_cast<double>(static_cast<float>(static_cast<T>(static_cast<float>(v))));
}

double inverse_rms(Dtype type, const void* x, std::int64_t r, std::int64_t cols, double eps) {
  double squares = 0;
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (std::int64_t c = 0; c < cols; ++c) squares += get<T>(x, r * cols + c) * get<T>(x, r * cols + c);
  });
  return 1 / std::sqrt(squares / static_cast<double>(cols) + eps);
}

void rms_norm_forward(Dtype type, const void* x, const void* residual, void* sum, const void* weight, void* y,
                      float* inv_rms, std::int64_t rows, std::int64_t cols, float eps, bool zero_centered) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (residual)  // the rows normed: x + residual rounded to T
      for (std::int64_t i = 0; i < rows * cols; ++i) put<T>(sum, i, get<T>(x, i) + get<T>(residual, i));
    const void* in = residual ? sum : x;
    for (std::int64_t r = 0; r < rows; ++r) {
      const double inv = inverse_rms(type, in, r, cols, eps);
      inv_rms[r] = static_cast<float>(inv);
      for (std::int64_t c = 0; c < cols; ++c) {
        const double normed = get<T>(in, r * cols + c) * inv, w = get<T>(weight, c);
        put<T>(y, r * cols + c, zero_centered ? normed * (1 + w) : rounded<T>(normed) * w);
      }
    }
  });
}

// With the forward's inv_rms, as the kernels take it; the rest in double.
void rms_norm_backward(Dtype type, const void* dy, const void* x, const void* weight, const float* inv_rms,
                       const void* residual_grad, void* dx, float* dweight, std::int64_t rows, std::int64_t cols,
                       bool zero_centered) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    std::vector<double> dw(static_cast<std::size_t>(cols), 0.0);
    for (std::int64_t r = 0; r < rows; ++r) {
      const double inv = inv_rms[r];
      double dot = 0;
      for (std::int64_t c = 0; c < cols; ++c) {
        const double w = get<T>(weight, c);
        dot += get<T>(dy, r * cols + c) * (zero_centered ? 1 + w : w) * get<T>(x, r * cols + c) * inv;
      }
      for (std::int64_t c = 0; c < cols; ++c) {
        const double w = get<T>(weight, c), d = get<T>(dy, r * cols + c), normed = get<T>(x, r * cols + c) * inv;
        const double residual = residual_grad ? get<T>(residual_grad, r * cols + c) : 0.0;
        put<T>(dx, r * cols + c,
               residual + inv * (d * (zero_centered ? 1 + w : w) - normed * dot / static_cast<double>(cols)));
        dw[static_cast<std::size_t>(c)] += d * (zero_centered ? normed : rounded<T>(normed));
      }
    }
    for (std::int64_t c = 0; c < cols; ++c) dweight[c] = static_cast<float>(dw[static_cast<std::size_t>(c)]);
  });
}

double gelu_tanh(double g) { return 0.5 * g * (1 + std::tanh(std::sqrt(2 / M_PI) * (g + 0.044715 * g * g * g))); }
double activation(Glu glu, double g) { return glu == Glu::kSwiGlu ? g / (1 + std::exp(-g)) : gelu_tanh(g); }
double slope(Glu glu, double g) {
  if (glu == Glu::kSwiGlu) {
    const double s = 1 / (1 + std::exp(-g));
    return s * (1 + g * (1 - s));
  }
  const double k = std::sqrt(2 / M_PI), t = std::tanh(k * (g + 0.044715 * g * g * g));
  return 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * k * (1 + 3 * 0.044715 * g * g);
}

void glu_forward(Dtype type, Glu glu, const void* in, void* out, std::int64_t rows, std::int64_t n) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t k = 0; k < n; ++k)
        put<T>(out, r * n + k, activation(glu, get<T>(in, r * 2 * n + k)) * get<T>(in, r * 2 * n + n + k));
  });
}

void glu_backward(Dtype type, Glu glu, const void* dy, const void* in, void* din, std::int64_t rows, std::int64_t n) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t k = 0; k < n; ++k) {
        const double g = get<T>(in, r * 2 * n + k), up = get<T>(in, r * 2 * n + n + k), d = get<T>(dy, r * n + k);
        put<T>(din, r * 2 * n + k, d * up * slope(glu, g));
        put<T>(din, r * 2 * n + n + k, d * activation(glu, g));
      }
  });
}

void softcap_forward(Dtype type, const void* x, void* y, std::int64_t numel, float cap) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (std::int64_t i = 0; i < numel; ++i) put<T>(y, i, cap * std::tanh(get<T>(x, i) / cap));
  });
}

void softcap_backward(Dtype type, const void* dy, const void* y, void* dx, std::int64_t numel, float cap) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (std::int64_t i = 0; i < numel; ++i) {
      const double t = get<T>(y, i) / cap;
      put<T>(dx, i, get<T>(dy, i) * (1 - t * t));
    }
  });
}

// One head of RoPE: x at `in_head`, y at `out_head` (element offsets), the row's tables at cos, sin; the rest copied.
template <typename T>
void rope_head_forward(const void* x, const float* cos, const float* sin, void* y, std::int64_t in_head,
                       std::int64_t out_head, std::int64_t head_dim, std::int64_t rot_dim, bool interleaved) {
  const std::int64_t h = rot_dim / 2;
  auto in = [&](std::int64_t d) { return get<T>(x, in_head + d); };
  for (std::int64_t i = 0; i < h; ++i) {
    if (interleaved) {
      const double c = cos[i], s = sin[i];
      put<T>(y, out_head + 2 * i, in(2 * i) * c - in(2 * i + 1) * s);
      put<T>(y, out_head + 2 * i + 1, in(2 * i + 1) * c + in(2 * i) * s);
    } else {
      put<T>(y, out_head + i, in(i)*cos[i] - in(i + h) * sin[i]);
      put<T>(y, out_head + i + h, in(i + h) * cos[i + h] + in(i)*sin[i + h]);
    }
  }
  for (std::int64_t d = rot_dim; d < head_dim; ++d) put<T>(y, out_head + d, in(d));
}

template <typename T>
void rope_head_backward(const void* dy, const float* cos, const float* sin, void* dx, std::int64_t in_head,
                        std::int64_t out_head, std::int64_t head_dim, std::int64_t rot_dim, bool interleaved) {
  const std::int64_t h = rot_dim / 2;
  auto grad = [&](std::int64_t d) { return get<T>(dy, in_head + d); };
  for (std::int64_t i = 0; i < h; ++i) {
    if (interleaved) {
      const double c = cos[i], s = sin[i];
      put<T>(dx, out_head + 2 * i, grad(2 * i) * c + grad(2 * i + 1) * s);
      put<T>(dx, out_head + 2 * i + 1, grad(2 * i + 1) * c - grad(2 * i) * s);
    } else {
      put<T>(dx, out_head + i, grad(i) * cos[i] + grad(i + h) * sin[i + h]);
      put<T>(dx, out_head + i + h, grad(i + h) * cos[i + h] - grad(i) * sin[i]);
    }
  }
  for (std::int64_t d = rot_dim; d < head_dim; ++d) put<T>(dx, out_head + d, grad(d));
}

void rope_forward(Dtype type, const void* x, RopeLayout x_layout, const float* cos, const float* sin, void* y,
                  RopeLayout y_layout, std::int64_t rows, std::int64_t heads, std::int64_t head_dim,
                  std::int64_t rot_dim, bool interleaved) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t k = 0; k < heads; ++k)
        rope_head_forward<T>(x, cos + r * rot_dim, sin + r * rot_dim, y, x_layout.head(r, k, head_dim),
                             y_layout.head(r, k, head_dim), head_dim, rot_dim, interleaved);
  });
}

void rope_backward(Dtype type, const void* dy, RopeLayout dy_layout, const float* cos, const float* sin, void* dx,
                   RopeLayout dx_layout, std::int64_t rows, std::int64_t heads, std::int64_t head_dim,
                   std::int64_t rot_dim, bool interleaved) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t k = 0; k < heads; ++k)
        rope_head_backward<T>(dy, cos + r * rot_dim, sin + r * rot_dim, dx, dy_layout.head(r, k, head_dim),
                              dx_layout.head(r, k, head_dim), head_dim, rot_dim, interleaved);
  });
}

// One element of a float type as fp32 (exact), and fp32 rounded to one (c10's conversions: nearest even).
template <typename T>
float load_as(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return static_cast<float>(v);
}
template <typename T>
void store_as(std::byte* p, float v) {
  const T rounded(v);
  std::memcpy(p, &rounded, sizeof rounded);
}
float load_float(cpu::PackType type, const std::byte* p) {
  if (type == cpu::PackType::kBFloat16) return load_as<c10::BFloat16>(p);
  if (type == cpu::PackType::kHalf) return load_as<c10::Half>(p);
  return load_as<float>(p);
}
void store_float(cpu::PackType type, std::byte* p, float v) {
  if (type == cpu::PackType::kBFloat16) store_as<c10::BFloat16>(p, v);
  else if (type == cpu::PackType::kHalf) store_as<c10::Half>(p, v);
  else store_as<float>(p, v);
}

// The cross-entropy's z of logit c of row r, in double.
template <typename T>
double logit_z(const void* logits, std::int64_t r, std::int64_t cols, std::int64_t c, double cap) {
  const double l = get<T>(logits, r * cols + c);
  return cap > 0 ? std::tanh(l / cap) * cap : l;
}

void cross_entropy_max(Dtype type, const void* logits, std::int64_t rows, std::int64_t cols, float cap, float* max) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (std::int64_t r = 0; r < rows; ++r) {
      double m = -INFINITY;
      for (std::int64_t c = 0; c < cols; ++c) m = std::fmax(m, logit_z<T>(logits, r, cols, c, cap));
      max[r] = static_cast<float>(m);
    }
  });
}

void cross_entropy_sums(Dtype type, const void* logits, const std::int64_t* target, const bool* outside,
                        const float* max, std::int64_t rows, std::int64_t cols, float cap, float* sums) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (std::int64_t r = 0; r < rows; ++r) {
      double sum = 0;
      for (std::int64_t c = 0; c < cols; ++c) sum += std::exp(logit_z<T>(logits, r, cols, c, cap) - max[r]);
      sums[r] = outside[r] ? 0.0f : static_cast<float>(logit_z<T>(logits, r, cols, target[r], cap) - max[r]);
      sums[rows + r] = static_cast<float>(sum);
    }
  });
}

void cross_entropy_backward(Dtype type, const void* logits, const std::int64_t* target, const bool* outside,
                            const float* lse, const float* grad_loss, std::int64_t rows, std::int64_t cols, float cap,
                            void* grad) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c) {
        const double l = get<T>(logits, r * cols + c), t = cap > 0 ? std::tanh(l / cap) : 0.0;
        double g = std::exp((cap > 0 ? t * cap : l) - lse[r]);
        if (!outside[r] && c == target[r]) g -= 1;
        g *= grad_loss[r];
        if (cap > 0) g *= 1 - t * t;
        put<T>(grad, r * cols + c, g);
      }
  });
}

// Element i of each source in turn, its place in memory worked out from i alone.
void cast_pack(const cpu::PackSource* sources, std::int64_t count, int /*threads*/) {
  for (std::int64_t k = 0; k < count; ++k) {
    const cpu::PackSource& s = sources[k];
    const int from = cpu::pack_type_bytes(s.from), to = cpu::pack_type_bytes(s.to);
    const std::int64_t n = cpu::pack_numel(s);
    for (std::int64_t i = 0; i < n; ++i) {
      std::int64_t offset = 0, rest = i;
      for (std::int32_t d = s.dims - 1; d >= 0; --d) {
        offset += (rest % s.sizes[d]) * s.strides[d];
        rest /= s.sizes[d];
      }
      const std::byte* in = static_cast<const std::byte*>(s.data) + offset * from;
      std::byte* out = static_cast<std::byte*>(s.destination) + i * to;
      if (s.from == s.to) std::memcpy(out, in, static_cast<std::size_t>(from));
      else store_float(s.to, out, load_float(s.from, in));
    }
  }
}

// Σ x² element after element, one double accumulator: the kernels' sum within rounding (the order differs).
double sum_of_squares(Dtype type, const void* x, std::int64_t numel) {
  double total = 0;
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (std::int64_t i = 0; i < numel; ++i) total += get<T>(x, i) * get<T>(x, i);
  });
  return total;
}

}  // namespace

const cpu::Table& reference_table() {
  static const cpu::Table table{"reference",        rms_norm_forward,       rms_norm_backward, glu_forward,
                                glu_backward,       softcap_forward,        softcap_backward,  cross_entropy_max,
                                cross_entropy_sums, cross_entropy_backward, rope_forward,      rope_backward,
                                cast_pack,          sum_of_squares};
  return table;
}

}  // namespace trestle::kernels
