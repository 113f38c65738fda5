// The CUDA kernels against the plain reference on the same inputs (float, bfloat16, half; odd sizes, taken one
// element at a time, and sizes read 16 bytes at a time; rows longer than a block; RoPE plain and interleaved, whole and
// partial, odd head sizes), the cross-entropy passes against ATen, and cast-and-pack against ATen's cast into pinned
// host and device memory. Skipped, saying so, where this build has no CUDA kernels or the machine no GPU.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <string>
#include <utility>
#include <vector>

#include "kernels/cast_pack.h"
#include "kernels/kernel_dtype.h"
#include "kernels/reference.h"
#include "tests/kernels/cross_entropy_expected.h"

#if defined(TRESTLE_HAVE_CUDA)
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/rms_norm_share.h"
#endif

namespace trestle::kernels {
namespace {

#if defined(TRESTLE_HAVE_CUDA)
double tolerance(at::ScalarType t) { return t == at::kFloat ? 2e-6 : t == at::kHalf ? 2e-3 : 1.6e-2; }

// The largest difference relative to `scale`: by default the largest expected magnitude; for a result that is a
// difference of larger terms, the terms' magnitude (what rounding in the type is relative to).
void expect_close(const at::Tensor& got, const at::Tensor& expected, at::ScalarType type, const std::string& what,
                  double scale = 0) {
  const at::Tensor a = got.cpu().to(at::kDouble), b = expected.cpu().to(at::kDouble);
  if (scale <= 0) scale = b.abs().max().item<double>() + 1e-12;
  EXPECT_LE((a - b).abs().max().item<double>() / scale, tolerance(type)) << what;
}

void ok(const std::string& launch, const std::string& what) {
  EXPECT_EQ(launch, "") << what;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
}
#endif

TEST(KernelsCudaTest, EveryKernelMatchesTheReference) {
#if !defined(TRESTLE_HAVE_CUDA)
  GTEST_SKIP() << "this build has no CUDA kernels (no nvcc)";
#else
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU on this machine: the CUDA kernels are built, not run";
  at::manual_seed(4);
  const auto gpu = at::TensorOptions().device(at::kCUDA);
  for (const auto type : {at::kFloat, at::kBFloat16, at::kHalf})
    for (const auto& [rows, cols] :
         // 2500 x 512: more rows than the RMSNorm backward's blocks (and warps), so a block reads rows ahead, in packs,
         // and a warp takes several rows.
         std::vector<std::pair<std::int64_t, std::int64_t>>{
             {1, 1}, {5, 33}, {700, 4099}, {64, 2048}, {3, 16384}, {2500, 512}})
      for (const bool zero_centered : {false, true}) {
        const std::string what = std::string(c10::toString(type)) + " " + std::to_string(rows) + "x" +
                                 std::to_string(cols) + (zero_centered ? " (1 + w)" : "") +
                                 (zero_centered != (rows % 2 == 0) ? " + residual" : "");
        const cpu::Dtype t = dtype_of(type);
        const at::Tensor x = (at::randn({rows, cols}) * 3).to(type);
        const at::Tensor w = (at::randn({cols}) * 0.5 + (zero_centered ? 0.0 : 1.0)).to(type);
        const at::Tensor dy = at::randn({rows, cols}).to(type);
        // Each shape once with the residual stream's step (x + delta normed, the sum written) and gradient (added
        // into dx), and once without.
        const bool residual = zero_centered != (rows % 2 == 0);
        const at::Tensor delta = residual ? at::randn({rows, cols}).to(type) : at::Tensor();
        const at::Tensor dr = residual ? at::randn({rows, cols}).to(type) : at::Tensor();
        // Reference.
        at::Tensor y = at::empty_like(x), inv = at::empty({rows}, at::kFloat), dx = at::empty_like(x);
        at::Tensor dw = at::empty({cols}, at::kFloat);
        const at::Tensor h = residual ? at::empty_like(x) : x;  // the rows normed
        reference_table().rms_norm_forward(t, x.data_ptr(), residual ? delta.data_ptr() : nullptr,
                                           residual ? h.data_ptr() : nullptr, w.data_ptr(), y.data_ptr(),
                                           inv.data_ptr<float>(), rows, cols, 1e-5f, zero_centered);
        reference_table().rms_norm_backward(t, dy.data_ptr(), h.data_ptr(), w.data_ptr(), inv.data_ptr<float>(),
                                            residual ? dr.data_ptr() : nullptr, dx.data_ptr(), dw.data_ptr<float>(),
                                            rows, cols, zero_centered);
        // GPU: both RMSNorm kernels, a warp a row where a row fits one (16-byte packs where cols allows: torch's
        // allocations are aligned), and a block a row.
        const at::Tensor gx = x.to(gpu.dtype(type)), gw = w.to(gpu.dtype(type)), gdy = dy.to(gpu.dtype(type));
        const at::Tensor gdr = residual ? dr.to(gpu.dtype(type)) : at::Tensor();
        const at::Tensor gdelta = residual ? delta.to(gpu.dtype(type)) : at::Tensor();
        const std::int64_t pack = 16 / x.element_size();
        const bool fits_warp = cuda::rms_norm_lane_packs(static_cast<int>(cols % pack == 0 ? cols / pack : cols)) > 0;
        for (const auto rows_over : {cuda::RowsOver::kWarps, cuda::RowsOver::kBlocks}) {
          const std::string kernel =
              what + (rows_over == cuda::RowsOver::kWarps ? ", a warp a row" : ", a block a row");
          at::Tensor gy = at::empty_like(gx), ginv = at::empty({rows}, gpu.dtype(at::kFloat));
          at::Tensor gdx = at::empty_like(gx), gdw = at::empty({cols}, gpu.dtype(at::kFloat));
          at::Tensor partial = at::empty({cuda::partial_rows(rows), cols}, gpu.dtype(at::kFloat));
          const at::Tensor gh = residual ? at::full_like(gx, NAN) : gx;
          const std::string forward =
              cuda::rms_norm_forward(t, gx.data_ptr(), residual ? gdelta.data_ptr() : nullptr,
                                     residual ? gh.data_ptr() : nullptr, gw.data_ptr(), gy.data_ptr(),
                                     ginv.data_ptr<float>(), rows, cols, 1e-5f, zero_centered, nullptr, rows_over);
          const std::string backward =
              cuda::rms_norm_backward(t, gdy.data_ptr(), gh.data_ptr(), gw.data_ptr(), ginv.data_ptr<float>(),
                                      residual ? gdr.data_ptr() : nullptr, gdx.data_ptr(), gdw.data_ptr<float>(),
                                      partial.data_ptr<float>(), rows, cols, zero_centered, nullptr, rows_over);
          if (rows_over == cuda::RowsOver::kWarps && !fits_warp) {  // refused, saying so
            EXPECT_NE(forward.find("does not fit a warp"), std::string::npos) << kernel << ": " << forward;
            EXPECT_NE(backward.find("does not fit a warp"), std::string::npos) << kernel << ": " << backward;
            continue;
          }
          ok(forward, kernel);
          ok(backward, kernel);
          expect_close(gy, y, type, kernel + " y");
          expect_close(ginv, inv, at::kFloat, kernel + " inv_rms");
          if (residual) expect_close(gh, h, type, kernel + " x + delta");
          // dx = inv_rms · (w·dy - x̂ · mean(w·dy·x̂)): a difference of terms of size |w·dy|·inv_rms, which at width 1
          // (x̂² = x² / (x² + eps), within eps / x² of 1) nearly cancel: rounding is relative to the terms there.
          const double terms = ((dy.to(at::kDouble) * (w.to(at::kDouble) + (zero_centered ? 1.0 : 0.0))).abs().max() *
                                inv.to(at::kDouble).max())
                                   .item<double>();
          expect_close(gdx, dx, type, kernel + " dx", terms);
          expect_close(gdw, dw, type, kernel + " dweight");
        }
        for (const cpu::Glu glu : {cpu::Glu::kSwiGlu, cpu::Glu::kGeGlu}) {
          const at::Tensor in = (at::randn({rows, 2 * cols}) * 2).to(type), d = at::randn({rows, cols}).to(type);
          at::Tensor out = at::empty({rows, cols}, in.options()), din = at::empty_like(in);
          reference_table().glu_forward(t, glu, in.data_ptr(), out.data_ptr(), rows, cols);
          reference_table().glu_backward(t, glu, d.data_ptr(), in.data_ptr(), din.data_ptr(), rows, cols);
          const at::Tensor gin = in.to(gpu.dtype(type)), gd = d.to(gpu.dtype(type));
          at::Tensor gout = at::empty({rows, cols}, gin.options()), gdin = at::empty_like(gin);
          ok(cuda::glu_forward(t, glu, gin.data_ptr(), gout.data_ptr(), rows, cols, nullptr), what);
          ok(cuda::glu_backward(t, glu, gd.data_ptr(), gin.data_ptr(), gdin.data_ptr(), rows, cols, nullptr), what);
          expect_close(gout, out, type, what + " glu");
          expect_close(gdin, din, type, what + " glu backward");
        }
        at::Tensor capped = at::empty_like(x), dcap = at::empty_like(x);
        reference_table().softcap_forward(t, x.data_ptr(), capped.data_ptr(), x.numel(), 2.0f);
        reference_table().softcap_backward(t, dy.data_ptr(), capped.data_ptr(), dcap.data_ptr(), x.numel(), 2.0f);
        at::Tensor gcapped = at::empty_like(gx), gdcap = at::empty_like(gx);
        ok(cuda::softcap_forward(t, gx.data_ptr(), gcapped.data_ptr(), x.numel(), 2.0f, nullptr), what);
        // From the reference's output, so both backwards read the same values.
        const at::Tensor from = capped.to(gpu.dtype(type));
        ok(cuda::softcap_backward(t, gdy.data_ptr(), from.data_ptr(), gdcap.data_ptr(), x.numel(), 2.0f, nullptr),
           what);
        expect_close(gcapped, capped, type, what + " softcap");
        expect_close(gdcap, dcap, type, what + " softcap backward");
      }
#endif
}

// The cross-entropy passes against ATen's ops in double on the same logits (widened from their dtype): maxima, the
// target's shifted logit and Σ exp, and the gradient; targets outside the rank's vocabulary, soft-capping, a row of
// the model's vocabulary (32000: 16-byte packs) and odd widths (one element at a time).
TEST(KernelsCudaTest, CrossEntropyPassesMatchATen) {
#if !defined(TRESTLE_HAVE_CUDA)
  GTEST_SKIP() << "this build has no CUDA kernels (no nvcc)";
#else
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU on this machine: the CUDA kernels are built, not run";
  at::manual_seed(6);
  const auto gpu = at::TensorOptions().device(at::kCUDA);
  for (const auto type : {at::kFloat, at::kBFloat16, at::kHalf})
    for (const auto& [rows, cols] :
         std::vector<std::pair<std::int64_t, std::int64_t>>{{1, 1}, {5, 37}, {64, 32000}, {3, 50001}})
      for (const double cap : {0.0, 30.0}) {
        const std::string what = std::string(c10::toString(type)) + " " + std::to_string(rows) + "x" +
                                 std::to_string(cols) + (cap > 0 ? " capped" : "");
        const cpu::Dtype t = dtype_of(type);
        const at::Tensor logits = (at::randn({rows, cols}) * 8).to(type);
        const at::Tensor target = at::randint(0, cols, {rows}, at::kLong);
        const at::Tensor outside = at::rand({rows}) < 0.25;
        const at::Tensor grad_loss = at::rand({rows});
        const CrossEntropyExpected reference(logits, target, outside, grad_loss, cap);
        const auto& [max, target_logit, sum_exp, lse, g] = reference;

        const at::Tensor gl = logits.to(gpu.dtype(type)), gt = target.to(gpu.dtype(at::kLong));
        const at::Tensor go = outside.to(gpu.dtype(at::kBool));
        at::Tensor gmax = at::empty({rows}, gpu.dtype(at::kFloat)), gsums = at::empty({2, rows}, gpu.dtype(at::kFloat));
        ok(cuda::cross_entropy_max(t, gl.data_ptr(), rows, cols, static_cast<float>(cap), gmax.data_ptr<float>(),
                                   nullptr),
           what);
        ok(cuda::cross_entropy_sums(t, gl.data_ptr(), gt.data_ptr<std::int64_t>(), go.data_ptr<bool>(),
                                    gmax.data_ptr<float>(), rows, cols, static_cast<float>(cap),
                                    gsums.data_ptr<float>(), nullptr),
           what);
        // fp32 arithmetic (tanhf, expf, sums over up to 50001 terms) against double: relative 2e-5; the gradient
        // then rounded to its dtype.
        // Relative to `scale`, by default the largest expected magnitude.
        auto within = [&](const at::Tensor& got, const at::Tensor& expected, double relative, const std::string& name,
                          double scale = 0) {
          const at::Tensor a = got.cpu().to(at::kDouble), b = expected.to(at::kDouble);
          if (scale <= 0) scale = b.abs().max().item<double>();
          EXPECT_LE((a - b).abs().max().item<double>(), relative * scale) << what << " " << name;
        };
        const double scale = max.abs().max().item<double>() + 1;
        EXPECT_LE((gmax.cpu().to(at::kDouble) - max).abs().max().item<double>(), 2e-5 * scale) << what << " max";
        EXPECT_LE((gsums[0].cpu().to(at::kDouble) - target_logit).abs().max().item<double>(), 2e-5 * scale)
            << what << " target logit";
        within(gsums[1], sum_exp, 2e-5, "sum of exp");
        const at::Tensor glse = lse.to(gpu.dtype(at::kFloat)), ggrad_loss = grad_loss.to(gpu.dtype(at::kFloat));
        at::Tensor grad = at::empty_like(gl);
        ok(cuda::cross_entropy_backward(t, gl.data_ptr(), gt.data_ptr<std::int64_t>(), go.data_ptr<bool>(),
                                        glse.data_ptr<float>(), ggrad_loss.data_ptr<float>(), rows, cols,
                                        static_cast<float>(cap), grad.data_ptr(), nullptr),
           what);
        // The target's exp(z − lse) − 1 cancels (to 0 in a row of one logit): relative to the terms, grad_loss.
        within(grad, g, type == at::kFloat ? 2e-5 : tolerance(type), "gradient", grad_loss.max().item<double>());
      }
#endif
}

TEST(KernelsCudaTest, RopeMatchesTheReference) {
#if !defined(TRESTLE_HAVE_CUDA)
  GTEST_SKIP() << "this build has no CUDA kernels (no nvcc)";
#else
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU on this machine: the CUDA kernels are built, not run";
  at::manual_seed(7);
  const auto gpu = at::TensorOptions().device(at::kCUDA);
  // [rows, heads, head_dim, rot_dim]: partial, whole, a single pair, an odd head size, models' sizes (by 16-byte packs
  // where the head splits into them: rope_pack; else slot by slot).
  const std::vector<std::vector<std::int64_t>> shapes = {{3, 2, 6, 4},       {5, 3, 8, 8},      {1, 1, 2, 2},
                                                         {3, 2, 7, 4},       {4, 3, 16, 16},    {2048, 8, 128, 64},
                                                         {1024, 32, 64, 64}, {70000, 1, 64, 64}};
  for (const auto type : {at::kFloat, at::kBFloat16, at::kHalf})
    for (const auto& shape : shapes)
      for (const bool interleaved : {false, true}) {
        const std::int64_t rows = shape[0], heads = shape[1], head_dim = shape[2], rot = shape[3];
        const std::string what = std::string(c10::toString(type)) + " " + std::to_string(rows) + "x" +
                                 std::to_string(heads) + "x" + std::to_string(head_dim) + " rot " +
                                 std::to_string(rot) + (interleaved ? " interleaved" : " plain");
        const cpu::Dtype t = dtype_of(type);
        const at::Tensor x = (at::randn({rows, heads, head_dim}) * 2).to(type);
        const at::Tensor dy = at::randn({rows, heads, head_dim}).to(type);
        const at::Tensor angles = at::rand({rows, rot}) * 6.3;
        const at::Tensor cos = angles.cos(), sin = angles.sin();
        at::Tensor y = at::empty_like(x), dx = at::empty_like(x);
        const RopeLayout layout = RopeLayout::contiguous(heads, head_dim);
        reference_table().rope_forward(t, x.data_ptr(), layout, cos.data_ptr<float>(), sin.data_ptr<float>(),
                                       y.data_ptr(), layout, rows, heads, head_dim, rot, interleaved);
        reference_table().rope_backward(t, dy.data_ptr(), layout, cos.data_ptr<float>(), sin.data_ptr<float>(),
                                        dx.data_ptr(), layout, rows, heads, head_dim, rot, interleaved);
        const at::Tensor gx = x.to(gpu.dtype(type)), gdy = dy.to(gpu.dtype(type));
        const at::Tensor gcos = cos.to(gpu.dtype(at::kFloat)), gsin = sin.to(gpu.dtype(at::kFloat));
        at::Tensor gy = at::empty_like(gx), gdx = at::empty_like(gx);
        ok(cuda::rope_forward(t, gx.data_ptr(), layout, gcos.data_ptr<float>(), gsin.data_ptr<float>(), gy.data_ptr(),
                              layout, rows, heads, head_dim, rot, interleaved, nullptr),
           what);
        ok(cuda::rope_backward(t, gdy.data_ptr(), layout, gcos.data_ptr<float>(), gsin.data_ptr<float>(),
                               gdx.data_ptr(), layout, rows, heads, head_dim, rot, interleaved, nullptr),
           what);
        expect_close(gy, y, type, what + " y");
        expect_close(gdx, dx, type, what + " dx");
      }
  // Heads where a fused projection holds them: a group's query heads and its key head of qkv [rows, groups, per_group
  // + 2, head_dim], read into contiguous heads and (the backward) written back there, the rest of qkv untouched.
  for (const auto type : {at::kFloat, at::kBFloat16, at::kHalf})
    for (const std::int64_t head_dim : {64, 6})
      for (const bool keys : {false, true}) {
        const std::int64_t rows = 300, groups = 4, per_group = 3, slots = per_group + 2, rot = head_dim;
        const std::int64_t heads = keys ? groups : groups * per_group;
        const RopeLayout in_qkv{groups * slots * head_dim, slots * head_dim, keys ? 1 : per_group};
        const std::int64_t first = keys ? per_group * head_dim : 0;
        const std::string what = std::string(c10::toString(type)) + (keys ? " keys" : " queries") + " of qkv, head " +
                                 std::to_string(head_dim);
        const cpu::Dtype t = dtype_of(type);
        const at::Tensor qkv = at::randn({rows, groups, slots, head_dim}).to(type);
        const at::Tensor dy = at::randn({rows, heads, head_dim}).to(type);
        const at::Tensor angles = at::rand({rows, rot}) * 6.3;
        const at::Tensor cos = angles.cos(), sin = angles.sin();
        const RopeLayout flat = RopeLayout::contiguous(heads, head_dim);
        const std::size_t bytes = static_cast<std::size_t>(first) * qkv.element_size();
        at::Tensor y = at::empty_like(dy), dqkv = at::full_like(qkv, NAN);
        reference_table().rope_forward(t, static_cast<char*>(qkv.data_ptr()) + bytes, in_qkv, cos.data_ptr<float>(),
                                       sin.data_ptr<float>(), y.data_ptr(), flat, rows, heads, head_dim, rot, false);
        reference_table().rope_backward(t, dy.data_ptr(), flat, cos.data_ptr<float>(), sin.data_ptr<float>(),
                                        static_cast<char*>(dqkv.data_ptr()) + bytes, in_qkv, rows, heads, head_dim, rot,
                                        false);
        const at::Tensor gqkv = qkv.to(gpu.dtype(type)), gdy = dy.to(gpu.dtype(type));
        const at::Tensor gcos = cos.to(gpu.dtype(at::kFloat)), gsin = sin.to(gpu.dtype(at::kFloat));
        at::Tensor gy = at::empty_like(gdy), gdqkv = at::full_like(gqkv, NAN);
        ok(cuda::rope_forward(t, static_cast<char*>(gqkv.data_ptr()) + bytes, in_qkv, gcos.data_ptr<float>(),
                              gsin.data_ptr<float>(), gy.data_ptr(), flat, rows, heads, head_dim, rot, false, nullptr),
           what);
        ok(cuda::rope_backward(t, gdy.data_ptr(), flat, gcos.data_ptr<float>(), gsin.data_ptr<float>(),
                               static_cast<char*>(gdqkv.data_ptr()) + bytes, in_qkv, rows, heads, head_dim, rot, false,
                               nullptr),
           what);
        expect_close(gy, y, type, what + " y");
        const at::Tensor written = dqkv.isnan().logical_not();
        EXPECT_EQ(written.sum().item<std::int64_t>(), rows * heads * head_dim) << what;
        EXPECT_TRUE(at::equal(gdqkv.isnan().logical_not().cpu(), written)) << what << ": elements written elsewhere";
        expect_close(gdqkv.nan_to_num(0), dqkv.nan_to_num(0), type, what + " dqkv");
      }
#endif
}

// Strided GPU sources of every float type cast to every other (and int64, complex double copied) by one launch per
// call, into pinned host memory (the staging pool's kind, written across the bus) and into device memory; a pageable
// destination goes to copy_. Each as ATen casts it, NaN for NaN.
TEST(KernelsCudaTest, CastPackWritesPinnedAndDeviceMemoryAsATenCasts) {
#if !defined(TRESTLE_HAVE_CUDA) || !defined(TRESTLE_HAVE_TORCH_CUDA)
  GTEST_SKIP() << "this build has no CUDA kernels (no nvcc, or LibTorch without CUDA)";
#else
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU on this machine: the CUDA kernels are built, not run";
  at::manual_seed(6);
  const auto gpu = at::TensorOptions().device(at::kCUDA);
  at::Tensor values = at::randn({301, 1000}) * 1000;
  values[0][0] = NAN;
  values[0][1] = INFINITY;
  values[1][0] = 1e-40;
  std::vector<at::Tensor> sources;
  std::vector<at::ScalarType> types;
  for (const auto from : {at::kFloat, at::kBFloat16, at::kHalf})
    for (const auto to : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const at::Tensor g = values.to(from).to(at::kCUDA);
      for (const at::Tensor& view : {g.t(), g.slice(1, 1, 1000, 3), g[0].unsqueeze(0).expand({5, 1000}),
                                     g.reshape({7, 43, 1000}).permute({2, 0, 1}), g[2][3], g.narrow(0, 0, 0)}) {
        sources.push_back(view);
        types.push_back(to);
      }
    }
  sources.push_back((at::randn({40, 30}, gpu) * 100).to(at::kLong).t());
  types.push_back(at::kLong);
  sources.push_back(at::randn({20, 10}, gpu.dtype(at::kComplexDouble)).t());
  types.push_back(at::kComplexDouble);
  for (const std::string where : {"pinned", "device", "pageable"}) {
    std::vector<at::Tensor> destinations;
    for (std::size_t i = 0; i < sources.size(); ++i) {
      const auto options = at::TensorOptions().dtype(types[i]);
      destinations.push_back(where == "pinned"   ? at::empty({sources[i].numel()}, options.pinned_memory(true))
                             : where == "device" ? at::empty({sources[i].numel()}, options.device(at::kCUDA))
                                                 : at::empty({sources[i].numel()}, options));
    }
    cast_pack(sources, destinations);
    torch::cuda::synchronize();
    for (std::size_t i = 0; i < sources.size(); ++i) {
      const at::Tensor got = destinations[i].cpu(), expected = sources[i].contiguous().to(types[i]).cpu().reshape(-1);
      const std::string what = where + " " + std::to_string(i) + " " + c10::toString(sources[i].scalar_type()) +
                               " -> " + c10::toString(types[i]);
      if (got.is_floating_point()) {
        EXPECT_TRUE(at::equal(at::isnan(got), at::isnan(expected))) << what;
        EXPECT_TRUE(at::equal(got.nan_to_num(0, INFINITY, -INFINITY), expected.nan_to_num(0, INFINITY, -INFINITY)))
            << what;
      } else {
        EXPECT_TRUE(at::equal(got, expected)) << what;
      }
    }
  }
#endif
}

}  // namespace
}  // namespace trestle::kernels
