// Every CPU build of the fused kernels this machine runs (portable, AVX2, AVX-512) against the plain reference:
// RMSNorm (plain and (1 + w)) forward and backward, SwiGLU and GeGLU, soft-capping, the cross-entropy's passes, RoPE
// (plain and interleaved, whole and partial), the gradient norm's Σ x² in double, in float, bfloat16 and half, at odd
// sizes (a single element, tails shorter than a vector, rows longer than a conversion block, no rows).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu_table.h"
#include "kernels/cuda/glu_pack.h"
#include "kernels/cuda/rms_norm_share.h"
#include "kernels/cuda/rope_slot.h"
#include "kernels/cuda/softcap_pack.h"
#include "kernels/kernel_dtype.h"
#include "kernels/reference.h"
#include "kernels/sum_of_squares.h"
#include "tests/kernels/cross_entropy_expected.h"

namespace trestle::kernels {
namespace {

std::vector<const cpu::Table*> runnable_tables() { return runnable_cpu_tables(); }

// The largest difference relative to the reference's largest magnitude: fp32 arithmetic against double, and for the
// 16-bit types a rounding either side.
double tolerance(at::ScalarType t) { return t == at::kFloat ? 2e-6 : t == at::kHalf ? 2e-3 : 1.6e-2; }

// `floor`: the magnitude of the terms a result is a difference of (RMSNorm's dx cancels to ~0 for a single column).
void expect_close(const at::Tensor& got, const at::Tensor& expected, at::ScalarType type, const std::string& what,
                  double floor = 0) {
  const at::Tensor a = got.to(at::kDouble), b = expected.to(at::kDouble);
  const double scale = std::max(b.abs().max().item<double>(), floor) + 1e-12;
  EXPECT_LE((a - b).abs().max().item<double>() / scale, tolerance(type)) << what;
}

const std::vector<at::ScalarType> kTypes = {at::kFloat, at::kBFloat16, at::kHalf};

// A tensor's data, or nullptr for an undefined one (no residual gradient).
const void* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }
template <typename T>
const T* rows_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

// Runs a table's RMSNorm forward and backward (delta: the residual step added to x before the norm, dr: the
// residual's gradient added into dx; undefined: none): y, inv_rms, dx, dweight, and the rows normed (x + delta, or x).
std::vector<at::Tensor> rms_norm(const cpu::Table& table, const at::Tensor& x, const at::Tensor& w,
                                 const at::Tensor& dy, bool zero_centered, const at::Tensor& delta,
                                 const at::Tensor& dr) {
  const std::int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor y = at::empty_like(x), inv = at::empty({rows}, at::kFloat), dx = at::empty_like(x);
  at::Tensor dw = at::empty({cols}, at::kFloat);
  const at::Tensor h = delta.defined() ? at::full_like(x, NAN) : x;
  const cpu::Dtype type = dtype_of(x.scalar_type());
  table.rms_norm_forward(type, x.data_ptr(), data_or_null(delta), delta.defined() ? h.data_ptr() : nullptr,
                         w.data_ptr(), y.data_ptr(), inv.data_ptr<float>(), rows, cols, 1e-5f, zero_centered);
  table.rms_norm_backward(type, dy.data_ptr(), h.data_ptr(), w.data_ptr(), inv.data_ptr<float>(), data_or_null(dr),
                          dx.data_ptr(), dw.data_ptr<float>(), rows, cols, zero_centered);
  return {y, inv, dx, dw, h};
}

// An RMSNorm case: inputs at random (w about 1, or about 0 for the (1 + w) form) and the reference's outputs.
struct RmsNormCase {
  at::Tensor x, w, dy;
  // The residual stream's step added to x before the norm and its gradient added into dx (undefined: none).
  at::Tensor delta, dr;
  std::vector<at::Tensor> expected;  // y, inv_rms, dx, dweight, the rows normed
  // dx = inv · (g - x̂ · mean(g · x̂)) with g = dy · w: its terms are of the size of max|dy · w| · inv, and its rounding
  // relative to them.
  double terms = 0;
};

RmsNormCase rms_norm_case(at::ScalarType type, std::int64_t rows, std::int64_t cols, bool zero_centered,
                          bool residual) {
  RmsNormCase c;
  c.x = (at::randn({rows, cols}) * 3).to(type);
  c.w = (at::randn({cols}) * 0.5 + (zero_centered ? 0.0 : 1.0)).to(type);
  c.dy = at::randn({rows, cols}).to(type);
  if (residual) {
    c.delta = at::randn({rows, cols}).to(type);
    c.dr = at::randn({rows, cols}).to(type);
  }
  c.expected = rms_norm(reference_table(), c.x, c.w, c.dy, zero_centered, c.delta, c.dr);
  c.terms =
      (c.dy.to(at::kDouble).abs().max() * (c.w.to(at::kDouble).abs().max() + 1) * c.expected[1].to(at::kDouble).max())
          .item<double>();
  return c;
}

// `got` (y, inv_rms, dx, dweight; filled with NaN first where an emulation writes them) has every element written and
// is close to the case's reference.
void expect_rms_norm_matches(const std::vector<at::Tensor>& got, const RmsNormCase& c, at::ScalarType type,
                             const std::string& what) {
  const std::vector<std::string> names = {"y", "inv_rms", "dx", "dweight", "x + delta"};
  for (std::size_t i = 0; i < got.size(); ++i) {
    ASSERT_FALSE(got[i].isnan().any().item<bool>()) << what << " " << names[i] << ": an element nothing wrote";
    expect_close(got[i], c.expected[i], i == 1 ? at::kFloat : type, what + " " + names[i], i == 2 ? c.terms : 0);
  }
}

// Σ x² in double: every build within rounding of the reference's sequential sum, and the same bits in every build and
// on one thread or two (the blocks' order is fixed); squares of fp32's largest values do not overflow.
TEST(KernelsTest, SumOfSquaresOfEveryCpuBuildMatchesTheReferenceWithTheSameBits) {
  at::manual_seed(5);
  const int threads = at::get_num_threads();
  for (const auto type : kTypes)
    for (const std::int64_t n :
         {std::int64_t{0}, std::int64_t{1}, std::int64_t{15}, std::int64_t{16}, std::int64_t{17},
          cpu::kSquaresBlock - 1, cpu::kSquaresBlock, cpu::kSquaresBlock + 1, 3 * cpu::kSquaresBlock + 123}) {
      const at::Tensor x = (at::randn({n}) * 3).to(type);
      const double expected = reference_table().sum_of_squares(dtype_of(type), x.const_data_ptr(), n);
      const std::string what = std::string(c10::toString(type)) + " n " + std::to_string(n);
      EXPECT_NEAR(expected, x.to(at::kDouble).square().sum().item<double>(),
                  2.3e-16 * static_cast<double>(n) * expected)
          << what;
      std::vector<double> got;
      for (const cpu::Table* table : runnable_tables())
        for (const int t : {1, 2}) {
          at::set_num_threads(t);
          got.push_back(table->sum_of_squares(dtype_of(type), x.const_data_ptr(), n));
          // Summed in other orders: each within n roundings of a double.
          EXPECT_NEAR(got.back(), expected, 2.3e-16 * static_cast<double>(n) * expected)
              << what << " " << table->name << ", " << t << " threads";
          EXPECT_EQ(got.back(), got.front()) << what << " " << table->name << ", " << t << " threads: other bits";
        }
      at::set_num_threads(threads);
    }
  const float big = std::numeric_limits<float>::max();
  const at::Tensor extremes = at::tensor({big, -big, 1e-30f, 0.0f});
  for (const cpu::Table* table : runnable_tables())
    EXPECT_EQ(table->sum_of_squares(cpu::Dtype::kFloat, extremes.const_data_ptr(), 4),
              2.0 * static_cast<double>(big) * big + 1e-60)
        << table->name;
}

// kernels::sum_of_squares on tensors: the CPU build for float, bfloat16 and half (contiguous or not), ATen's chunks
// widened to double for the rest; a 0-dim double tensor either way.
TEST(KernelsTest, SumOfSquaresOfAnyTensorIsAZeroDimDouble) {
  at::manual_seed(6);
  const at::Tensor x = at::randn({300, 700});
  const double expected = x.to(at::kDouble).square().sum().item<double>();
  for (const at::Tensor& t : {x, x.t(), x.to(at::kDouble), x.to(at::kDouble).t()}) {
    const at::Tensor got = sum_of_squares(t);
    EXPECT_EQ(got.dim(), 0);
    EXPECT_EQ(got.scalar_type(), at::kDouble);
    EXPECT_NEAR(got.item<double>(), expected, 1e-13 * expected) << t.scalar_type() << " " << t.strides();
  }
  const at::Tensor half = x.to(at::kHalf);
  EXPECT_NEAR(sum_of_squares(half).item<double>(), half.to(at::kDouble).square().sum().item<double>(),
              1e-13 * expected);
  EXPECT_EQ(sum_of_squares(at::empty({0})).item<double>(), 0.0);
}

TEST(KernelsTest, RmsNormOfEveryCpuBuildMatchesTheReference) {
  at::manual_seed(1);
  for (const cpu::Table* table : runnable_tables())
    for (const auto type : kTypes)
      for (const auto& [rows, cols] : std::vector<std::pair<std::int64_t, std::int64_t>>{
               {1, 1}, {3, 7}, {5, 33}, {17, 96}, {2, 4099}})
        for (const bool zero_centered : {false, true})
          for (const bool residual : {false, true}) {
            const std::string what = std::string(table->name) + " " + c10::toString(type) + " " + std::to_string(rows) +
                                     "x" + std::to_string(cols) + (zero_centered ? " (1 + w)" : "") +
                                     (residual ? " + residual" : "");
            const RmsNormCase c = rms_norm_case(type, rows, cols, zero_centered, residual);
            expect_rms_norm_matches(rms_norm(*table, c.x, c.w, c.dy, zero_centered, c.delta, c.dr), c, type, what);
          }
}

TEST(KernelsTest, GatedUnitsAndSoftcapOfEveryCpuBuildMatchTheReference) {
  at::manual_seed(2);
  for (const cpu::Table* table : runnable_tables())
    for (const auto type : kTypes)
      for (const auto& [rows, n] : std::vector<std::pair<std::int64_t, std::int64_t>>{{1, 1}, {3, 5}, {4, 1500}})
        for (const cpu::Glu glu : {cpu::Glu::kSwiGlu, cpu::Glu::kGeGlu}) {
          const std::string what = std::string(table->name) + " " + c10::toString(type) + " " +
                                   (glu == cpu::Glu::kSwiGlu ? "swiglu " : "geglu ") + std::to_string(rows) + "x" +
                                   std::to_string(n);
          const at::Tensor in = (at::randn({rows, 2 * n}) * 2).to(type);
          const at::Tensor dy = at::randn({rows, n}).to(type);
          auto run = [&](const cpu::Table& t) {
            at::Tensor out = at::empty({rows, n}, in.options()), din = at::empty_like(in);
            t.glu_forward(dtype_of(type), glu, in.data_ptr(), out.data_ptr(), rows, n);
            t.glu_backward(dtype_of(type), glu, dy.data_ptr(), in.data_ptr(), din.data_ptr(), rows, n);
            // Soft-capping at 3 over the same values (those beyond it bend); the backward reads the output.
            at::Tensor capped = at::empty_like(in), dcap = at::empty_like(in);
            const at::Tensor dcapped = at::ones_like(in);
            t.softcap_forward(dtype_of(type), in.data_ptr(), capped.data_ptr(), in.numel(), 3.0f);
            t.softcap_backward(dtype_of(type), dcapped.data_ptr(), capped.data_ptr(), dcap.data_ptr(), in.numel(),
                               3.0f);
            return std::vector<at::Tensor>{out, din, capped, dcap};
          };
          const auto got = run(*table), expected = run(reference_table());
          for (std::size_t i = 0; i < got.size(); ++i)
            expect_close(got[i], expected[i], type,
                         what + " " + std::vector<std::string>{"forward", "backward", "softcap", "softcap grad"}[i]);
        }
}

// The CUDA kernels' per-thread arithmetic (kernels/cuda/*.h) run here, with the element conversions the GPU's
// (rounding to nearest) and packs of V elements (16 bytes there, 1 where a row does not allow it).
template <typename T>
struct HostElement {
  static float load(T v) { return static_cast<float>(v); }
  static T store(float v) { return static_cast<T>(v); }
};

template <typename T>
constexpr int kPackOf = 16 / static_cast<int>(sizeof(T));

// run(std::integral_constant<int, V>) for V = 1 and, when `width` divides into them, 16-byte packs of T.
template <typename T, typename F>
void for_each_pack(std::int64_t width, F run) {
  run(std::integral_constant<int, 1>());
  if (width % kPackOf<T> == 0) run(std::integral_constant<int, kPackOf<T>>());
}

// `got` (filled with NaN before the emulated kernel ran) has every element written and is close to `expected`.
void expect_written_and_close(const at::Tensor& got, const at::Tensor& expected, at::ScalarType type,
                              const std::string& what, double floor = 0) {
  ASSERT_FALSE(got.isnan().any().item<bool>()) << what << ": an element nothing wrote";
  expect_close(got, expected, type, what, floor);
}

// RMSNorm as the kernels run it, `threads` threads a row (forward: a block a row; backward: `blocks` blocks over the
// rows, each summing its weight gradient, then the blocks' sums added), with the residual step and gradient where
// delta and dr are defined: y, inv_rms, dx, dweight, the rows normed.
template <typename T, int V>
std::vector<at::Tensor> rms_norm_by_shares(const at::Tensor& x, const at::Tensor& w, const at::Tensor& dy,
                                           const at::Tensor& delta, const at::Tensor& dr, bool zero_centered,
                                           int threads, int blocks) {
  const int rows = static_cast<int>(x.size(0)), cols = static_cast<int>(x.size(1)), packs = cols / V;
  at::Tensor y = at::full_like(x, NAN), inv = at::empty({rows}, at::kFloat), dx = at::full_like(x, NAN);
  const at::Tensor h = delta.defined() ? at::full_like(x, NAN) : x;  // the rows normed
  const T *wp = w.const_data_ptr<T>(), *dyp = dy.const_data_ptr<T>(), *deltap = rows_or_null<T>(delta);
  const T* drp = rows_or_null<T>(dr);
  T *yp = y.mutable_data_ptr<T>(), *dxp = dx.mutable_data_ptr<T>();
  T* sump = delta.defined() ? h.mutable_data_ptr<T>() : nullptr;
  for (int r = 0; r < rows; ++r) {
    std::vector<cuda::RmsNormForwardShare<T, HostElement<T>, V, 4>> shares(static_cast<std::size_t>(threads));
    float squares = 0;
    for (int t = 0; t < threads; ++t)
      squares += shares[t].squares(x.const_data_ptr<T>() + r * cols, deltap ? deltap + r * cols : nullptr,
                                   sump ? sump + r * cols : nullptr, packs, t, threads);
    const float inv_r = cuda::rms_inverse(squares, cols, 1e-5f);
    inv[r] = inv_r;
    for (int t = 0; t < threads; ++t)
      shares[t].normalize(h.const_data_ptr<T>() + r * cols, wp, yp + r * cols, packs, t, threads, inv_r, zero_centered);
  }
  const T* xp = h.const_data_ptr<T>();  // the backward's x
  const float* invp = inv.const_data_ptr<float>();
  std::vector<float> partial(static_cast<std::size_t>(blocks) * cols);
  for (int b = 0; b < blocks; ++b) {
    float* dw = partial.data() + static_cast<std::size_t>(b) * cols;
    std::vector<cuda::RmsNormBackwardShare<T, HostElement<T>, V, 2>> shares(static_cast<std::size_t>(threads));
    for (int t = 0; t < threads && b < rows; ++t)
      shares[t].read_ahead(xp + b * cols, dyp + b * cols, packs, t, threads);
    for (int r = b; r < rows; r += blocks) {
      for (int t = 0; t < threads; ++t) {
        shares[t].advance();
        if (r + blocks < rows)
          shares[t].read_ahead(xp + (r + blocks) * cols, dyp + (r + blocks) * cols, packs, t, threads);
      }
      float dot = 0;
      for (int t = 0; t < threads; ++t)
        dot += shares[t].dot(xp + r * cols, dyp + r * cols, wp, packs, t, threads, invp[r], zero_centered);
      for (int t = 0; t < threads; ++t)
        shares[t].gradients(xp + r * cols, dyp + r * cols, wp, drp ? drp + r * cols : nullptr, dxp + r * cols, dw,
                            packs, t, threads, invp[r], dot / static_cast<float>(cols), zero_centered);
    }
    for (int t = 0; t < threads; ++t) shares[t].add_weight_sums(dw, packs, t, threads);
  }
  at::Tensor dweight = at::zeros({cols}, at::kFloat);
  for (int b = 0; b < blocks; ++b)
    dweight += at::from_blob(partial.data() + static_cast<std::size_t>(b) * cols, {cols}, at::kFloat);
  return {y, inv, dx, dweight, h};
}

// The sum of each lane's value over a warp by the kernels' butterfly of shuffles (lane l adds lane l ^ offset's, for
// offsets 16, 8, 4, 2, 1): lane 0's result, which every lane gets.
float warp_sum(std::vector<float> lanes) {
  for (int offset = cuda::kWarpLanes / 2; offset > 0; offset /= 2) {
    std::vector<float> next(lanes.size());
    for (std::size_t l = 0; l < lanes.size(); ++l) next[l] = lanes[l] + lanes[l ^ static_cast<std::size_t>(offset)];
    lanes = next;
  }
  return lanes[0];
}

// RMSNorm as the warp-a-row kernels run it (rows whose packs fit a warp, rms_norm_lane_packs): the forward a warp per
// row; the backward's `blocks` blocks of kRowWarps warps taking rows warp, warp + all warps, ..., each lane summing its
// columns' weight gradient, the block's warps adding theirs in turn, then the blocks' sums added: y, inv_rms, dx,
// dweight.
template <typename T, int V, int L>
std::vector<at::Tensor> rms_norm_by_warps(const at::Tensor& x, const at::Tensor& w, const at::Tensor& dy,
                                          const at::Tensor& delta, const at::Tensor& dr, bool zero_centered,
                                          int blocks) {
  constexpr int lanes = cuda::kWarpLanes;
  const int rows = static_cast<int>(x.size(0)), cols = static_cast<int>(x.size(1)), packs = cols / V;
  at::Tensor y = at::full_like(x, NAN), inv = at::full({rows}, NAN, at::kFloat), dx = at::full_like(x, NAN);
  const at::Tensor h = delta.defined() ? at::full_like(x, NAN) : x;  // the rows normed
  const T *wp = w.const_data_ptr<T>(), *dyp = dy.const_data_ptr<T>(), *deltap = rows_or_null<T>(delta);
  const T* drp = rows_or_null<T>(dr);
  T *yp = y.mutable_data_ptr<T>(), *dxp = dx.mutable_data_ptr<T>();
  T* sump = delta.defined() ? h.mutable_data_ptr<T>() : nullptr;
  float* invp = inv.mutable_data_ptr<float>();
  for (int r = 0; r < rows; ++r) {
    std::vector<cuda::RmsNormForwardShare<T, HostElement<T>, V, L>> shares(lanes);
    std::vector<float> squares(lanes);
    for (int l = 0; l < lanes; ++l)
      squares[l] = shares[l].squares(x.const_data_ptr<T>() + r * cols, deltap ? deltap + r * cols : nullptr,
                                     sump ? sump + r * cols : nullptr, packs, l, lanes);
    invp[r] = cuda::rms_inverse(warp_sum(squares), cols, 1e-5f);
    for (int l = 0; l < lanes; ++l)
      shares[l].normalize(h.const_data_ptr<T>() + r * cols, wp, yp + r * cols, packs, l, lanes, invp[r], zero_centered);
  }
  const T* xp = h.const_data_ptr<T>();  // the backward's x
  at::Tensor dweight = at::zeros({cols}, at::kFloat);
  for (int b = 0; b < blocks; ++b) {
    std::vector<float> block_dw(static_cast<std::size_t>(cols), 0.0f);
    std::vector<std::vector<cuda::RmsNormBackwardShare<T, HostElement<T>, V, L>>> warps(
        cuda::kRowWarps, std::vector<cuda::RmsNormBackwardShare<T, HostElement<T>, V, L>>(lanes));
    for (int warp = 0; warp < cuda::kRowWarps; ++warp) {
      auto& shares = warps[warp];
      for (int r = b * cuda::kRowWarps + warp; r < rows; r += blocks * cuda::kRowWarps) {
        const T *xr = xp + r * cols, *dyr = dyp + r * cols;
        std::vector<float> dots(lanes);
        for (int l = 0; l < lanes; ++l) {
          shares[l].read_ahead(xr, dyr, packs, l, lanes);
          shares[l].advance();
          dots[l] = shares[l].dot(xr, dyr, wp, packs, l, lanes, invp[r], zero_centered);
        }
        const float mean = warp_sum(dots) / static_cast<float>(cols);
        for (int l = 0; l < lanes; ++l)
          shares[l].gradients(xr, dyr, wp, drp ? drp + r * cols : nullptr, dxp + r * cols, block_dw.data(), packs, l,
                              lanes, invp[r], mean, zero_centered);
      }
    }
    for (int warp = 0; warp < cuda::kRowWarps; ++warp)
      for (int l = 0; l < lanes; ++l) warps[warp][l].add_weight_sums(block_dw.data(), packs, l, lanes);
    dweight += at::from_blob(block_dw.data(), {cols}, at::kFloat);
  }
  return {y, inv, dx, dweight, h};
}

// The cross-entropy's passes of every CPU build and of the reference against ATen in double: logits of every dtype
// (read as fp32), soft-capped and not, rows of one logit, tails shorter than a vector, rows longer than a conversion
// block, targets held by another rank (outside), a row of zero loss gradient.
TEST(KernelsTest, CrossEntropyPassesOfEveryCpuBuildMatchAtenInDouble) {
  at::manual_seed(12);
  std::vector<const cpu::Table*> tables = runnable_tables();
  tables.push_back(&reference_table());
  for (const auto type : kTypes)
    for (const auto& [rows, cols] : std::vector<std::pair<std::int64_t, std::int64_t>>{{1, 1}, {5, 37}, {9, 3001}})
      for (const double cap : {0.0, 30.0}) {
        const at::Tensor logits = (at::randn({rows, cols}) * 8).to(type);
        const at::Tensor target = at::randint(0, cols, {rows}, at::kLong);
        const at::Tensor outside = at::rand({rows}) < 0.25;
        at::Tensor grad_loss = at::rand({rows});
        grad_loss[rows - 1] = 0.0;
        const CrossEntropyExpected expected(logits, target, outside, grad_loss, cap);
        const auto& [max, target_z, sum_exp, lse, g] = expected;
        const at::Tensor lse32 = lse.to(at::kFloat), grad_loss32 = grad_loss.to(at::kFloat);
        for (const cpu::Table* table : tables) {
          const std::string what = std::string(table->name) + " " + c10::toString(type) + " " + std::to_string(rows) +
                                   "x" + std::to_string(cols) + (cap > 0 ? " capped" : "");
          const cpu::Dtype t = dtype_of(type);
          at::Tensor got_max = at::empty({rows}, at::kFloat), sums = at::empty({2, rows}, at::kFloat);
          at::Tensor grad = at::full_like(logits, NAN);
          table->cross_entropy_max(t, logits.data_ptr(), rows, cols, static_cast<float>(cap),
                                   got_max.data_ptr<float>());
          table->cross_entropy_sums(t, logits.data_ptr(), target.const_data_ptr<std::int64_t>(),
                                    outside.const_data_ptr<bool>(), max.to(at::kFloat).const_data_ptr<float>(), rows,
                                    cols, static_cast<float>(cap), sums.data_ptr<float>());
          table->cross_entropy_backward(t, logits.data_ptr(), target.const_data_ptr<std::int64_t>(),
                                        outside.const_data_ptr<bool>(), lse32.const_data_ptr<float>(),
                                        grad_loss32.const_data_ptr<float>(), rows, cols, static_cast<float>(cap),
                                        grad.data_ptr());
          // fp32 arithmetic against double: relative 2e-6 of the magnitudes; the sums of exp (of up to 3001 terms,
          // each z within a few ulp of 30 when capped) relative 1e-5; the gradient rounded to its dtype, relative to
          // the loss gradient (the target's exp(z − lse) − 1 cancels).
          const double scale = max.abs().max().item<double>() + 1;
          EXPECT_LE((got_max.to(at::kDouble) - max).abs().max().item<double>(), 2e-6 * scale) << what << " max";
          EXPECT_LE((sums[0].to(at::kDouble) - target_z).abs().max().item<double>(), 2e-6 * scale) << what << " target";
          EXPECT_LE(((sums[1].to(at::kDouble) - sum_exp) / sum_exp).abs().max().item<double>(), 1e-5)
              << what << " sum of exp";
          expect_close(grad, g, type, what + " gradient", grad_loss.max().item<double>());
          EXPECT_EQ(grad[rows - 1].abs().max().item<double>(), 0.0) << what << " a row without loss gradient";
        }
      }
}

TEST(KernelsTest, RmsNormWarpsAsTheGpuRunsThemMatchTheReference) {
  at::manual_seed(11);
  int emulated = 0;
  for (const auto type : kTypes)
    // Every lane-pack count (1, 2, 4, 8) in packs and one element at a time; more rows than the warps of 2 blocks.
    for (const auto& [rows, cols] : std::vector<std::pair<std::int64_t, std::int64_t>>{
             {1, 1}, {3, 7}, {5, 64}, {9, 2048}, {40, 336}, {6, 1024}, {13, 200}})
      for (const bool zero_centered : {false, true}) {
        const bool residual = rows % 2 == 1;  // half the shapes with a residual gradient
        const RmsNormCase c = rms_norm_case(type, rows, cols, zero_centered, residual);
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, type, "rms_norm_by_warps", [&] {
          for_each_pack<scalar_t>(cols, [&](auto pack) {
            constexpr int V = decltype(pack)::value;
            const int lane_packs = cuda::rms_norm_lane_packs(static_cast<int>(cols / V));
            if (lane_packs == 0) return;  // a block a row
            cuda::with_lane_packs(lane_packs, [&](auto l) {
              constexpr int L = decltype(l)::value;
              ++emulated;
              const std::string what = std::string(c10::toString(type)) + " " + std::to_string(rows) + "x" +
                                       std::to_string(cols) + ", packs of " + std::to_string(V) + ", " +
                                       std::to_string(L) + " a lane" + (zero_centered ? ", (1 + w)" : "") +
                                       (residual ? ", + residual" : "");
              for (const int blocks : {1, 2})
                expect_rms_norm_matches(
                    rms_norm_by_warps<scalar_t, V, L>(c.x, c.w, c.dy, c.delta, c.dr, zero_centered, blocks), c, type,
                    what + ", " + std::to_string(blocks) + " blocks");
            });
          });
        });
      }
  EXPECT_GE(emulated, 30);  // the shapes above reach the warp kernels
}

TEST(KernelsTest, RmsNormSharesAsTheGpuRunsThemMatchTheReference) {
  at::manual_seed(8);
  for (const auto type : kTypes)
    for (const auto& [rows, cols] :
         std::vector<std::pair<std::int64_t, std::int64_t>>{{1, 1}, {3, 7}, {5, 64}, {9, 2048}, {4, 336}})
      for (const int threads : {3, 32, 128})  // 3: most packs past the cached ones
        for (const bool zero_centered : {false, true}) {
          const bool residual = threads != 32;  // the residual gradient in two of the three
          const RmsNormCase c = rms_norm_case(type, rows, cols, zero_centered, residual);
          AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, type, "rms_norm_by_shares", [&] {
            for_each_pack<scalar_t>(cols, [&](auto pack) {
              constexpr int V = decltype(pack)::value;
              const std::string what = std::string(c10::toString(type)) + " " + std::to_string(rows) + "x" +
                                       std::to_string(cols) + ", " + std::to_string(threads) + " threads, packs of " +
                                       std::to_string(V) + (zero_centered ? ", (1 + w)" : "") +
                                       (residual ? ", + residual" : "");
              expect_rms_norm_matches(
                  rms_norm_by_shares<scalar_t, V>(c.x, c.w, c.dy, c.delta, c.dr, zero_centered, threads, 2), c, type,
                  what);
            });
          });
        }
}

TEST(KernelsTest, GatedUnitPacksAsTheGpuRunsThemMatchTheReference) {
  at::manual_seed(9);
  for (const auto type : kTypes)
    for (const auto& [rows, n] : std::vector<std::pair<std::int64_t, std::int64_t>>{{1, 1}, {3, 5}, {4, 1504}})
      for (const cpu::Glu glu : {cpu::Glu::kSwiGlu, cpu::Glu::kGeGlu}) {
        const at::Tensor in = (at::randn({rows, 2 * n}) * 2).to(type);
        const at::Tensor dy = at::randn({rows, n}).to(type);
        at::Tensor out = at::empty({rows, n}, in.options()), din = at::empty_like(in);
        reference_table().glu_forward(dtype_of(type), glu, in.data_ptr(), out.data_ptr(), rows, n);
        reference_table().glu_backward(dtype_of(type), glu, dy.data_ptr(), in.data_ptr(), din.data_ptr(), rows, n);
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, type, "glu_packs", [&] {
          for_each_pack<scalar_t>(n, [&](auto pack) {
            constexpr int V = decltype(pack)::value;
            at::Tensor got = at::full_like(out, NAN), dgot = at::full_like(din, NAN);
            for (std::int64_t r = 0; r < rows; ++r) {
              const scalar_t* gate = in.const_data_ptr<scalar_t>() + r * 2 * n;
              scalar_t* d_gate = dgot.mutable_data_ptr<scalar_t>() + r * 2 * n;
              for (int p = 0; p < n / V; ++p) {
                cuda::glu_forward_pack<scalar_t, HostElement<scalar_t>, V>(
                    glu, gate, gate + n, got.mutable_data_ptr<scalar_t>() + r * n, p * V);
                cuda::glu_backward_pack<scalar_t, HostElement<scalar_t>, V>(glu, dy.const_data_ptr<scalar_t>() + r * n,
                                                                            gate, gate + n, d_gate, d_gate + n, p * V);
              }
            }
            const std::string what = std::string(c10::toString(type)) +
                                     (glu == cpu::Glu::kSwiGlu ? " swiglu " : " geglu ") + std::to_string(rows) + "x" +
                                     std::to_string(n) + ", packs of " + std::to_string(V);
            expect_written_and_close(got, out, type, what + " forward");
            expect_written_and_close(dgot, din, type, what + " backward");
          });
        });
      }
}

TEST(KernelsTest, SoftcapPacksAsTheGpuRunsThemMatchTheReference) {
  at::manual_seed(10);
  for (const auto type : kTypes)
    for (const std::int64_t numel : {std::int64_t{1}, std::int64_t{7}, std::int64_t{4096}}) {
      const at::Tensor x = (at::randn({numel}) * 6).to(type), dy = at::randn({numel}).to(type);
      at::Tensor y = at::empty_like(x), dx = at::empty_like(x);
      reference_table().softcap_forward(dtype_of(type), x.data_ptr(), y.data_ptr(), numel, 3.0f);
      reference_table().softcap_backward(dtype_of(type), dy.data_ptr(), y.data_ptr(), dx.data_ptr(), numel, 3.0f);
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, type, "softcap_packs", [&] {
        for_each_pack<scalar_t>(numel, [&](auto pack) {
          constexpr int V = decltype(pack)::value;
          at::Tensor got = at::full_like(x, NAN), dgot = at::full_like(x, NAN);
          for (std::int64_t k = 0; k < numel; k += V) {
            cuda::softcap_forward_pack<scalar_t, HostElement<scalar_t>, V>(x.const_data_ptr<scalar_t>(),
                                                                           got.mutable_data_ptr<scalar_t>(), 3.0f, k);
            cuda::softcap_backward_pack<scalar_t, HostElement<scalar_t>, V>(dy.const_data_ptr<scalar_t>(),
                                                                            y.const_data_ptr<scalar_t>(),
                                                                            dgot.mutable_data_ptr<scalar_t>(), 3.0f, k);
          }
          const std::string what =
              std::string(c10::toString(type)) + " " + std::to_string(numel) + ", packs of " + std::to_string(V);
          expect_written_and_close(got, y, type, what + " forward");
          expect_written_and_close(dgot, dx, type, what + " backward");
        });
      });
    }
}

// Tensor parallelism splits the gated units' columns over ranks, so each element's result must not depend on where
// it falls in a row (in a vector's body or the tail): every build's SwiGLU and GeGLU, forward and backward, give the
// same bits for a row of 1500 columns as for its two halves of 750 and 750, or 733 and 767, computed apart.
TEST(KernelsTest, GatedUnitsGiveTheSameBitsWhereverTheColumnsAreSplit) {
  at::manual_seed(5);
  const std::int64_t rows = 3, n = 1500;
  for (const cpu::Table* table : runnable_tables())
    for (const auto type : kTypes)
      for (const cpu::Glu glu : {cpu::Glu::kSwiGlu, cpu::Glu::kGeGlu}) {
        const at::Tensor in = (at::randn({rows, 2 * n}) * 3).to(type), dy = at::randn({rows, n}).to(type);
        auto run = [&](const at::Tensor& x, const at::Tensor& g) {
          const std::int64_t width = g.size(1);
          at::Tensor out = at::empty({rows, width}, x.options()), dx = at::empty_like(x);
          table->glu_forward(dtype_of(type), glu, x.data_ptr(), out.data_ptr(), rows, width);
          table->glu_backward(dtype_of(type), glu, g.data_ptr(), x.data_ptr(), dx.data_ptr(), rows, width);
          return std::pair{out, dx};
        };
        const auto [whole_out, whole_dx] = run(in, dy);
        const at::Tensor gate = in.narrow(1, 0, n), up = in.narrow(1, n, n);
        for (const std::int64_t first : {std::int64_t{750}, std::int64_t{733}})
          for (const auto& [begin, width] : {std::pair{std::int64_t{0}, first}, std::pair{first, n - first}}) {
            const at::Tensor part_in = at::cat({gate.narrow(1, begin, width), up.narrow(1, begin, width)}, 1);
            const auto [out, dx] = run(part_in.contiguous(), dy.narrow(1, begin, width).contiguous());
            const std::string what = std::string(table->name) + " " + c10::toString(type) +
                                     (glu == cpu::Glu::kSwiGlu ? " swiglu" : " geglu") + " columns " +
                                     std::to_string(begin) + "+" + std::to_string(width);
            EXPECT_TRUE(at::equal(out, whole_out.narrow(1, begin, width))) << what << " forward";
            EXPECT_TRUE(at::equal(dx.narrow(1, 0, width), whole_dx.narrow(1, begin, width))) << what << " d gate";
            EXPECT_TRUE(at::equal(dx.narrow(1, width, width), whole_dx.narrow(1, n + begin, width))) << what << " d up";
          }
      }
}

// The builds' tanh (soft-capping at 1 is tanh itself), element by element against double's: within 4 ulp of each
// value across [-12, 12] (densest around 0 and the series' end at 0.4, where two formulas meet), ±1 exactly far out
// and at ±inf, odd (tanh(-x) = -tanh(x) bit for bit), NaN kept.
TEST(CpuKernelsTest, TanhIsWithinAFewUlpEverywhere) {
  std::vector<float> x;
  for (int i = -12000; i <= 12000; ++i) x.push_back(static_cast<float>(i) * 1e-3f);
  for (int i = 1; i <= 2000; ++i) x.push_back(0.4f + static_cast<float>(i - 1000) * 1e-6f);
  for (const float v : {1e-30f, 1e-8f, 3e-4f, 9.0f, 10.0f, 20.0f, 44.0f, 89.0f, 1e30f, INFINITY})
    for (const float sign : {1.0f, -1.0f}) x.push_back(sign * v);
  x.push_back(NAN);
  const std::int64_t n = static_cast<std::int64_t>(x.size());
  for (const cpu::Table* table : runnable_tables()) {
    std::vector<float> y(x.size()), y_neg(x.size()), neg(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) neg[i] = -x[i];
    table->softcap_forward(cpu::Dtype::kFloat, x.data(), y.data(), n, 1.0f);
    table->softcap_forward(cpu::Dtype::kFloat, neg.data(), y_neg.data(), n, 1.0f);
    for (std::size_t i = 0; i + 1 < x.size(); ++i) {
      const double want = std::tanh(static_cast<double>(x[i]));
      const double ulp = std::nextafter(static_cast<float>(std::abs(want)), INFINITY) - std::abs(static_cast<float>(want));
      ASSERT_LE(std::abs(y[i] - want), 4 * ulp) << table->name << " tanh(" << x[i] << ") = " << y[i] << ", not " << want;
      ASSERT_EQ(y_neg[i], -y[i]) << table->name << " at " << x[i];
      if (std::abs(x[i]) >= 10.0f) {
        ASSERT_EQ(std::abs(y[i]), 1.0f) << table->name << " at " << x[i];
      }
    }
    EXPECT_TRUE(std::isnan(y.back())) << table->name;
  }
}

// The 16-bit types' soft-capping (its tanh a rational fit in fp32, rounded once): at every bfloat16 and half value in
// [-12, 12], soft-capping at 1 is tanh rounded to the type, within half an ulp of the type plus the fit's 1e-6.
TEST(CpuKernelsTest, SoftcapOf16BitTypesIsTanhRoundedOnce) {
  for (const at::ScalarType type : {at::kBFloat16, at::kHalf}) {
    const at::Tensor every = at::arange(0, 65536, at::kInt).to(at::kShort).view(type);  // every 16-bit pattern
    const at::Tensor wide = every.to(at::kDouble);
    const at::Tensor x = every.masked_select(wide.isfinite() & (wide.abs() <= 12)).contiguous();
    const at::Tensor exact = at::tanh(x.to(at::kDouble));
    const int mantissa_bits = type == at::kBFloat16 ? 7 : 10;
    // The type's spacing at |exact| (half's subnormals: 2^-24 apart).
    const at::Tensor ulp =
        at::pow(2.0, at::floor(at::log2(exact.abs().clamp_min(1e-300))).clamp_min(type == at::kHalf ? -14.0 : -126.0) -
                         mantissa_bits);
    const at::Tensor bound = 0.5 * ulp + 1e-6 * exact.abs();
    for (const cpu::Table* table : runnable_tables()) {
      at::Tensor y = at::empty_like(x);
      table->softcap_forward(dtype_of(type), x.data_ptr(), y.data_ptr(), x.numel(), 1.0f);
      const at::Tensor excess = (y.to(at::kDouble) - exact).abs() - bound;
      const auto worst = excess.argmax().item<std::int64_t>();
      EXPECT_LE(excess[worst].item<double>(), 0.0)
          << table->name << " " << c10::toString(type) << ": tanh(" << x[worst].item<double>()
          << ") = " << y[worst].item<double>() << ", not " << exact[worst].item<double>();
    }
  }
}

// The 16-bit types' SiLU (ATen's rough exp, which clamps its input) and soft-capping (the rational tanh of x clamped):
// NaN still gives NaN, gates far out on either side give (about) 0 and the gate itself, and logits far out or
// infinite are capped at ±cap exactly, for every build.
TEST(CpuKernelsTest, SixteenBitSiluAndSoftcapKeepExtremes) {
  for (const at::ScalarType type : {at::kBFloat16, at::kHalf}) {
    const at::Tensor gate = at::tensor({NAN, -1e4f, -100.0f, 100.0f, 1e4f, -INFINITY, INFINITY}).to(type);
    const at::Tensor in = at::cat({gate, at::ones_like(gate)}).view({1, -1});
    for (const cpu::Table* table : runnable_tables()) {
      at::Tensor out = at::empty({1, gate.numel()}, in.options());
      table->glu_forward(dtype_of(type), cpu::Glu::kSwiGlu, in.data_ptr(), out.data_ptr(), 1, gate.numel());
      const at::Tensor y = out.view(-1).to(at::kFloat);
      const std::string what = std::string(table->name) + " " + c10::toString(type);
      EXPECT_TRUE(std::isnan(y[0].item<float>())) << what;
      EXPECT_LE(std::abs(y[1].item<float>()), 1e-30f) << what;  // -1e4 / (1 + e^1e4): 0 or a denormal's worth
      EXPECT_LE(std::abs(y[2].item<float>()), 1e-30f) << what;
      EXPECT_EQ(y[3].item<float>(), gate[3].item<float>()) << what;
      EXPECT_EQ(y[4].item<float>(), gate[4].item<float>()) << what;
      at::Tensor capped = at::empty_like(gate);
      table->softcap_forward(dtype_of(type), gate.data_ptr(), capped.data_ptr(), gate.numel(), 2.0f);
      const at::Tensor c = capped.to(at::kFloat);
      EXPECT_TRUE(std::isnan(c[0].item<float>())) << what << " softcap";
      for (const int i : {1, 2, 5}) EXPECT_EQ(c[i].item<float>(), -2.0f) << what << " softcap at " << i;
      for (const int i : {3, 4, 6}) EXPECT_EQ(c[i].item<float>(), 2.0f) << what << " softcap at " << i;
    }
  }
}

// A table's RoPE forward and backward on x [rows, heads, head_dim], tables [rows, rot_dim]: y, dx.
std::vector<at::Tensor> rope(const cpu::Table& table, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                             const at::Tensor& dy, bool interleaved) {
  const std::int64_t rows = x.size(0), heads = x.size(1), head_dim = x.size(2), rot = cos.size(1);
  at::Tensor y = at::empty_like(x), dx = at::empty_like(x);
  const cpu::Dtype type = dtype_of(x.scalar_type());
  const RopeLayout layout = RopeLayout::contiguous(heads, head_dim);
  table.rope_forward(type, x.data_ptr(), layout, cos.data_ptr<float>(), sin.data_ptr<float>(), y.data_ptr(), layout,
                     rows, heads, head_dim, rot, interleaved);
  table.rope_backward(type, dy.data_ptr(), layout, cos.data_ptr<float>(), sin.data_ptr<float>(), dx.data_ptr(), layout,
                      rows, heads, head_dim, rot, interleaved);
  return {y, dx};
}

// Heads where a fused projection holds them (qkv [rows, groups, per_group + 2, head_dim]: a group's query heads, its
// key head, its value head): every table reads a part's heads there into contiguous ones and writes the backward's back
// there, as the reference does, touching nothing else of qkv.
TEST(KernelsTest, RopeReadsAndWritesHeadsWhereAFusedProjectionHoldsThem) {
  at::manual_seed(17);
  std::vector<const cpu::Table*> tables = runnable_tables();
  tables.push_back(&reference_table());
  for (const cpu::Table* table : tables)
    for (const auto type : kTypes)
      for (const std::int64_t head_dim : {64, 6, 8})
        for (const bool keys : {false, true})
          for (const bool interleaved : {false, true}) {
            const std::int64_t rows = 7, groups = 3, per_group = 2, slots = per_group + 2, rot = head_dim - 2;
            const std::int64_t heads = keys ? groups : groups * per_group;
            const RopeLayout in_qkv{groups * slots * head_dim, slots * head_dim, keys ? 1 : per_group};
            const RopeLayout flat = RopeLayout::contiguous(heads, head_dim);
            const std::size_t bytes = static_cast<std::size_t>(keys ? per_group * head_dim : 0) *
                                      static_cast<std::size_t>(c10::elementSize(type));
            const std::string what = std::string(table->name) + " " + c10::toString(type) +
                                     (keys ? " keys" : " queries") + " of qkv, head " + std::to_string(head_dim) +
                                     (interleaved ? " interleaved" : "");
            const at::Tensor qkv = at::randn({rows, groups, slots, head_dim}).to(type);
            const at::Tensor dy = at::randn({rows, heads, head_dim}).to(type);
            const at::Tensor angles = at::rand({rows, rot}) * 6.3;
            const at::Tensor cos = angles.cos(), sin = angles.sin();
            // The part's heads copied out contiguous, through the contiguous path: what the strided one must give.
            const at::Tensor part = keys ? qkv.narrow(2, per_group, 1) : qkv.narrow(2, 0, per_group);
            const auto expected =
                rope(reference_table(), part.reshape({rows, heads, head_dim}).contiguous(), cos, sin, dy, interleaved);
            at::Tensor y = at::full_like(dy, NAN), dqkv = at::full_like(qkv, NAN);
            table->rope_forward(dtype_of(type), static_cast<char*>(qkv.data_ptr()) + bytes, in_qkv,
                                cos.data_ptr<float>(), sin.data_ptr<float>(), y.data_ptr(), flat, rows, heads, head_dim,
                                rot, interleaved);
            table->rope_backward(dtype_of(type), dy.data_ptr(), flat, cos.data_ptr<float>(), sin.data_ptr<float>(),
                                 static_cast<char*>(dqkv.data_ptr()) + bytes, in_qkv, rows, heads, head_dim, rot,
                                 interleaved);
            expect_close(y, expected[0], type, what + " y");
            const at::Tensor written = keys ? dqkv.narrow(2, per_group, 1) : dqkv.narrow(2, 0, per_group);
            expect_close(written.reshape({rows, heads, head_dim}), expected[1], type, what + " dx");
            EXPECT_EQ(dqkv.isnan().logical_not().sum().item<std::int64_t>(), rows * heads * head_dim)
                << what << ": elements written outside the part";
          }
}

struct RopeShape {
  std::int64_t rows, heads, head_dim, rot_dim;
};

TEST(KernelsTest, RopeOfEveryCpuBuildMatchesTheReference) {
  at::manual_seed(5);
  // Partial (head_dim 6, rot_dim 4), whole, a single pair, halves shorter than a vector and longer than one, many
  // heads sharing a row's tables, no rows.
  const std::vector<RopeShape> shapes = {{3, 2, 6, 4},    {5, 3, 8, 8},   {1, 1, 2, 2}, {4, 2, 22, 22},
                                         {2, 3, 128, 96}, {7, 5, 64, 64}, {0, 2, 6, 4}};
  for (const cpu::Table* table : runnable_tables())
    for (const auto type : kTypes)
      for (const RopeShape& shape : shapes)
        for (const bool interleaved : {false, true}) {
          const auto [rows, heads, head_dim, rot] = shape;
          const std::string what = std::string(table->name) + " " + c10::toString(type) + " " + std::to_string(rows) +
                                   "x" + std::to_string(heads) + "x" + std::to_string(head_dim) + " rot " +
                                   std::to_string(rot) + (interleaved ? " interleaved" : " plain");
          const at::Tensor x = (at::randn({rows, heads, head_dim}) * 2).to(type);
          const at::Tensor dy = at::randn({rows, heads, head_dim}).to(type);
          // Tables with unequal halves, so a sine taken at the wrong index shows.
          const at::Tensor angles = at::rand({rows, rot}) * 6.3;
          const at::Tensor cos = angles.cos(), sin = angles.sin();
          const auto got = rope(*table, x, cos, sin, dy, interleaved);
          const auto expected = rope(reference_table(), x, cos, sin, dy, interleaved);
          if (rows == 0) continue;  // ran, touching nothing
          expect_close(got[0], expected[0], type, what + " y");
          expect_close(got[1], expected[1], type, what + " dx");
          // The pass-through dims are copies.
          EXPECT_TRUE(at::equal(got[0].narrow(2, rot, head_dim - rot), x.narrow(2, rot, head_dim - rot))) << what;
        }
}

// The CUDA kernel's work, run here: every (row, head, slot) of rope_slot.h, its element type's rounding on load and
// store, forward and transpose.
template <typename T>
at::Tensor rope_by_slots(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                         bool transpose) {
  const auto rows = x.size(0), heads = x.size(1), head_dim = x.size(2), rot = cos.size(1);
  at::Tensor y = at::full_like(x, NAN);  // an element no slot writes stays NaN
  const T* xp = x.const_data_ptr<T>();
  T* yp = y.mutable_data_ptr<T>();
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t head = 0; head < heads; ++head) {
      const T* xh = xp + (r * heads + head) * head_dim;
      T* yh = yp + (r * heads + head) * head_dim;
      for (int p = 0; p < cuda::rope_slots(static_cast<int>(head_dim)); ++p)
        cuda::rope_slot(
            p, static_cast<int>(head_dim), static_cast<int>(rot), interleaved, transpose,
            cos.const_data_ptr<float>() + r * rot, sin.const_data_ptr<float>() + r * rot,
            [xh](int d) { return static_cast<float>(xh[d]); }, [yh](int d, float v) { yh[d] = static_cast<T>(v); });
    }
  return y;
}

// The CUDA kernel's work by packs of V, run here: every (row, head, pack) of rope_pack, forward and transpose.
template <typename T, int V>
at::Tensor rope_by_packs(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                         bool transpose) {
  const auto rows = x.size(0), heads = x.size(1), head_dim = x.size(2), rot = cos.size(1);
  at::Tensor y = at::full_like(x, NAN);  // an element no pack writes stays NaN
  const T* xp = x.const_data_ptr<T>();
  T* yp = y.mutable_data_ptr<T>();
  const int packs = cuda::rope_packs(static_cast<int>(head_dim), static_cast<int>(rot), interleaved, V);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t head = 0; head < heads; ++head)
      for (int q = 0; q < packs; ++q)
        cuda::rope_pack<T, HostElement<T>, V>(q, static_cast<int>(rot), interleaved, transpose,
                                              cos.const_data_ptr<float>() + r * rot,
                                              sin.const_data_ptr<float>() + r * rot, xp + (r * heads + head) * head_dim,
                                              yp + (r * heads + head) * head_dim);
  return y;
}

TEST(KernelsTest, RopeSlotsAsTheGpuRunsThemMatchTheReference) {
  at::manual_seed(7);
  int packed = 0;
  // As the CPU builds' shapes, and odd head sizes (a last slot of one pass-through element).
  const std::vector<RopeShape> shapes = {{3, 2, 6, 4},    {5, 3, 8, 8},   {1, 1, 2, 2}, {4, 2, 22, 22},
                                         {2, 3, 128, 96}, {7, 5, 64, 64}, {3, 2, 7, 4}, {2, 3, 9, 8}};
  for (const auto type : kTypes)
    for (const RopeShape& shape : shapes)
      for (const bool interleaved : {false, true}) {
        const auto [rows, heads, head_dim, rot] = shape;
        const std::string what = std::string(c10::toString(type)) + " " + std::to_string(rows) + "x" +
                                 std::to_string(heads) + "x" + std::to_string(head_dim) + " rot " +
                                 std::to_string(rot) + (interleaved ? " interleaved" : " plain");
        const at::Tensor x = (at::randn({rows, heads, head_dim}) * 2).to(type);
        const at::Tensor dy = at::randn({rows, heads, head_dim}).to(type);
        const at::Tensor angles = at::rand({rows, rot}) * 6.3;  // unequal halves: a sine at the wrong index shows
        const at::Tensor cos = angles.cos(), sin = angles.sin();
        const auto expected = rope(reference_table(), x, cos, sin, dy, interleaved);
        at::Tensor y, dx;
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, type, "rope_by_slots", [&] {
          y = rope_by_slots<scalar_t>(x, cos, sin, interleaved, /*transpose=*/false);
          dx = rope_by_slots<scalar_t>(dy, cos, sin, interleaved, /*transpose=*/true);
        });
        ASSERT_FALSE(y.isnan().any().item<bool>()) << what << ": an element no slot wrote";
        ASSERT_FALSE(dx.isnan().any().item<bool>()) << what << ": an element no slot wrote";
        expect_close(y, expected[0], type, what + " y");
        expect_close(dx, expected[1], type, what + " dx");
        EXPECT_TRUE(at::equal(y.narrow(2, rot, head_dim - rot), x.narrow(2, rot, head_dim - rot))) << what;
        // By packs of the 16-byte loads (8 bf16 / half, 4 fp32) and of 2, where the head splits into them: the very
        // values slot by slot (the same arithmetic).
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, type, "rope_by_packs", [&] {
          auto by_packs = [&](auto pack) {
            constexpr int V = decltype(pack)::value;
            if (!cuda::rope_packs_fit(static_cast<int>(head_dim), static_cast<int>(rot), interleaved, V)) return;
            ++packed;
            const std::string in_packs = what + ", packs of " + std::to_string(V);
            const at::Tensor py = rope_by_packs<scalar_t, V>(x, cos, sin, interleaved, /*transpose=*/false);
            const at::Tensor pdx = rope_by_packs<scalar_t, V>(dy, cos, sin, interleaved, /*transpose=*/true);
            ASSERT_FALSE(py.isnan().any().item<bool>()) << in_packs << ": an element no pack wrote";
            ASSERT_FALSE(pdx.isnan().any().item<bool>()) << in_packs << ": an element no pack wrote";
            EXPECT_TRUE(at::equal(py, y)) << in_packs << " y";
            EXPECT_TRUE(at::equal(pdx, dx)) << in_packs << " dx";
          };
          by_packs(std::integral_constant<int, 2>());
          by_packs(std::integral_constant<int, kPackOf<scalar_t>>());
        });
      }
  EXPECT_GT(packed, 20) << "shapes that split into packs";
}

// The reference's backward is its forward's transpose: <rope(x), dy> = <x, rope_backward(dy)>.
TEST(KernelsTest, RopeReferenceBackwardIsTheForwardsTranspose) {
  at::manual_seed(6);
  for (const bool interleaved : {false, true}) {
    const at::Tensor x = at::randn({4, 3, 10}), dy = at::randn({4, 3, 10});
    const at::Tensor angles = at::rand({4, 8}) * 6.3;
    const auto out = rope(reference_table(), x, angles.cos(), angles.sin(), dy, interleaved);
    const double forward = (out[0].to(at::kDouble) * dy.to(at::kDouble)).sum().item<double>();
    const double backward = (x.to(at::kDouble) * out[1].to(at::kDouble)).sum().item<double>();
    EXPECT_NEAR(forward, backward, 1e-5 * std::abs(forward) + 1e-5) << (interleaved ? "interleaved" : "plain");
  }
}

}  // namespace
}  // namespace trestle::kernels
