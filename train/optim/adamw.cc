#include "train/optim/adamw.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <string>

#include "kernels/sum_of_squares.h"

namespace trestle {
namespace {

// What LibTorch's fused AdamW takes: fp32 tensors on one CPU or CUDA device, the gradient shaped as the parameter.
bool fusable(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v) {
  for (const at::Tensor* t : {&p, &g, &m, &v})
    if (t->scalar_type() != at::kFloat || t->device() != p.device() || !(t->is_cpu() || t->is_cuda())) return false;
  return g.sizes() == p.sizes();
}

}  // namespace

AdamW::AdamW(std::vector<OptimizedParameter> params, AdamWConfig config) : params_(std::move(params)), config_(config) {
  c10::NoGradGuard no_grad;
  for (const auto& p : params_) {
    // fp32 parameters are their own masters (as in Megatron); others get an fp32 copy.
    master_.push_back(p.param.scalar_type() == at::kFloat ? p.param.detach()
                                                          : p.param.detach().to(at::kFloat, /*non_blocking=*/false,
                                                                                /*copy=*/true));
    exp_avg_.push_back(at::zeros_like(master_.back()));
    exp_avg_sq_.push_back(at::zeros_like(master_.back()));
  }
}

std::vector<at::Tensor>& AdamW::main_grads() {
  std::vector<at::Tensor> grads;
  for (const auto& p : params_) grads.push_back(p.param.grad());
  return main_grads(grads);
}

std::vector<at::Tensor>& AdamW::main_grads(const std::vector<at::Tensor>& grads) {
  c10::NoGradGuard no_grad;
  main_grad_.assign(params_.size(), at::Tensor());
  for (std::size_t i = 0; i < params_.size() && i < grads.size(); ++i) {
    const at::Tensor& grad = grads[i];
    if (grad.defined()) main_grad_[i] = grad.scalar_type() == at::kFloat ? grad : grad.to(at::kFloat);
  }
  return main_grad_;
}

Status AdamW::step(double lr, double weight_decay, double grad_multiplier, std::optional<double> decoupled_lr) {
  c10::NoGradGuard no_grad;
  if (!(grad_multiplier >= 0.0) || !std::isfinite(grad_multiplier))  // 0: an infinite norm clipped, as Megatron does
    return Status::Error("AdamW: gradient multiplier " + std::to_string(grad_multiplier) + " is not finite and >= 0");
  if (main_grad_.size() != params_.size()) return Status::Error("AdamW: step() before main_grads()");
  ++steps_;
  const double bias1 = 1.0 - std::pow(config_.beta1, static_cast<double>(steps_));
  const double bias2 = 1.0 - std::pow(config_.beta2, static_cast<double>(steps_));
  const double bias2_sqrt = std::sqrt(bias2);
  struct FusedGroup {
    std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs;
    void add(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v) {
      params.push_back(p);
      grads.push_back(g);
      exp_avgs.push_back(m);
      exp_avg_sqs.push_back(v);
    }
  };
  // Groups by [decoupled learning rate][weight decay].
  FusedGroup fused[2][2];
  const double group_lr[2] = {lr, decoupled_lr.value_or(lr)};
  for (std::size_t i = 0; i < params_.size(); ++i) {
    at::Tensor g = main_grad_[i];
    if (!g.defined()) continue;
    if (g.sizes() != master_[i].sizes())
      return Status::Error("AdamW: gradient of '" + params_[i].name + "' has another shape than the parameter");
    at::Tensor& p = master_[i];
    const double rate = group_lr[params_[i].decoupled_lr];
    const double decay = params_[i].weight_decay ? weight_decay : 0.0;
    if (fusable(p, g, exp_avg_[i], exp_avg_sq_[i])) {
      fused[params_[i].decoupled_lr][params_[i].weight_decay].add(p, g, exp_avg_[i], exp_avg_sq_[i]);
      continue;
    }
    if (grad_multiplier != 1.0) g = g * grad_multiplier;
    if (decay != 0.0) p.mul_(1.0 - rate * decay);
    exp_avg_[i].lerp_(g, 1.0 - config_.beta1);
    exp_avg_sq_[i].mul_(config_.beta2).addcmul_(g, g, 1.0 - config_.beta2);
    const at::Tensor denom = (exp_avg_sq_[i].sqrt() / bias2_sqrt).add_(config_.eps);
    p.addcdiv_(exp_avg_[i], denom, -rate / bias1);
  }
  // LibTorch's fused AdamW (torch.optim.AdamW(fused=True)'s kernel: one vectorised pass per tensor), per group; it
  // divides each gradient by grad_scale as it reads it.
  for (int decoupled = 0; decoupled < 2; ++decoupled) {
    for (int decays = 0; decays < 2; ++decays) {
      FusedGroup& f = fused[decoupled][decays];
      if (f.params.empty()) continue;
      std::vector<at::Tensor> steps(f.params.size(),
                                    at::full({}, static_cast<double>(steps_), f.params.front().options()));
      std::optional<at::Tensor> grad_scale;  // on the parameters' device
      if (grad_multiplier != 1.0) grad_scale = at::full({}, 1.0 / grad_multiplier, f.params.front().options());
      at::_fused_adamw_(f.params, f.grads, f.exp_avgs, f.exp_avg_sqs, {}, steps, group_lr[decoupled], config_.beta1,
                        config_.beta2, decays ? weight_decay : 0.0, config_.eps, /*amsgrad=*/false,
                        /*maximize=*/false, grad_scale);
    }
  }
  main_grad_.clear();
  masters_to_parameters();
  return OkStatus();
}

void AdamW::masters_to_parameters() {
  c10::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i)
    if (!params_[i].param.is_same(master_[i])) params_[i].param.copy_(master_[i]);
}

void AdamW::parameters_to_masters() {
  c10::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i)
    if (!params_[i].param.is_same(master_[i])) master_[i].copy_(params_[i].param);
}

double global_grad_norm(const std::vector<at::Tensor>& grads, const std::vector<bool>& counted_here,
                        const std::function<double(double)>& all_reduce_sum, bool fused_kernels) {
  c10::NoGradGuard no_grad;
  // Summed where the gradients are and read once: a read per tensor would stall a GPU's queue ~200 times a step.
  at::Tensor squares;
  auto add = [&](const at::Tensor& part) { squares = squares.defined() ? squares + part.to(squares.device()) : part; };
  std::vector<at::Tensor> on_gpu;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined() || !counted_here[i]) continue;
    // Elsewhere Σ x² in double: the same to the last digits however the tensor is split over ranks. (LibTorch's fp32
    // vector norm on the CPU, torch's clip_grad_norm_, drifts by ~4e-5 relative on a 131k-element output layer, and
    // its tp halves drift differently.)
    if (grads[i].is_cuda()) on_gpu.push_back(grads[i]);
    else add(fused_kernels ? kernels::sum_of_squares(grads[i]) : kernels::sum_of_squares_widened(grads[i]));
  }
  // On a GPU: each tensor's fp32 norm in one multi-tensor pass (a tree reduction, ~1e-7 relative, as Megatron's
  // multi_tensor_l2norm), not a double copy of every gradient.
  if (!on_gpu.empty()) add(at::stack(at::_foreach_norm(on_gpu)).to(at::kDouble).square().sum());
  return std::sqrt(all_reduce_sum(squares.defined() ? squares.item<double>() : 0.0));
}

double clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0;
  const double coeff = max_norm / (norm + 1e-6);
  return coeff < 1.0 ? coeff : 1.0;
}

}  // namespace trestle
