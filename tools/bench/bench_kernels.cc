// trestle bench kernels: each fused kernel (train/model/fused_kernels.h) beside the ATen composite the model computes
// otherwise (train/model/transformer_layer.h), forward and backward, per dtype, on the CPU and (when there is one) the
// GPU, in one run; the checkpoint's cast-and-pack (kernels/cast_pack.h) beside copy_ into the staging bytes, on the
// CPU; and each beside the bandwidth floor, the bytes the kernel must move over the copy bandwidth measured in the same
// run. Prints a table and writes every figure as JSON.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cxxopts.hpp>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/byte_size.h"
#include "ckpt/staging_pool.h"
#include "kernels/cast_pack.h"
#include "kernels/kernel_dtype.h"
#include "kernels/sum_of_squares.h"
#include "tools/bench/bench.h"
#include "tools/bench/bench_report.h"
#include "tools/parse_error.h"
#include "train/model/blockwise_attention.h"
#include "train/model/fused_kernels.h"
#include "train/model/rope.h"
#include "train/model/transformer_layer.h"

#if defined(TRESTLE_HAVE_TORCH_CUDA)
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/Sleep.h>
#endif
#if defined(TRESTLE_HAVE_TORCH_CUDA) && defined(TRESTLE_HAVE_CUDA)
#include "kernels/cuda/cuda_kernels.h"
#endif

namespace trestle::cli {
namespace {

void synchronize(const at::Device& device) {
#if defined(TRESTLE_HAVE_TORCH_CUDA)
  if (device.is_cuda()) at::cuda::device_synchronize();
#else
  (void)device;
#endif
}

// One call's time as the device runs it. On the CPU: wall time. On a GPU: CUDA events on the current stream around the
// call, each call after a write of 1 GiB that evicts its inputs from the L2 cache (they come from HBM, as in a
// training step) and a kernel that spins for about 5 ms, which keeps the GPU busy while the host issues the call's
// launches (the write alone, 0.2-0.3 ms, may end before an autograd backward has issued them: on the H200 the
// backward figures were 2-4x what a training step's profile gave the same kernels at twice the rows): the kernels'
// own time, without the host's launch overhead or a synchronisation (as Triton's do_bench measures).
class CallTimer {
 public:
  explicit CallTimer(const at::Device& device) : device_(device) {
    if (!device.is_cuda()) return;
    flush_ = at::empty({std::int64_t{1} << 30}, at::TensorOptions().dtype(at::kByte).device(device));
#if defined(TRESTLE_HAVE_TORCH_CUDA)
    int khz = 0;
    const int index = device.has_index() ? device.index() : at::cuda::current_device();
    if (cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, index) != cudaSuccess || khz <= 0) khz = 2'000'000;
    spin_cycles_ = std::int64_t{khz} * 5;  // 5 ms at the peak clock
#endif
  }

  void start() {
#if defined(TRESTLE_HAVE_TORCH_CUDA)
    if (device_.is_cuda()) {
      flush_.zero_();
      at::cuda::sleep(spin_cycles_);
      begin_.record();
      return;
    }
#endif
    watch_ = Stopwatch();
  }

  // Seconds since start(), once the call's work is done.
  double stop() {
#if defined(TRESTLE_HAVE_TORCH_CUDA)
    if (device_.is_cuda()) {
      end_.record();
      end_.synchronize();
      return static_cast<double>(begin_.elapsed_time(end_)) / 1e3;
    }
#endif
    return watch_.seconds();
  }

 private:
  at::Device device_;
  at::Tensor flush_;
  Stopwatch watch_;
#if defined(TRESTLE_HAVE_TORCH_CUDA)
  std::int64_t spin_cycles_ = 0;
  at::cuda::CUDAEvent begin_{cudaEventDefault}, end_{cudaEventDefault};
#endif
};

// Best of `repeat` timed calls, in seconds (CallTimer's: on a GPU, the kernels' time), after warm-up calls for at
// least 20 ms (one call was not enough for a run's first small kernel: its every call stayed several times slower).
double best_seconds(const at::Device& device, unsigned repeat, const std::function<void()>& run) {
  const auto warm_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
  do {
    run();
    synchronize(device);
  } while (std::chrono::steady_clock::now() < warm_until);
  CallTimer timer(device);
  double best = 1e30;
  for (unsigned i = 0; i < repeat; ++i) {
    timer.start();
    run();
    best = std::min(best, timer.stop());
  }
  return best;
}

// The copy bandwidth of the device (bytes read + written per second) on a buffer of `bytes`, copied out of place
// (clone): what the kernels do too, each writing a new output (on the CPU the fresh pages' faults count in both).
double copy_bandwidth(const at::Device& device, std::int64_t bytes, unsigned repeat) {
  const at::Tensor src = at::rand({bytes / 4}, at::TensorOptions().device(device));
  const double s = best_seconds(device, repeat, [&] { (void)src.clone(); });
  return 2.0 * static_cast<double>(bytes) / s;
}

struct Row {
  std::string kernel, dtype, device, pass;
  double fused_s = 0, composite_s = 0, floor_s = 0;
  std::int64_t bytes = 0;
};

// Times a forward (and its backward, a gradient of ones into each output) of the fused function and of the composite
// on the same inputs.
void measure_outputs(
    std::vector<Row>& rows, const std::string& kernel, const at::Device& device, at::ScalarType type, unsigned repeat,
    double bandwidth, const std::vector<at::Tensor>& inputs, std::int64_t forward_bytes, std::int64_t backward_bytes,
    const std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&, bool fused)>& forward) {
  const std::string dtype = c10::toString(type), where = device.is_cuda() ? "cuda" : "cpu";
  Row f{kernel, dtype, where, "forward"}, b{kernel, dtype, where, "backward"};
  {
    at::NoGradGuard no_grad;
    f.fused_s = best_seconds(device, repeat, [&] { forward(inputs, true); });
    f.composite_s = best_seconds(device, repeat, [&] { forward(inputs, false); });
  }
  auto backward_time = [&](bool fused) {
    std::vector<at::Tensor> leaves;
    for (const auto& t : inputs) leaves.push_back(t.detach().requires_grad_(true));
    CallTimer timer(device);
    double best = 1e30;
    for (unsigned i = 0; i <= repeat; ++i) {
      const std::vector<at::Tensor> outs = forward(leaves, fused);
      std::vector<at::Tensor> grads;
      for (const auto& out : outs) grads.push_back(at::ones_like(out));
      synchronize(device);
      timer.start();
      torch::autograd::backward(outs, grads);
      const double seconds = timer.stop();
      if (i > 0) best = std::min(best, seconds);  // the first is the warm-up
      for (auto& l : leaves) l.mutable_grad() = at::Tensor();
    }
    return best;
  };
  b.fused_s = backward_time(true);
  b.composite_s = backward_time(false);
  f.bytes = forward_bytes;
  b.bytes = backward_bytes;
  f.floor_s = static_cast<double>(forward_bytes) / bandwidth;
  b.floor_s = static_cast<double>(backward_bytes) / bandwidth;
  progress(kernel + " " + dtype + " " + where + ": forward " + format_ratio(f.composite_s, f.fused_s) +
           ", backward " + format_ratio(b.composite_s, b.fused_s) + " the composite");
  rows.push_back(f);
  rows.push_back(b);
}

// The same for a function of one output.
void measure(std::vector<Row>& rows, const std::string& kernel, const at::Device& device, at::ScalarType type,
             unsigned repeat, double bandwidth, const std::vector<at::Tensor>& inputs, std::int64_t forward_bytes,
             std::int64_t backward_bytes,
             const std::function<at::Tensor(const std::vector<at::Tensor>&, bool fused)>& forward) {
  measure_outputs(
      rows, kernel, device, type, repeat, bandwidth, inputs, forward_bytes, backward_bytes,
      [&](const std::vector<at::Tensor>& in, bool fused) { return std::vector<at::Tensor>{forward(in, fused)}; });
}

// The output loss's cross-entropy over a chunk of logits [rows, vocab] (no soft-cap, every target on this rank), as
// chunked_cross_entropy.h runs it: forward the row maxima and the sums of exp (the fused kernels' two passes over the
// logits in their dtype, against ATen's ops on them widened to fp32), backward the logits' gradient from the
// log-sum-exp (the fused pass, against ATen's exp, scatter and scale, rounded back to the logits' dtype). The floor:
// the bytes the fused passes move (forward: the logits read twice; backward: read and the gradient written).
void measure_cross_entropy(std::vector<Row>& rows, const at::Device& device, unsigned repeat, double bandwidth,
                           const at::Tensor& logits) {
  const std::int64_t n = logits.size(0), e = static_cast<std::int64_t>(logits.element_size());
  const at::Tensor target = at::randint(0, logits.size(1), {n}, logits.options().dtype(at::kLong));
  const at::Tensor outside = at::zeros({n}, logits.options().dtype(at::kBool));
  const at::Tensor grad_loss = at::full({n}, 1.0 / static_cast<double>(n), logits.options().dtype(at::kFloat));
  const at::Tensor lse = at::logsumexp(logits.to(at::kFloat), -1);
  const std::string dtype = c10::toString(logits.scalar_type()), where = device.is_cuda() ? "cuda" : "cpu";
  Row f{"cross_entropy", dtype, where, "forward"}, b{"cross_entropy", dtype, where, "backward"};
  f.fused_s = best_seconds(device, repeat, [&] {
    at::Tensor max = train::cross_entropy_max(logits, 0.0);
    (void)train::cross_entropy_sums(logits, target, outside, max, 0.0);
  });
  f.composite_s = best_seconds(device, repeat, [&] {
    const at::Tensor z = logits.to(at::kFloat);
    const at::Tensor shifted = z - std::get<0>(z.max(-1)).unsqueeze(-1);
    (void)shifted.gather(-1, target.unsqueeze(-1));
    (void)shifted.exp().sum(-1);
  });
  b.fused_s = best_seconds(device, repeat,
                           [&] { (void)train::cross_entropy_grad(logits, target, outside, lse, grad_loss, 0.0); });
  b.composite_s = best_seconds(device, repeat, [&] {
    at::Tensor g = (logits.to(at::kFloat) - lse.unsqueeze(-1)).exp_();
    g.scatter_add_(-1, target.unsqueeze(-1), at::full({n, 1}, -1.0, g.options()));
    (void)g.mul_(grad_loss.unsqueeze(-1)).to(logits.scalar_type());
  });
  f.bytes = b.bytes = 2 * logits.numel() * e;
  f.floor_s = b.floor_s = static_cast<double>(f.bytes) / bandwidth;
  progress("cross_entropy " + dtype + " " + where + ": forward " + format_ratio(f.composite_s, f.fused_s) +
           ", backward " + format_ratio(b.composite_s, b.fused_s) + " the composite");
  rows.push_back(f);
  rows.push_back(b);
}

// The gradient clipping's Σ x² in double over a gradient `g` on the CPU (kernels/sum_of_squares.h): the CPU kernel
// against ATen's chunks widened to double and dotted. The floor: g read once.
void measure_sum_of_squares(std::vector<Row>& rows, unsigned repeat, double bandwidth, const at::Tensor& g) {
  const at::Device cpu(at::kCPU);
  Row r{"sum_of_squares (fp64)", c10::toString(g.scalar_type()), "cpu", "reduce"};
  r.fused_s = best_seconds(cpu, repeat, [&] { (void)kernels::sum_of_squares(g); });
  r.composite_s = best_seconds(cpu, repeat, [&] { (void)kernels::sum_of_squares_widened(g); });
  r.bytes = g.numel() * static_cast<std::int64_t>(g.element_size());
  r.floor_s = static_cast<double>(r.bytes) / bandwidth;
  progress("sum_of_squares " + r.dtype + " cpu: " + format_ratio(r.composite_s, r.fused_s) + " the composite");
  rows.push_back(r);
}

// On a GPU: RMSNorm's two CUDA kernels, a warp a row and a block a row (kernels/cuda/cuda_kernels.h), each launched
// alone (no autograd, outputs made beforehand) on x [rows, cols] and w, as rows beside the composite's times and the
// floor of the two rows `measure` added last for the fused op. The op takes the first where a row fits a warp.
void measure_rms_norm_kernels(std::vector<Row>& rows, const at::Device& device, unsigned repeat, const at::Tensor& x,
                              const at::Tensor& w) {
#if defined(TRESTLE_HAVE_TORCH_CUDA) && defined(TRESTLE_HAVE_CUDA)
  namespace cuda = kernels::cuda;
  if (!device.is_cuda() || rows.size() < 2) return;
  const Row op_forward = rows[rows.size() - 2], op_backward = rows.back();
  const std::int64_t n = x.size(0), cols = x.size(1);
  const kernels::cpu::Dtype type = kernels::dtype_of(x.scalar_type());
  const auto fp32 = x.options().dtype(at::kFloat);
  const at::Tensor dy = at::randn_like(x), y = at::empty_like(x), dx = at::empty_like(x);
  const at::Tensor inv = at::empty({n}, fp32), dw = at::empty({cols}, fp32);
  const at::Tensor partial = at::empty({cuda::partial_rows(n), cols}, fp32);
  void* stream = at::cuda::getCurrentCUDAStream().stream();
  for (const auto& [name, rows_over] : {std::pair{"rms_norm warp/row", cuda::RowsOver::kWarps},
                                        std::pair{"rms_norm block/row", cuda::RowsOver::kBlocks}}) {
    std::string error;
    const auto forward = [&] {
      error =
          cuda::rms_norm_forward(type, x.data_ptr(), /*residual=*/nullptr, /*sum=*/nullptr, w.data_ptr(), y.data_ptr(),
                                 inv.data_ptr<float>(), n, cols, 1e-6f, /*zero_centered=*/false, stream, rows_over);
    };
    const auto backward = [&] {
      error = cuda::rms_norm_backward(type, dy.data_ptr(), x.data_ptr(), w.data_ptr(), inv.data_ptr<float>(),
                                      /*residual_grad=*/nullptr, dx.data_ptr(), dw.data_ptr<float>(),
                                      partial.data_ptr<float>(), n, cols,
                                      /*zero_centered=*/false, stream, rows_over);
    };
    Row f = op_forward, b = op_backward;
    f.kernel = b.kernel = name;
    f.fused_s = best_seconds(device, repeat, forward);
    if (error.empty()) b.fused_s = best_seconds(device, repeat, backward);
    if (!error.empty()) {
      progress(std::string(name) + ": " + error);
      continue;
    }
    const auto of_floor = [](const Row& r) { return std::to_string(std::lround(100 * r.floor_s / r.fused_s)) + "%"; };
    progress(std::string(name) + " " + f.dtype + ": forward at " + of_floor(f) + " of the floor, backward at " +
             of_floor(b));
    rows.push_back(f);
    rows.push_back(b);
  }
#else
  (void)rows, (void)device, (void)repeat, (void)x, (void)w;
#endif
}

// `numel` elements of `type` in staging memory from the staging pool's own allocator (touched, on huge pages where the
// kernel's THP allows them), as a 1-d tensor that keeps the memory alive.
Result<at::Tensor> staging_memory(std::int64_t numel, at::ScalarType type) {
  auto memory = allocate_locked_if_allowed(static_cast<std::size_t>(numel) * at::elementSize(type));
  if (!memory.ok()) return memory.status();
  std::shared_ptr<void> owner = std::move(memory->owner);
  return at::from_blob(
      memory->data, {numel}, [owner](void*) mutable { owner.reset(); }, at::TensorOptions().dtype(type));
}

// The staging copy of a save that stores fp32 as bf16: `mib` MiB of fp32, contiguous and transposed, packed into
// staging memory made as the pool makes it, by the fused kernel and by copy_ into a from_blob view of it (what ckpt
// does without it). Its floor: the bytes read and written over the bandwidth of copying fp32 into such memory (copy_,
// ATen's threaded memcpy), measured here, since the out-of-place copy bandwidth counts fresh pages' faults. Returns
// that bandwidth.
Result<double> measure_cast_pack(std::vector<Row>& rows, std::int64_t mib, unsigned repeat) {
  const at::Device cpu(at::kCPU);
  const auto side = static_cast<std::int64_t>(std::sqrt(static_cast<double>((mib << 20) / 4)));
  TRESTLE_ASSIGN_OR_RETURN(const at::Tensor destination, staging_memory(side * side, at::kBFloat16));
  TRESTLE_ASSIGN_OR_RETURN(const at::Tensor touched, staging_memory(side * side, at::kFloat));
  at::Tensor src;
  try {
    src = at::randn({side, side});
  } catch (const c10::Error&) {
    return Status::Error("cannot allocate the " + format_bytes(static_cast<std::size_t>(side * side * 4)) +
                         " fp32 source");
  }
  const at::Tensor copied = touched.view(src.sizes());
  const double bandwidth =
      2.0 * static_cast<double>(src.nbytes()) / best_seconds(cpu, repeat, [&] { copied.copy_(src); });
  progress("cpu copy bandwidth into touched memory " + std::to_string(bandwidth / 1e9) + " GB/s");
  const std::int64_t bytes = src.numel() * (4 + 2);
  for (const bool transposed : {false, true}) {
    const at::Tensor view = transposed ? src.t() : src;
    const at::Tensor shaped = at::from_blob(destination.data_ptr(), view.sizes(), at::kBFloat16);
    Row r{"cast_pack to bf16", "float", "cpu", transposed ? "transposed" : "contiguous"};
    r.fused_s = best_seconds(cpu, repeat, [&] { kernels::cast_pack({&view, 1}, {&destination, 1}); });
    r.composite_s = best_seconds(cpu, repeat, [&] { shaped.copy_(view); });
    r.bytes = bytes;
    r.floor_s = static_cast<double>(bytes) / bandwidth;
    progress("cast_pack float -> bfloat16 " + r.pass + ": " + format_ratio(r.composite_s, r.fused_s) + " copy_");
    rows.push_back(r);
  }
  return bandwidth;
}

void run_device(std::vector<Row>& rows, const at::Device& device, const std::vector<at::ScalarType>& types,
                std::int64_t tokens, std::int64_t hidden, std::int64_t ffn, std::int64_t vocab, std::int64_t head_dim,
                unsigned repeat, double bandwidth) {
  GptModelSpec plain, gemma, geglu;
  plain.norm_epsilon = gemma.norm_epsilon = 1e-6;
  gemma.zero_centered_norms = true;
  geglu.geglu = true;
  for (const at::ScalarType type : types) {
    const auto options = at::TensorOptions().dtype(type).device(device);
    const std::int64_t e = at::elementSize(type);
    const at::Tensor x = at::randn({tokens, hidden}, options), w = at::randn({hidden}, options) * 0.1 + 1;
    for (const auto& norm : {std::pair{"rms_norm", &plain}, std::pair{"rms_norm (1 + w)", &gemma}}) {
      const GptModelSpec* s = norm.second;
      measure(rows, norm.first, device, type, repeat, bandwidth, {x, w},
              (2 * tokens * hidden + hidden) * e + tokens * 4, (3 * tokens * hidden + 2 * hidden) * e + tokens * 4,
              [s](const std::vector<at::Tensor>& in, bool f) { return train::model_norm(in[0], in[1], *s, f); });
      if (s == &plain) measure_rms_norm_kernels(rows, device, repeat, x, w);
    }
    // The residual step and the norm after it, both outputs taking part (h goes on down the stream): forward reads x,
    // the step and w, writes h, y and inv_rms; backward reads both gradients, h, w and inv_rms, writes dx and dw.
    const at::Tensor step = at::randn({tokens, hidden}, options);
    measure_outputs(rows, "add + rms_norm", device, type, repeat, bandwidth, {x, step, w},
                    (4 * tokens * hidden + hidden) * e + tokens * 4,
                    (4 * tokens * hidden + 2 * hidden) * e + tokens * 4,
                    [&plain](const std::vector<at::Tensor>& in, bool f) {
                      const train::NormedResidual h = train::add_then_norm(in[0], in[1], in[2], plain, f);
                      return std::vector<at::Tensor>{h.sum, h.normed};
                    });
    const at::Tensor fc1 = at::randn({tokens, 2 * ffn}, options);
    for (const auto& glu : {std::pair{"swiglu", &plain}, std::pair{"geglu", &geglu}}) {
      const GptModelSpec* s = glu.second;
      measure(rows, glu.first, device, type, repeat, bandwidth, {fc1}, 3 * tokens * ffn * e, 5 * tokens * ffn * e,
              [s](const std::vector<at::Tensor>& in, bool f) { return train::mlp_activation(in[0], *s, f); });
    }
    const at::Tensor logits = at::randn({tokens / 4, vocab}, options) * 20;
    measure(rows, "softcap", device, type, repeat, bandwidth, {logits}, 2 * logits.numel() * e,
            3 * logits.numel() * e,
            [](const std::vector<at::Tensor>& in, bool f) { return train::softcap(in[0], 30.0, f); });
    measure_cross_entropy(rows, device, repeat, bandwidth, logits);
    // Gemma 2's soft-capped causal attention over one sequence of tokens / 4 positions, hidden / head_dim query heads
    // and a quarter as many key / value heads: a block of queries at a time against the whole score matrix. Bound by
    // its products, not by memory: the floor (q, k, v read, the output written; backward also its gradient read and
    // theirs written) says how far from the bytes alone it is.
    {
      const std::int64_t seq = tokens / 4, heads = hidden / head_dim;
      std::int64_t groups = std::max<std::int64_t>(1, heads / 4);
      while (heads % groups != 0) --groups;  // the most key / value heads up to a quarter that divide the heads
      const at::Tensor aq = at::randn({1, heads, seq, head_dim}, options);
      const at::Tensor ak = at::randn({1, groups, seq, head_dim}, options),
                       av = at::randn({1, groups, seq, head_dim}, options);
      train::ScoresAttention capped;
      capped.scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
      capped.softcap = 50.0;
      const std::int64_t bytes = 2 * (aq.numel() + ak.numel()) * e;
      measure(rows, "softcap attention", device, type, repeat, bandwidth, {aq, ak, av}, bytes, 2 * bytes,
              [capped](const std::vector<at::Tensor>& in, bool f) {
                return f ? train::blockwise_attention(in[0], in[1], in[2], capped)
                         : train::whole_matrix_attention(in[0], in[1], in[2], capped);
              });
    }
    // The queries of one sequence of `tokens` positions, [tokens, 1, hidden / head_dim, head_dim]; the tables are
    // constants the closure holds (no gradient), read besides x and y.
    const at::Tensor positions = at::arange(tokens, at::TensorOptions().dtype(at::kLong).device(device)).unsqueeze(0);
    const at::Tensor inverse_frequencies =
        1.0 / at::pow(10000.0, at::arange(0, head_dim, 2, options.dtype(at::kFloat)) / static_cast<double>(head_dim));
    const train::RopeTables tables = train::rope_tables(inverse_frequencies, positions);
    const at::Tensor q = at::randn({tokens, 1, hidden / head_dim, head_dim}, options);
    const std::int64_t table_bytes = 2 * tokens * head_dim * 4;
    measure(rows, "rope", device, type, repeat, bandwidth, {q}, 2 * q.numel() * e + table_bytes,
            2 * q.numel() * e + table_bytes,
            [tables](const std::vector<at::Tensor>& in, bool f) { return train::apply_rope(in[0], tables, f); });
    // The gradient clipping's norm over one MLP weight's gradient [ffn, hidden], on the CPU (a GPU's is one
    // multi-tensor pass of ATen's).
    if (!device.is_cuda()) measure_sum_of_squares(rows, repeat, bandwidth, at::randn({ffn, hidden}, options));
  }
}

}  // namespace

int bench_kernels_main(int argc, char** argv) {
  cxxopts::Options spec("trestle bench kernels",
                        "Each fused kernel (RMSNorm and Gemma's (1 + w) RMSNorm, the residual add with the RMSNorm "
                        "after it, SwiGLU, GeGLU, soft-capping, the output loss's cross-entropy passes over a chunk "
                        "of logits, Gemma 2's soft-capped attention a block of queries at a time, RoPE) "
                        "beside the ATen composite the model computes without it, forward and backward, per dtype, on "
                        "the CPU and on the GPU when there is one; the gradient clipping's sum of squares in fp64 "
                        "over an [ffn, hidden] gradient beside ATen's widened chunks, on the CPU; the checkpoint's "
                        "cast-and-pack of fp32 to bf16 "
                        "(contiguous and transposed) beside copy_ into the staging bytes, on the CPU; and each beside "
                        "the bandwidth floor: the bytes the kernel must read and write over the out-of-place copy "
                        "bandwidth measured in the same run (for cast-and-pack, the copy bandwidth into touched "
                        "memory, as the staging pool is). Times are the best of --repeat calls: wall time on the "
                        "CPU; on the GPU the kernels' own time, by CUDA events around each call after a 1 GiB "
                        "write that empties the L2 cache and a 5 ms spin while the host issues the call (no launch "
                        "overhead or synchronisation counted). On the GPU, RMSNorm's two CUDA kernels (a warp a "
                        "row, which the model takes where a row fits, and a block a row) are also timed alone, "
                        "without autograd, as rows 'rms_norm warp/row' and 'rms_norm block/row'.");
  spec.add_options()("tokens", "rows (tokens) per call", cxxopts::value<std::int64_t>()->default_value("4096"))(
      "hidden", "hidden size (the norms)", cxxopts::value<std::int64_t>()->default_value("2048"))(
      "ffn", "MLP width (the gated units' output)", cxxopts::value<std::int64_t>()->default_value("5632"))(
      "vocab", "logit row width (soft-capping over tokens / 4 rows)",
      cxxopts::value<std::int64_t>()->default_value("32000"))("head-dim",
                                                              "RoPE's head size (queries of hidden / head-dim heads)",
                                                              cxxopts::value<std::int64_t>()->default_value("128"))(
      "cast-pack-mib",
      "fp32 MiB cast to bf16 and packed, as a checkpoint's staging (a square matrix; 0: none); more than the CPU's "
      "last-level cache, or the copy measures the cache",
      cxxopts::value<std::int64_t>()->default_value("1024"))(
      "dtypes", "comma-separated: float, bfloat16, half",
      cxxopts::value<std::string>()->default_value("float,bfloat16"))(
      "device", "cpu, cuda, or all (the GPU too when there is one)",
      cxxopts::value<std::string>()->default_value("all"))("threads", "CPU threads (0: ATen's default)",
                                                           cxxopts::value<int>()->default_value("0"))(
      "repeat", "timed calls per figure (best taken)", cxxopts::value<unsigned>()->default_value("5"))(
      "json-out", "write every figure to this JSON file", cxxopts::value<std::string>())("h,help", "this help");
  cxxopts::ParseResult args;
  try {
    args = spec.parse(argc, argv);
  } catch (const cxxopts::exceptions::exception& e) {
    std::fprintf(stderr, "trestle bench kernels: %s\n", describe_parse_error(e, argc, argv).c_str());
    return 2;
  }
  if (!args.unmatched().empty()) {
    std::fprintf(stderr, "trestle bench kernels: unexpected argument '%s'\n", args.unmatched().front().c_str());
    return 2;
  }
  if (args.count("help")) {
    std::printf("%s\n", spec.help().c_str());
    return 0;
  }
  const std::int64_t tokens = args["tokens"].as<std::int64_t>(), hidden = args["hidden"].as<std::int64_t>();
  const std::int64_t ffn = args["ffn"].as<std::int64_t>(), vocab = args["vocab"].as<std::int64_t>();
  const std::int64_t head_dim = args["head-dim"].as<std::int64_t>();
  const std::int64_t cast_pack_mib = args["cast-pack-mib"].as<std::int64_t>();
  const unsigned repeat = args["repeat"].as<unsigned>();
  if (tokens < 4 || hidden < 1 || ffn < 1 || vocab < 1 || repeat < 1 || cast_pack_mib < 0 ||
      cast_pack_mib > (std::int64_t{1} << 40)) {
    std::fprintf(stderr,
                 "trestle bench kernels: --tokens (>= 4), --hidden, --ffn, --vocab and --repeat must be "
                 "positive, --cast-pack-mib at least 0 and at most 2^40\n");
    return 2;
  }
  if (head_dim < 2 || head_dim % 2 != 0 || hidden % head_dim != 0) {
    std::fprintf(stderr, "trestle bench kernels: --head-dim must be even and divide --hidden\n");
    return 2;
  }
  if (args.count("json-out")) {
    if (const Status s = check_report_writable(args["json-out"].as<std::string>()); !s.ok()) {
      std::fprintf(stderr, "trestle bench kernels: --json-out: %s\n", s.message().c_str());
      return 2;
    }
  }
  std::vector<at::ScalarType> types;
  std::string list = args["dtypes"].as<std::string>();
  for (std::size_t start = 0; start <= list.size();) {
    const std::size_t comma = std::min(list.find(',', start), list.size());
    const std::string name = list.substr(start, comma - start);
    if (name == "float") types.push_back(at::kFloat);
    else if (name == "bfloat16") types.push_back(at::kBFloat16);
    else if (name == "half") types.push_back(at::kHalf);
    else {
      std::fprintf(stderr, "trestle bench kernels: --dtypes: unknown dtype '%s' (float, bfloat16, half)\n",
                   name.c_str());
      return 2;
    }
    start = comma + 1;
  }
  const std::string device = args["device"].as<std::string>();
  if (device != "cpu" && device != "cuda" && device != "all") {
    std::fprintf(stderr, "trestle bench kernels: --device %s: cpu, cuda or all\n", device.c_str());
    return 2;
  }
  if (const int threads = args["threads"].as<int>(); threads < 0 || threads > 4096) {
    std::fprintf(stderr, "trestle bench kernels: --threads %d: 0 (ATen's default) to 4096\n", threads);
    return 2;
  } else if (threads > 0) {
    at::set_num_threads(threads);
  }
  const bool gpu = torch::cuda::is_available() &&
                   train::supports(at::empty({1}, at::TensorOptions().device(at::kCUDA)));
  if (device == "cuda" && !gpu) {
    std::fprintf(stderr, "trestle bench kernels: --device cuda: no GPU here, or this build has no CUDA kernels\n");
    return 1;
  }
  std::vector<at::Device> devices;
  if (device != "cuda") devices.emplace_back(at::kCPU);
  if (device != "cpu" && gpu) devices.emplace_back(at::kCUDA);

  std::vector<Row> rows;
  nlohmann::json bandwidths = nlohmann::json::object();
  std::optional<double> cast_pack_bandwidth;
  for (const at::Device& d : devices) {
    const double bandwidth = copy_bandwidth(d, std::int64_t{256} << 20, repeat);
    bandwidths[d.is_cuda() ? "cuda" : "cpu"] = bandwidth;
    progress(std::string(d.is_cuda() ? "cuda" : "cpu") + " copy bandwidth " + std::to_string(bandwidth / 1e9) +
             " GB/s");
    run_device(rows, d, types, tokens, hidden, ffn, vocab, head_dim, repeat, bandwidth);
    if (d.is_cpu() && cast_pack_mib > 0) {
      auto measured = measure_cast_pack(rows, cast_pack_mib, repeat);
      if (!measured.ok()) {
        std::fprintf(stderr, "trestle bench kernels: --cast-pack-mib %lld: %s\n", static_cast<long long>(cast_pack_mib),
                     measured.status().message().c_str());
        return 1;
      }
      cast_pack_bandwidth = *measured;
    }
  }
  std::printf("fused kernels (CPU build: %s, %d threads) beside ATen's composite and the bandwidth floor\n",
              train::cpu_kernels_name().c_str(), at::get_num_threads());
  if (std::any_of(devices.begin(), devices.end(), [](const at::Device& d) { return d.is_cuda(); }))
    std::printf(
        "cuda rows: the kernels' time by CUDA events, each call after a 1 GiB write that empties the L2 cache\n");
  std::printf("%-18s %-9s %-5s %-10s %10s %10s %8s %10s %9s\n", "kernel", "dtype", "dev", "pass", "fused ms", "ATen ms",
              "speedup", "floor ms", "of floor");
  nlohmann::json figures = nlohmann::json::array();
  for (const Row& r : rows) {
    std::printf("%-18s %-9s %-5s %-10s %10.3f %10.3f %8s %10.3f %8.0f%%\n", r.kernel.c_str(), r.dtype.c_str(),
                r.device.c_str(), r.pass.c_str(), r.fused_s * 1e3, r.composite_s * 1e3,
                format_ratio(r.composite_s, r.fused_s).c_str(), r.floor_s * 1e3, 100.0 * r.floor_s / r.fused_s);
    figures.push_back({{"kernel", r.kernel}, {"dtype", r.dtype}, {"device", r.device}, {"pass", r.pass},
                       {"fused_s", r.fused_s}, {"composite_s", r.composite_s}, {"floor_s", r.floor_s},
                       {"bytes", r.bytes}, {"speedup", r.composite_s / r.fused_s},
                       {"share_of_floor", r.floor_s / r.fused_s}});
  }
  if (args.count("json-out")) {
    nlohmann::json out = {{"benchmark", "kernels"},
                          {"machine", machine_facts()},
                          {"cpu_kernels", train::cpu_kernels_name()},
                          {"threads", at::get_num_threads()},
                          {"shape",
                           {{"tokens", tokens},
                            {"hidden", hidden},
                            {"ffn", ffn},
                            {"vocab", vocab},
                            {"head_dim", head_dim},
                            {"cast_pack_mib", cast_pack_mib}}},
                          {"copy_bandwidth_bytes_per_s", bandwidths},
                          {"timing",
                           {{"cpu", "wall time of a call"},
                            {"cuda", "CUDA events around a call, after a 1 GiB write that empties the L2 cache"}}},
                          {"figures", figures}};
    if (cast_pack_bandwidth) out["cast_pack_copy_bandwidth_bytes_per_s"] = *cast_pack_bandwidth;  // its rows' floor
    if (auto s = write_json_file(args["json-out"].as<std::string>(), out); !s.ok()) {
      std::fprintf(stderr, "trestle bench kernels: %s\n", s.message().c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace trestle::cli
