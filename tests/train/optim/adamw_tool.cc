// Test entry point: AdamW on parameters and gradients drawn from torch's generator with SEED, for the interop test
// that runs torch.optim.AdamW on the same draws. Prints the fp32 masters after STEPS steps as JSON lists, and the
// gradient norm of each step. usage: adamw_tool SEED STEPS DTYPE(f32|bf16) LR WEIGHT_DECAY CLIP
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "train/optim/adamw.h"

int main(int argc, char** argv) {
  if (argc != 7) return 2;
  torch::manual_seed(std::atoll(argv[1]));
  const int steps = std::atoi(argv[2]);
  const auto dtype = std::string(argv[3]) == "bf16" ? at::kBFloat16 : at::kFloat;
  const double lr = std::atof(argv[4]), wd = std::atof(argv[5]), clip = std::atof(argv[6]);
  const std::vector<std::vector<std::int64_t>> shapes = {{4, 5}, {7}, {3, 2, 2}};
  std::vector<trestle::OptimizedParameter> params;
  std::vector<at::Tensor> tensors;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    at::Tensor p = torch::randn(shapes[i]).to(dtype).set_requires_grad(true);
    tensors.push_back(p);
    params.push_back({"p" + std::to_string(i), p, shapes[i].size() > 1});
  }
  trestle::AdamW adam(params, {0.9, 0.95, 1e-8});
  std::printf("{\"norms\": [");
  for (int s = 0; s < steps; ++s) {
    for (auto& p : tensors) p.mutable_grad() = torch::randn(p.sizes()).to(dtype);
    const double norm = trestle::global_grad_norm(adam.main_grads(), std::vector<bool>(tensors.size(), true),
                                                  [](double x) { return x; });
    std::printf("%s%.17g", s ? ", " : "", norm);
    const double step_lr = lr * (s + 1) / steps;
    if (!adam.step(step_lr, wd, trestle::clip_coefficient(norm, clip)).ok()) return 1;
  }
  std::printf("], \"params\": [");
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor m = adam.fp32_param(i).contiguous();
    std::printf("%s[", i ? ", " : "");
    for (std::int64_t k = 0; k < m.numel(); ++k) std::printf("%s%.9g", k ? ", " : "", m.data_ptr<float>()[k]);
    std::printf("]");
  }
  std::printf("]}\n");
  return 0;
}
