#include "train/loop/grad_buckets.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <limits>
#include <string>

namespace trestle::train {

class GradBuckets::ReadyHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  ReadyHook(GradBuckets* owner, std::size_t param) : owner_(owner), param_(param) {}
  void operator()(const torch::autograd::Variable&) override { owner_->on_ready(param_); }

 private:
  GradBuckets* owner_;
  std::size_t param_;
};

std::int64_t GradBuckets::default_bucket_elements(int data_parallel) {
  return std::max<std::int64_t>(40000000, 1000000LL * data_parallel);
}

Result<std::unique_ptr<GradBuckets>> GradBuckets::create(std::vector<at::Tensor> params,
                                                         c10::intrusive_ptr<c10d::Backend> dp_backend,
                                                         int data_parallel, std::int64_t bucket_elements,
                                                         std::string group_description, at::ScalarType grad_dtype,
                                                         std::optional<Sharded> sharded, double gradient_scale) {
  if (params.empty()) return Status::Error("no parameters to reduce");
  if (data_parallel > 1 && !dp_backend) return Status::Error("data parallel size > 1 needs a process group");
  std::unique_ptr<GradBuckets> g(new GradBuckets());
  g->params_ = std::move(params);
  g->backend_ = std::move(dp_backend);
  g->data_parallel_ = data_parallel;
  g->gradient_scale_ = gradient_scale > 0 ? gradient_scale : 1.0 / data_parallel;
  g->group_description_ = std::move(group_description);
  std::int64_t total = 0;
  for (const auto& p : g->params_) {
    if (!p.requires_grad() || !p.is_leaf()) return Status::Error("a parameter is not a leaf that requires grad");
    if (p.scalar_type() != g->params_.front().scalar_type() || p.device() != g->params_.front().device())
      return Status::Error("parameters of different dtypes or devices need separate gradient buffers");
    total += p.numel();
  }
  g->separate_grads_ = grad_dtype != g->params_.front().scalar_type();
  const std::size_t n = g->params_.size();
  g->grads_.resize(n);
  g->bucket_of_.assign(n, 0);
  g->ready_.assign(n, false);
  g->sinks_.resize(n);
  const at::TensorOptions grad_options = g->params_.front().options().dtype(grad_dtype).requires_grad(false);
  if (sharded) {
    // Megatron-Core's layout for the distributed optimizer; each bucket's shards are equal and contiguous.
    std::vector<std::int64_t> numels;
    for (const auto& p : g->params_) numels.push_back(p.numel());
    GradBufferOptions options;
    options.dp = data_parallel;
    options.bucket_size = bucket_elements;
    options.distributed_optimizer = true;
    if (!sharded->shared_embedding.empty() && sharded->shared_embedding.size() != n)
      return Status::Error("the shared-embedding marks do not match the parameters");
    GradBufferLayout layout = grad_buffer_layout(numels, sharded->shared_embedding, options);
    g->buffer_ = at::zeros({layout.numel}, grad_options);
    for (std::size_t i = 0; i < n; ++i) {
      at::Tensor& p = g->params_[i];
      g->grads_[i] = g->buffer_.narrow(0, layout.params[i].start, p.numel()).view(p.sizes());
      if (!g->separate_grads_) p.mutable_grad() = g->grads_[i];
      g->bucket_of_[i] = static_cast<std::size_t>(layout.params[i].bucket);
    }
    for (std::size_t b = 0; b < layout.buckets.size(); ++b) {
      const auto [start, end] = layout.buckets[b];
      Bucket bucket;
      bucket.data = g->buffer_.narrow(0, start, end - start);
      const auto shard = layout.shard(static_cast<int>(b), sharded->dp_rank, data_parallel);
      bucket.shard_start = shard.first - start;
      bucket.shard_numel = shard.second - shard.first;
      g->buckets_.push_back(std::move(bucket));
      for (const auto& owned : owned_param_ranges(layout, static_cast<int>(b), sharded->dp_rank, data_parallel))
        g->owned_.push_back(owned);
    }
    for (std::size_t i = 0; i < n; ++i) ++g->buckets_[g->bucket_of_[i]].params;
    g->sharded_layout_ = std::move(layout);
  } else {
    g->buffer_ = at::zeros({total}, grad_options);
    // Reverse order: the last parameters' gradients come first in backward. Each parameter's gradient is a view at
    // its place in the buffer; a bucket closes once it holds bucket_elements or more.
    std::int64_t offset = 0, bucket_start = 0;
    std::size_t bucket_params = 0;
    auto close_bucket = [&] {
      Bucket bucket;
      bucket.data = g->buffer_.narrow(0, bucket_start, offset - bucket_start);
      bucket.params = bucket_params;
      g->buckets_.push_back(std::move(bucket));
      bucket_start = offset;
      bucket_params = 0;
    };
    for (std::size_t k = 0; k < n; ++k) {
      const std::size_t i = n - 1 - k;
      at::Tensor& p = g->params_[i];
      g->grads_[i] = g->buffer_.narrow(0, offset, p.numel()).view(p.sizes());
      if (!g->separate_grads_) p.mutable_grad() = g->grads_[i];
      offset += p.numel();
      g->bucket_of_[i] = g->buckets_.size();
      ++bucket_params;
      if (offset - bucket_start >= bucket_elements) close_bucket();
    }
    if (bucket_params > 0) close_bucket();
  }
  for (std::size_t i = 0; i < n; ++i)
    torch::autograd::impl::set_post_acc_grad_hooks(g->params_[i], std::make_unique<ReadyHook>(g.get(), i));
  return g;
}

GradBuckets::~GradBuckets() {
  // A destructor has nobody to return a failed reduction to (the step that launched it has already failed or been
  // abandoned), so it says what the wait threw instead of dropping it.
  auto report = [](std::size_t bucket, const char* what) {
    std::fprintf(stderr,
                 "trestle: warning: gradient bucket %zu's reduction failed while the buckets were released: %s\n",
                 bucket, what);
  };
  for (std::size_t i = 0; i < buckets_.size(); ++i)
    if (buckets_[i].work) {
      try {
        buckets_[i].work->wait();
      } catch (const c10::Error& e) {
        report(i, e.what_without_backtrace());
      } catch (const std::exception& e) {
        report(i, e.what());
      } catch (...) {
        report(i, "an exception that is not a std::exception");
      }
    }
  for (auto& p : params_) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
}

WeightGradSink* GradBuckets::fused_sink(const at::Tensor& param) {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].is_same(param)) continue;
    if (!sinks_[i]) {
      sinks_[i] = std::make_unique<WeightGradSink>();
      sinks_[i]->main_grad = grads_[i];
      sinks_[i]->on_accumulated = [this, i] { on_ready(i); };
    }
    return sinks_[i].get();
  }
  return nullptr;
}

void GradBuckets::zero() {
  c10::NoGradGuard no_grad;
  if (check_nonfinite_ && !nonfinite_.defined())
    nonfinite_ = at::zeros({static_cast<std::int64_t>(buckets_.size())}, buffer_.options().dtype(at::kFloat));
  if (nonfinite_.defined()) nonfinite_.zero_();
  if (sharded_layout_) {  // padding between the parameters: zero everything, fused places included
    buffer_.zero_();
    for (auto& sink : sinks_)
      if (sink) sink->overwrite = false;
    for (auto& b : buckets_) b.ready = 0;
    return;
  }
  std::int64_t unfused_begin = 0, offset = 0;  // zero runs of unfused parameters in one call each
  // grads_ are laid out in reverse parameter order.
  for (std::size_t k = 0; k < params_.size(); ++k) {
    const std::size_t i = params_.size() - 1 - k;
    if (sinks_[i]) {
      if (offset > unfused_begin) buffer_.narrow(0, unfused_begin, offset - unfused_begin).zero_();
      sinks_[i]->overwrite = true;
      unfused_begin = offset + grads_[i].numel();
    }
    offset += grads_[i].numel();
  }
  if (offset > unfused_begin) buffer_.narrow(0, unfused_begin, offset - unfused_begin).zero_();
  for (auto& b : buckets_) b.ready = 0;
}

void GradBuckets::arm() {
  armed_ = true;
  next_to_start_ = 0;
  for (auto& b : buckets_) b.ready = 0;
  ready_.assign(ready_.size(), false);
}

void GradBuckets::on_ready(std::size_t param) {
  if (separate_grads_) {  // accumulate in the wider dtype; the parameter's own gradient is not kept
    at::Tensor& own = params_[param].mutable_grad();
    if (own.defined()) {
      c10::NoGradGuard no_grad;
      grads_[param].add_(own);
      own = at::Tensor();
    }
  }
  if (!armed_ || ready_[param]) return;
  ready_[param] = true;
  ++buckets_[bucket_of_[param]].ready;
  start_ready_buckets();
}

void GradBuckets::start_ready_buckets() {
  while (next_to_start_ < buckets_.size() && buckets_[next_to_start_].ready >= buckets_[next_to_start_].params)
    start(buckets_[next_to_start_++]);
}

void GradBuckets::start(Bucket& bucket) {
  c10::NoGradGuard no_grad;
  const auto index = static_cast<std::int64_t>(&bucket - buckets_.data());
  if (poison_ && index == 0) {
    bucket.data.view(-1)[0].fill_(std::numeric_limits<double>::quiet_NaN());
    poison_ = false;
  }
  // The sum of the bucket is finite exactly when its elements are (barring an overflow of finite ones, which the
  // norm Megatron checks shares).
  if (check_nonfinite_ && nonfinite_.defined()) nonfinite_[index].copy_(at::isfinite(bucket.data.sum()).logical_not());
  // Alone in its group a rank still scales (experts: 1 / dp with one rank holding each).
  if (gradient_scale_ != 1.0) bucket.data.mul_(gradient_scale_);
  if (data_parallel_ == 1) return;
  if (sharded_layout_) {
    bucket.shard_out = at::empty({bucket.shard_numel}, bucket.data.options());
    bucket.work = backend_->_reduce_scatter_base(bucket.shard_out, bucket.data);
    return;
  }
  std::vector<at::Tensor> tensors{bucket.data};
  bucket.work = backend_->allreduce(tensors);
}

std::vector<std::size_t> GradBuckets::nonfinite_buckets() const {
  std::vector<std::size_t> out;
  if (!nonfinite_.defined()) return out;
  const at::Tensor flags = nonfinite_.to(at::kCPU);
  for (std::int64_t i = 0; i < flags.numel(); ++i)
    if (flags[i].item<float>() != 0) out.push_back(static_cast<std::size_t>(i));
  return out;
}

Status GradBuckets::all_gather_parameters() {
  if (!sharded_layout_ || data_parallel_ == 1) return OkStatus();
  c10::NoGradGuard no_grad;
  const GradBufferLayout& layout = *sharded_layout_;
  if (!gathered_.defined()) gathered_ = at::zeros({layout.numel}, params_.front().options().requires_grad(false));
  at::Tensor& gathered = gathered_;
  for (std::size_t i = 0; i < params_.size(); ++i)
    gathered.narrow(0, layout.params[i].start, params_[i].numel()).copy_(params_[i].detach().reshape(-1));
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    const auto [start, end] = layout.buckets[b];
    at::Tensor out = gathered.narrow(0, start, end - start);
    at::Tensor in = out.narrow(0, buckets_[b].shard_start, buckets_[b].shard_numel).clone();
    try {
      backend_->_allgather_base(out, in)->wait();
    } catch (const std::exception& e) {
      return Status::Error("data-parallel parameter all-gather of bucket " + std::to_string(b) + " in the " +
                           group_description_ + " failed (a peer died or hung): " + e.what());
    }
  }
  for (std::size_t i = 0; i < params_.size(); ++i)
    params_[i].detach().view(-1).copy_(gathered.narrow(0, layout.params[i].start, params_[i].numel()));
  return OkStatus();
}

Status GradBuckets::finish() {
  for (auto& sink : sinks_)  // a fused parameter that received no gradient since zero()
    if (sink && sink->overwrite) {
      c10::NoGradGuard no_grad;
      sink->main_grad.zero_();
      sink->overwrite = false;
    }
  while (next_to_start_ < buckets_.size()) start(buckets_[next_to_start_++]);
  armed_ = false;
  Status status = OkStatus();
  for (std::size_t i = 0; i < buckets_.size(); ++i) {
    auto& b = buckets_[i];
    if (!b.work) continue;
    try {
      b.work->wait();
    } catch (const std::exception& e) {
      if (status.ok())
        status = Status::Error(std::string("data-parallel gradient ") +
                               (sharded_layout_ ? "reduce-scatter" : "all-reduce") + " of bucket " + std::to_string(i) +
                               " in the " + group_description_ + " failed (a peer died or hung): " + e.what());
    }
    b.work.reset();
    if (b.shard_out.defined()) {
      if (status.ok()) b.data.narrow(0, b.shard_start, b.shard_numel).copy_(b.shard_out);
      b.shard_out = at::Tensor();
    }
  }
  return status;
}

}  // namespace trestle::train
