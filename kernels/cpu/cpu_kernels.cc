// Compiled once per instruction set: CMake defines CPU_CAPABILITY (ATen's: DEFAULT, AVX2 or AVX512, which also names
// the namespace Vectorized lives in, so the builds do not collide), its CPU_CAPABILITY_* macro and TRESTLE_CPU_TABLE,
// the name of the table this build fills.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cpu/cross_entropy_logit.h"
#include "kernels/cpu/element_types.h"

namespace trestle::kernels::cpu {
namespace CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr std::int64_t kBlock = 1024;  // elements of a row one elementwise task computes

// A thread's fp32 scratch buffer `slot` of at least n floats.
float* scratch(int slot, std::int64_t n) {
  thread_local std::vector<float> buffers[6];
  auto& b = buffers[slot];
  if (b.size() < static_cast<std::size_t>(n)) b.resize(static_cast<std::size_t>(n));
  return b.data();
}

// bfloat16 / half -> fp32, a vector at a time (ATen's convert() of these is a scalar loop).
template <typename T>
void to_float(const T* src, float* dst, std::int64_t n) {
  using Reduced = at::vec::Vectorized<T>;
  std::int64_t i = 0;
  for (; i + static_cast<std::int64_t>(Reduced::size()) <= n; i += Reduced::size()) {
    auto [low, high] = at::vec::convert_to_float<T>(Reduced::loadu(src + i));
    low.store(dst + i);
    high.store(dst + i + Vec::size());
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// n elements of `src` as fp32: the pointer itself for float, else converted into scratch `slot`.
template <typename T>
const float* as_float(const T* src, std::int64_t n, int slot) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    float* out = scratch(slot, n);
    to_float(src, out, n);
    return out;
  }
}

// Where to compute n fp32 results for `dst`: dst itself for float, else scratch `slot` (then store()).
template <typename T>
float* out_float(T* dst, std::int64_t n, int slot) {
  if constexpr (std::is_same_v<T, float>) {
    return dst;
  } else {
    (void)dst;
    return scratch(slot, n);
  }
}
template <typename T>
void store(const float* computed, T* dst, std::int64_t n) {
  if constexpr (!std::is_same_v<T, float>) at::vec::convert(computed, dst, n);
}

// Rounds fp32 values to T and back in place (what a tensor of type T holds of them).
template <typename T>
void round_to(float* v, std::int64_t n, int slot) {
  if constexpr (!std::is_same_v<T, float>) {
    T* rounded = reinterpret_cast<T*>(scratch(slot, n));
    at::vec::convert(v, rounded, n);
    to_float(rounded, v, n);
  }
}

// Applies f(Vec ...) over [0, n) with the tail as a partial vector: f(i, count).
template <typename F>
void for_vectors(std::int64_t n, F f) {
  std::int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) f(i, static_cast<std::int64_t>(Vec::size()));
  if (i < n) f(i, n - i);
}

// Calls f(row, first, count) for each block of at most kBlock elements of each of `rows` rows of n, over the threads.
template <typename F>
void for_each_block(std::int64_t rows, std::int64_t n, F f) {
  const std::int64_t blocks = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, rows * blocks, 4, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t task = begin; task < end; ++task) {
      const std::int64_t r = task / blocks, first = (task % blocks) * kBlock;
      f(r, first, std::min(kBlock, n - first));
    }
  });
}

float sum_of_squares(const float* x, std::int64_t n) {
  Vec acc(0.0f);
  for_vectors(n, [&](std::int64_t i, std::int64_t count) {
    const Vec v = Vec::loadu(x + i, count);  // the tail's missing lanes load as zeros
    acc = at::vec::fmadd(v, v, acc);
  });
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
}

float dot(const float* a, const float* b, std::int64_t n) {
  Vec acc(0.0f);
  for_vectors(n, [&](std::int64_t i, std::int64_t count) {
    acc = at::vec::fmadd(Vec::loadu(a + i, count), Vec::loadu(b + i, count), acc);
  });
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
}

template <typename T>
void rms_norm_forward_typed(const T* x, const T* residual, T* sum, const T* weight, T* y, float* inv_rms,
                            std::int64_t rows, std::int64_t cols, float eps, bool zero_centered) {
  at::parallel_for(0, rows, std::max<std::int64_t>(1, 16384 / std::max<std::int64_t>(cols, 1)),
                   [&](std::int64_t begin, std::int64_t end) {
                     const float* w = as_float(weight, cols, 0);
                     for (std::int64_t r = begin; r < end; ++r) {
                       const float* xr = as_float(x + r * cols, cols, 1);
                       if (residual) {  // h = x + residual rounded to T, written to sum, is the row normed
                         const float* res = as_float(residual + r * cols, cols, 5);
                         float* h = out_float(sum + r * cols, cols, 4);
                         for_vectors(cols, [&](std::int64_t i, std::int64_t count) {
                           (Vec::loadu(xr + i, count) + Vec::loadu(res + i, count)).store(h + i, count);
                         });
                         round_to<T>(h, cols, 3);
                         store(h, sum + r * cols, cols);
                         xr = h;
                       }
                       const float inv =
                           1.0f / std::sqrt(sum_of_squares(xr, cols) / static_cast<float>(cols) + eps);
                       inv_rms[r] = inv;
                       float* out = out_float(y + r * cols, cols, 2);
                       const Vec scale(inv), one(1.0f);
                       for_vectors(cols, [&](std::int64_t i, std::int64_t count) {
                         const Vec normed = Vec::loadu(xr + i, count) * scale;
                         (zero_centered ? normed * (Vec::loadu(w + i, count) + one) : normed).store(out + i, count);
                       });
                       if (!zero_centered) {  // n rounded to T, then w · n (the composite's weight * normed.to(T))
                         round_to<T>(out, cols, 3);
                         for_vectors(cols, [&](std::int64_t i, std::int64_t count) {
                           (Vec::loadu(out + i, count) * Vec::loadu(w + i, count)).store(out + i, count);
                         });
                       }
                       store(out, y + r * cols, cols);
                     }
                   });
}

template <typename T>
void rms_norm_backward_typed(const T* dy, const T* x, const T* weight, const float* inv_rms, const T* residual_grad,
                             T* dx, float* dweight, std::int64_t rows, std::int64_t cols, bool zero_centered) {
  const int threads = at::get_num_threads();
  std::vector<float> partial(static_cast<std::size_t>(threads) * static_cast<std::size_t>(cols), 0.0f);
  at::parallel_for(0, rows, std::max<std::int64_t>(1, 8192 / std::max<std::int64_t>(cols, 1)),
                   [&](std::int64_t begin, std::int64_t end) {
                     float* dw = partial.data() + static_cast<std::size_t>(at::get_thread_num()) * cols;
                     const float* w = as_float(weight, cols, 0);
                     float* normed = scratch(3, cols);
                     float* g = scratch(4, cols);
                     const Vec one(1.0f);
                     for (std::int64_t r = begin; r < end; ++r) {
                       const float* xr = as_float(x + r * cols, cols, 1);
                       const float* dyr = as_float(dy + r * cols, cols, 2);
                       const Vec scale(inv_rms[r]);
                       // normed = x̂, g = dy · w (or dy · (1 + w)).
                       for_vectors(cols, [&](std::int64_t i, std::int64_t count) {
                         (Vec::loadu(xr + i, count) * scale).store(normed + i, count);
                         const Vec wv = Vec::loadu(w + i, count);
                         (Vec::loadu(dyr + i, count) * (zero_centered ? wv + one : wv)).store(g + i, count);
                       });
                       // dx = inv · (g - x̂ · mean(g · x̂)) (+ the residual's gradient; x's scratch is free).
                       const Vec mean(dot(g, normed, cols) / static_cast<float>(cols));
                       const float* res = residual_grad ? as_float(residual_grad + r * cols, cols, 1) : nullptr;
                       float* out = out_float(dx + r * cols, cols, 5);
                       for_vectors(cols, [&](std::int64_t i, std::int64_t count) {
                         const Vec xh = Vec::loadu(normed + i, count);
                         const Vec d = scale * (Vec::loadu(g + i, count) - xh * mean);
                         (res ? Vec::loadu(res + i, count) + d : d).store(out + i, count);
                       });
                       store(out, dx + r * cols, cols);
                       // dw += dy · n, n the plain form's x̂ rounded to T (x's scratch is free to round in).
                       if (!zero_centered) round_to<T>(normed, cols, 1);
                       for_vectors(cols, [&](std::int64_t i, std::int64_t count) {
                         at::vec::fmadd(Vec::loadu(dyr + i, count), Vec::loadu(normed + i, count),
                                        Vec::loadu(dw + i, count))
                             .store(dw + i, count);
                       });
                     }
                   });
  std::fill(dweight, dweight + cols, 0.0f);
  for (int t = 0; t < threads; ++t) {
    const float* p = partial.data() + static_cast<std::size_t>(t) * cols;
    for_vectors(cols, [&](std::int64_t i, std::int64_t count) {
      (Vec::loadu(dweight + i, count) + Vec::loadu(p + i, count)).store(dweight + i, count);
    });
  }
}

// tanh in fp32 within a few ulp, several times cheaper than Vectorized's (Sleef's 1-ulp tanh), which made the
// tanh-based kernels slower than ATen's composites (whose tanh is MKL's): below |x| = 0.4 the odd Taylor series to
// x^13 (the next term is under 1e-8 of tanh there), above it 1 - 2 / (e^{2|x|} + 1) with x's sign (e^{2|x|} may
// overflow to inf: the result is then exactly ±1). NaN stays NaN.
Vec fast_tanh(const Vec& x) {
  const Vec a = x.abs(), x2 = x * x, one(1.0f);
  Vec p(21844.0f / 6081075.0f);
  for (const float c : {-1382.0f / 155925.0f, 62.0f / 2835.0f, -17.0f / 315.0f, 2.0f / 15.0f, -1.0f / 3.0f})
    p = at::vec::fmadd(p, x2, Vec(c));
  const Vec small = at::vec::fmadd(x * x2, p, x);
  const Vec large = one - Vec(2.0f) / ((a + a).exp() + one);
  const Vec signed_large = Vec::blendv(large, large.neg(), x < Vec(0.0f));
  return Vec::blendv(signed_large, small, a < Vec(0.4f));
}

// tanh for results rounded to a 16-bit type: x P(x²) / Q(x²) of x clamped to ±9.02 (past which tanh rounds to 1 in
// fp32), P of degree 4 and Q of degree 3 fitted to tanh's relative error by scripts/fit_rough_tanh.py (Lawson's
// iteratively reweighted least squares in double, the coefficients rounded to fp32 one by one, the rest refitted):
// within 8.2e-7 of tanh evaluated in fp32 over [-12, 12], far below a bfloat16's or half's rounding (2e-3, 2.4e-4),
// odd (P and Q see only x²), NaN kept (the clamp passes it on). Half the work of fast_tanh: no exp, series or blends.
Vec rough_tanh(const Vec& x) {
  const Vec a = at::vec::clamp(x, Vec(-9.02f), Vec(9.02f)), s = a * a;
  Vec p(-5.028433669451715e-09f), q(0.00018519423610996455f);
  for (const float c : {6.502726137114223e-06f, 0.002604968147352338f, 0.1262112557888031f, 0.9999994039535522f})
    p = at::vec::fmadd(p, s, Vec(c));
  for (const float c : {0.022457024082541466f, 0.45954039692878723f, 1.0f}) q = at::vec::fmadd(q, s, Vec(c));
  return a * p / q;
}

// Results of type T are rounded to 16 bits.
template <typename T>
constexpr bool kRough = !std::is_same_v<T, float>;

// The activations and their derivatives, as transformers computes them (GELU: the tanh approximation).
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

// e^x: Sleef's 1-ulp exp, or for results rounded to a 16-bit type (`rough`) ATen's 20-ulp polynomial (2.4e-6
// relative, far below a bfloat16's or half's rounding; it clamps, so callers keep NaN through their own arithmetic).
Vec exp_of(const Vec& x, bool rough) { return rough ? x.exp_u20() : x.exp(); }

// The gate's sigmoid: SiLU's σ(g), and GELU's as σ(2u) with u = √(2/π)(g + 0.044715 g³), since
// 0.5 (1 + tanh(u)) = σ(2u): one exp where tanh would take an exp, a series and a blend (and no cancellation in
// 1 + tanh(u) for negative gates). `rough`: the result is rounded to a 16-bit type (exp by exp_of).
Vec gate_sigmoid(Glu glu, const Vec& g, bool rough) {
  const Vec one(1.0f);
  const Vec z = glu == Glu::kSwiGlu ? g : Vec(2.0f * kSqrt2OverPi) * at::vec::fmadd(Vec(kGeluCubic) * g, g * g, g);
  return one / (one + exp_of(z.neg(), rough));
}

Vec activation(Glu glu, const Vec& g, bool rough) { return g * gate_sigmoid(glu, g, rough); }

// act(g) = g σ(z) and act'(g) = σ + g σ (1 - σ) z'(g), z' = 1 (SiLU) or 2√(2/π)(1 + 3 · 0.044715 g²) (GELU).
void activation_and_slope(Glu glu, const Vec& g, Vec& act, Vec& slope, bool rough) {
  const Vec one(1.0f);
  const Vec sigma = gate_sigmoid(glu, g, rough);
  act = g * sigma;
  const Vec dz =
      glu == Glu::kSwiGlu ? one : Vec(2.0f * kSqrt2OverPi) * at::vec::fmadd(Vec(3.0f * kGeluCubic) * g, g, one);
  slope = at::vec::fmadd(act * (one - sigma), dz, sigma);
}

// 2 · Vec::size() elements of T as two fp32 vectors, converted in registers, and back.
template <typename T>
std::pair<Vec, Vec> load2(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return {Vec::loadu(p), Vec::loadu(p + Vec::size())};
  } else {
    auto [low, high] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
    return {low, high};
  }
}
template <typename T>
void store2(T* p, const Vec& low, const Vec& high) {
  if constexpr (std::is_same_v<T, float>) {
    low.store(p);
    high.store(p + Vec::size());
  } else {
    at::vec::convert_from_float<T>(low, high).store(p);
  }
}

// out[k][i] = f(in[...][i])[k] for i in [0, m): f maps In fp32 vectors to Out, the values converted in registers two
// vectors at a time; the tail (under two vectors) goes through fp32 arrays.
template <typename T, std::size_t In, std::size_t Out, typename F>
void map_elements(const std::array<const T*, In>& in, const std::array<T*, Out>& out, std::int64_t m, F f) {
  constexpr std::int64_t kStep = 2 * Vec::size();
  std::int64_t i = 0;
  for (; i + kStep <= m; i += kStep) {
    std::array<Vec, In> low, high;
    for (std::size_t k = 0; k < In; ++k) std::tie(low[k], high[k]) = load2(in[k] + i);
    std::array<Vec, Out> y_low, y_high;
    f(low, y_low);
    f(high, y_high);
    for (std::size_t k = 0; k < Out; ++k) store2(out[k] + i, y_low[k], y_high[k]);
  }
  const std::int64_t rest = m - i;
  if (rest == 0) return;
  float x[In][kStep], y[Out][kStep];
  for (std::size_t k = 0; k < In; ++k)
    for (std::int64_t j = 0; j < rest; ++j) x[k][j] = static_cast<float>(in[k][i + j]);
  for (std::int64_t j = 0; j < rest; j += Vec::size()) {
    const std::int64_t count = std::min<std::int64_t>(Vec::size(), rest - j);
    std::array<Vec, In> v;
    for (std::size_t k = 0; k < In; ++k) v[k] = Vec::loadu(x[k] + j, count);
    std::array<Vec, Out> r;
    f(v, r);
    for (std::size_t k = 0; k < Out; ++k) r[k].store(y[k] + j, count);
  }
  for (std::size_t k = 0; k < Out; ++k)
    for (std::int64_t j = 0; j < rest; ++j) out[k][i + j] = static_cast<T>(y[k][j]);
}

template <typename T>
void glu_forward_typed(Glu glu, const T* in, T* out, std::int64_t rows, std::int64_t n) {
  for_each_block(rows, n, [&](std::int64_t r, std::int64_t first, std::int64_t m) {
    const T* gate = in + r * 2 * n + first;
    map_elements<T, 2, 1>({gate, gate + n}, {out + r * n + first}, m,
                          [&](const std::array<Vec, 2>& x, std::array<Vec, 1>& y) {
                            y[0] = activation(glu, x[0], kRough<T>) * x[1];
                          });
  });
}

template <typename T>
void glu_backward_typed(Glu glu, const T* dy, const T* in, T* din, std::int64_t rows, std::int64_t n) {
  for_each_block(rows, n, [&](std::int64_t r, std::int64_t first, std::int64_t m) {
    const T* gate = in + r * 2 * n + first;
    T* dgate = din + r * 2 * n + first;
    map_elements<T, 3, 2>({gate, gate + n, dy + r * n + first}, {dgate, dgate + n}, m,
                          [&](const std::array<Vec, 3>& x, std::array<Vec, 2>& y) {
                            Vec act, slope;
                            activation_and_slope(glu, x[0], act, slope, kRough<T>);
                            y[0] = x[2] * x[1] * slope;  // d gate = dy · up · act'(gate)
                            y[1] = x[2] * act;           // d up = dy · act(gate)
                          });
  });
}

template <typename T>
void softcap_forward_typed(const T* x, T* y, std::int64_t numel, float cap) {
  const Vec c(cap), inverse(1.0f / cap);
  for_each_block(1, numel, [&](std::int64_t, std::int64_t first, std::int64_t m) {
    map_elements<T, 1, 1>({x + first}, {y + first}, m, [&](const std::array<Vec, 1>& v, std::array<Vec, 1>& r) {
      r[0] = (kRough<T> ? rough_tanh(v[0] * inverse) : fast_tanh(v[0] * inverse)) * c;
    });
  });
}

template <typename T>
void softcap_backward_typed(const T* dy, const T* y, T* dx, std::int64_t numel, float cap) {
  const Vec one(1.0f), inverse(1.0f / cap);
  for_each_block(1, numel, [&](std::int64_t, std::int64_t first, std::int64_t m) {
    map_elements<T, 2, 1>({dy + first, y + first}, {dx + first}, m,
                          [&](const std::array<Vec, 2>& v, std::array<Vec, 1>& r) {
                            const Vec t = v[1] * inverse;
                            r[0] = v[0] * (one - t * t);
                          });
  });
}

// The cross-entropy's passes, each row on one thread, a block of kBlock logits at a time as fp32.
template <typename T, typename F>
void for_logit_blocks(const T* row, std::int64_t cols, F f) {  // f(first, fp32 logits, m)
  for (std::int64_t first = 0; first < cols; first += kBlock) {
    const std::int64_t m = std::min(kBlock, cols - first);
    f(first, as_float(row + first, m, 0), m);
  }
}

// z of a vector of logits (cap · tanh(l / cap) when capped); tanh(l / cap) into `t`.
Vec logit_z(const Vec& l, float cap, Vec* t = nullptr) {
  if (cap <= 0) return l;
  const Vec tanh = fast_tanh(l * Vec(1.0f / cap));
  if (t) *t = tanh;
  return tanh * Vec(cap);
}

template <typename T>
void cross_entropy_max_typed(const T* logits, std::int64_t rows, std::int64_t cols, float cap, float* max) {
  const Vec lowest(-std::numeric_limits<float>::infinity());
  at::parallel_for(0, rows, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      Vec acc = lowest;
      for_logit_blocks(logits + r * cols, cols, [&](std::int64_t, const float* l, std::int64_t m) {
        for_vectors(m, [&](std::int64_t i, std::int64_t count) {
          acc = at::vec::maximum(acc, Vec::set(lowest, logit_z(Vec::loadu(l + i, count), cap), count));
        });
      });
      max[r] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, acc);
    }
  });
}

template <typename T>
void cross_entropy_sums_typed(const T* logits, const std::int64_t* target, const bool* outside, const float* max,
                              std::int64_t rows, std::int64_t cols, float cap, float* sums) {
  at::parallel_for(0, rows, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const Vec row_max(max[r]);
      Vec acc(0.0f);
      for_logit_blocks(logits + r * cols, cols, [&](std::int64_t, const float* l, std::int64_t m) {
        for_vectors(m, [&](std::int64_t i, std::int64_t count) {
          const Vec e = (logit_z(Vec::loadu(l + i, count), cap) - row_max).exp();
          acc = acc + Vec::set(Vec(0.0f), e, count);
        });
      });
      sums[rows + r] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
      sums[r] = outside[r] ? 0.0f : cross_entropy_logit(static_cast<float>(logits[r * cols + target[r]]), cap) - max[r];
    }
  });
}

template <typename T>
void cross_entropy_backward_typed(const T* logits, const std::int64_t* target, const bool* outside, const float* lse,
                                  const float* grad_loss, std::int64_t rows, std::int64_t cols, float cap, T* grad) {
  at::parallel_for(0, rows, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const Vec row_lse(lse[r]), scale(grad_loss[r]), one(1.0f);
      const std::int64_t target_column = outside[r] ? -1 : target[r];
      for_logit_blocks(logits + r * cols, cols, [&](std::int64_t first, const float* l, std::int64_t m) {
        float* g = out_float(grad + r * cols + first, m, 1);
        for_vectors(m, [&](std::int64_t i, std::int64_t count) {
          Vec t;
          Vec v = (logit_z(Vec::loadu(l + i, count), cap, &t) - row_lse).exp() * scale;
          if (cap > 0) v = v * (one - t * t);
          v.store(g + i, count);
        });
        if (target_column >= first && target_column < first + m)  // the target's own term, its - 1 included
          g[target_column - first] = cross_entropy_gradient(l[target_column - first], lse[r], true, grad_loss[r], cap);
        store(g, grad + r * cols + first, m);
      });
    }
  });
}

// RoPE's rotation of one head's first rot dims, fp32 in and out, by its row's tables; its transpose (the backward)
// when `transpose`. Plain: out[i] = a[i]·cos[i] - a[i+h]·p, out[i+h] = a[i+h]·cos[i+h] + a[i]·q with (p, q) the
// forward's (sin[i], sin[i+h]) or the transpose's (-sin[i+h], -sin[i]).
void rotate_plain(const float* in, const float* cos, const float* sin, float* out, std::int64_t rot, bool transpose) {
  const std::int64_t h = rot / 2;
  for_vectors(h, [&](std::int64_t i, std::int64_t count) {
    const Vec a = Vec::loadu(in + i, count), b = Vec::loadu(in + h + i, count);
    const Vec s_low = Vec::loadu(sin + i, count), s_high = Vec::loadu(sin + h + i, count);
    const Vec p = transpose ? s_high.neg() : s_low, q = transpose ? s_low.neg() : s_high;
    at::vec::fmsub(a, Vec::loadu(cos + i, count), b * p).store(out + i, count);
    at::vec::fmadd(a, q, b * Vec::loadu(cos + h + i, count)).store(out + h + i, count);
  });
}

// Interleaved: the pairs (in[2i], in[2i+1]) rotated by cos[i], sin[i] (sin negated for the transpose), split into
// evens and odds in registers.
void rotate_interleaved(const float* in, const float* cos, const float* sin, float* out, std::int64_t rot,
                        bool transpose) {
  constexpr std::int64_t kLanes = Vec::size();
  for_vectors(rot / 2, [&](std::int64_t i, std::int64_t count) {  // count pairs from pair i
    const std::int64_t low = std::min(2 * count, kLanes), high = 2 * count - low;
    const Vec first = Vec::loadu(in + 2 * i, low);
    const Vec second = high > 0 ? Vec::loadu(in + 2 * i + kLanes, high) : Vec(0.0f);
    const auto [even, odd] = at::vec::deinterleave2(first, second);
    const Vec c = Vec::loadu(cos + i, count), s_i = Vec::loadu(sin + i, count), s = transpose ? s_i.neg() : s_i;
    const auto [out_first, out_second] =
        at::vec::interleave2(at::vec::fmsub(even, c, odd * s), at::vec::fmadd(even, s, odd * c));
    out_first.store(out + 2 * i, low);
    if (high > 0) out_second.store(out + 2 * i + kLanes, high);
  });
}

// Each head of x [rows, heads, head_dim] (where the layouts put them): its first rot dims rotated (or transposed)
// through fp32, the rest copied.
template <typename T>
void rope_typed(const T* x, RopeLayout x_layout, const float* cos, const float* sin, T* y, RopeLayout y_layout,
                std::int64_t rows, std::int64_t heads, std::int64_t head_dim, std::int64_t rot, bool interleaved,
                bool transpose) {
  at::parallel_for(0, rows * heads, std::max<std::int64_t>(1, 16384 / std::max<std::int64_t>(head_dim, 1)),
                   [&](std::int64_t begin, std::int64_t end) {
                     for (std::int64_t task = begin; task < end; ++task) {
                       const std::int64_t r = task / heads, k = task - r * heads;
                       const T* in = x + x_layout.head(r, k, head_dim);
                       T* out = y + y_layout.head(r, k, head_dim);
                       const float* in32 = as_float(in, rot, 0);
                       float* out32 = out_float(out, rot, 1);
                       (interleaved ? rotate_interleaved : rotate_plain)(in32, cos + r * rot, sin + r * rot, out32, rot,
                                                                         transpose);
                       store(out32, out, rot);
                       std::copy(in + rot, in + head_dim, out + rot);
                     }
                   });
}

// One block's Σ x² in double (Table::sum_of_squares' order: 16 lanes, then pairwise).
template <typename T>
double block_squares(const T* x, std::int64_t n) {
  double lanes[kSquaresLanes] = {};
  std::int64_t i = 0;
  for (; i + kSquaresLanes <= n; i += kSquaresLanes) {
    for (int j = 0; j < kSquaresLanes; ++j) {  // vectorised by the compiler: the lanes are independent
      const double v = static_cast<float>(x[i + j]);
      lanes[j] += v * v;
    }
  }
  for (int j = 0; i + j < n; ++j) {
    const double v = static_cast<float>(x[i + j]);
    lanes[j] += v * v;
  }
  for (int width = kSquaresLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  return lanes[0];
}

double sum_of_squares_double(Dtype type, const void* x, std::int64_t numel) {
  const std::int64_t blocks = (numel + kSquaresBlock - 1) / kSquaresBlock;
  std::vector<double> sums(static_cast<std::size_t>(blocks));
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* data = static_cast<const T*>(x);
    at::parallel_for(0, blocks, 1, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t b = begin; b < end; ++b)
        sums[static_cast<std::size_t>(b)] =
            block_squares(data + b * kSquaresBlock, std::min(kSquaresBlock, numel - b * kSquaresBlock));
    });
  });
  double total = 0;
  for (const double s : sums) total += s;
  return total;
}

void rms_norm_forward(Dtype type, const void* x, const void* residual, void* sum, const void* weight, void* y,
                      float* inv_rms, std::int64_t rows, std::int64_t cols, float eps, bool zero_centered) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_forward_typed(static_cast<const T*>(x), static_cast<const T*>(residual), static_cast<T*>(sum),
                           static_cast<const T*>(weight), static_cast<T*>(y), inv_rms, rows, cols, eps, zero_centered);
  });
}

void rms_norm_backward(Dtype type, const void* dy, const void* x, const void* weight, const float* inv_rms,
                       const void* residual_grad, void* dx, float* dweight, std::int64_t rows, std::int64_t cols,
                       bool zero_centered) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_backward_typed(static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(weight), inv_rms,
                            static_cast<const T*>(residual_grad), static_cast<T*>(dx), dweight, rows, cols,
                            zero_centered);
  });
}

void glu_forward(Dtype type, Glu glu, const void* in, void* out, std::int64_t rows, std::int64_t n) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    glu_forward_typed(glu, static_cast<const T*>(in), static_cast<T*>(out), rows, n);
  });
}

void glu_backward(Dtype type, Glu glu, const void* dy, const void* in, void* din, std::int64_t rows, std::int64_t n) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    glu_backward_typed(glu, static_cast<const T*>(dy), static_cast<const T*>(in), static_cast<T*>(din), rows, n);
  });
}

void softcap_forward(Dtype type, const void* x, void* y, std::int64_t numel, float cap) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    softcap_forward_typed(static_cast<const T*>(x), static_cast<T*>(y), numel, cap);
  });
}

void softcap_backward(Dtype type, const void* dy, const void* y, void* dx, std::int64_t numel, float cap) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    softcap_backward_typed(static_cast<const T*>(dy), static_cast<const T*>(y), static_cast<T*>(dx), numel, cap);
  });
}

void cross_entropy_max(Dtype type, const void* logits, std::int64_t rows, std::int64_t cols, float cap, float* max) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cross_entropy_max_typed(static_cast<const T*>(logits), rows, cols, cap, max);
  });
}

void cross_entropy_sums(Dtype type, const void* logits, const std::int64_t* target, const bool* outside,
                        const float* max, std::int64_t rows, std::int64_t cols, float cap, float* sums) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cross_entropy_sums_typed(static_cast<const T*>(logits), target, outside, max, rows, cols, cap, sums);
  });
}

void cross_entropy_backward(Dtype type, const void* logits, const std::int64_t* target, const bool* outside,
                            const float* lse, const float* grad_loss, std::int64_t rows, std::int64_t cols, float cap,
                            void* grad) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cross_entropy_backward_typed(static_cast<const T*>(logits), target, outside, lse, grad_loss, rows, cols, cap,
                                 static_cast<T*>(grad));
  });
}

void rope_forward(Dtype type, const void* x, RopeLayout x_layout, const float* cos, const float* sin, void* y,
                  RopeLayout y_layout, std::int64_t rows, std::int64_t heads, std::int64_t head_dim,
                  std::int64_t rot_dim, bool interleaved) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rope_typed(static_cast<const T*>(x), x_layout, cos, sin, static_cast<T*>(y), y_layout, rows, heads, head_dim,
               rot_dim, interleaved, /*transpose=*/false);
  });
}

void rope_backward(Dtype type, const void* dy, RopeLayout dy_layout, const float* cos, const float* sin, void* dx,
                   RopeLayout dx_layout, std::int64_t rows, std::int64_t heads, std::int64_t head_dim,
                   std::int64_t rot_dim, bool interleaved) {
  with_element_type(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rope_typed(static_cast<const T*>(dy), dy_layout, cos, sin, static_cast<T*>(dx), dx_layout, rows, heads, head_dim,
               rot_dim, interleaved, /*transpose=*/true);
  });
}

}  // namespace

void cast_pack(const PackSource* sources, std::int64_t count, int threads);  // cast_pack.cc, the same build

}  // namespace CPU_CAPABILITY

const Table& TRESTLE_CPU_TABLE() {
  static const Table table{TRESTLE_CPU_TABLE_NAME,
                           CPU_CAPABILITY::rms_norm_forward,
                           CPU_CAPABILITY::rms_norm_backward,
                           CPU_CAPABILITY::glu_forward,
                           CPU_CAPABILITY::glu_backward,
                           CPU_CAPABILITY::softcap_forward,
                           CPU_CAPABILITY::softcap_backward,
                           CPU_CAPABILITY::cross_entropy_max,
                           CPU_CAPABILITY::cross_entropy_sums,
                           CPU_CAPABILITY::cross_entropy_backward,
                           CPU_CAPABILITY::rope_forward,
                           CPU_CAPABILITY::rope_backward,
                           CPU_CAPABILITY::cast_pack,
                           CPU_CAPABILITY::sum_of_squares_double};
  return table;
}

}  // namespace trestle::kernels::cpu
