// AdamW as Megatron-Core runs it (decoupled weight decay, bias correction; Apex / Transformer Engine FusedAdam in
// adam_w_mode, which is torch.optim.AdamW's update) with fp32 master weights: parameters may be bf16 / fp16, the
// update happens on an fp32 copy that is cast back after each step (fp32 parameters are their own masters). The
// update runs in LibTorch's fused AdamW kernel (one vectorised pass per tensor). Weight decay applies to the parameters
// marked for it (Megatron: not to biases and norms). The state is named as the converters name it: exp_avg, exp_avg_sq,
// fp32_param per parameter, and the step count.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/status.h"

namespace trestle {

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
};

struct OptimizedParameter {
  std::string name;  // canonical name, for the checkpoint's optimizer.<state>.<name>
  at::Tensor param;  // the model's parameter (any floating dtype); its grad() is read
  bool weight_decay = true;
  bool decoupled_lr = false;  // steps with the decoupled learning rate (Megatron's embedding and output layer)
};

class AdamW {
 public:
  // Creates the fp32 masters (copies of the parameters) and zeroed moments.
  AdamW(std::vector<OptimizedParameter> params, AdamWConfig config);

  // The parameters' gradients as fp32 "main grads" (Megatron keeps gradients in fp32 for bf16 / fp16 parameters):
  // fp32 gradients are used as they are, others cast; undefined where a parameter has no gradient. Clip these.
  std::vector<at::Tensor>& main_grads();
  // The same from gradients kept elsewhere (one per parameter, in order; a gradient buffer's fp32 main grads).
  std::vector<at::Tensor>& main_grads(const std::vector<at::Tensor>& grads);
  // One update from the main grads times grad_multiplier (the clipping coefficient, applied as the update reads each
  // gradient instead of in a pass of its own); a parameter without a gradient is left as it is, as torch does. lr and
  // weight_decay come from the schedule; the parameters marked decoupled_lr take decoupled_lr instead of lr (for the
  // update and the decay, as a torch parameter group of their own), lr when none is given.
  Status step(double lr, double weight_decay, double grad_multiplier = 1.0,
              std::optional<double> decoupled_lr = std::nullopt);
  std::int64_t steps() const { return steps_; }
  void set_steps(std::int64_t steps) { steps_ = steps; }

  const std::vector<OptimizedParameter>& parameters() const { return params_; }
  // Per parameter, in the order given: its fp32 master and moments (checkpointed, restored in place).
  at::Tensor& fp32_param(std::size_t i) { return master_[i]; }
  at::Tensor& exp_avg(std::size_t i) { return exp_avg_[i]; }
  at::Tensor& exp_avg_sq(std::size_t i) { return exp_avg_sq_[i]; }
  // Copies the masters into the parameters (after restoring the masters from a checkpoint).
  void masters_to_parameters();
  // Copies the parameters into the masters (after loading weights without optimizer state).
  void parameters_to_masters();

 private:
  std::vector<OptimizedParameter> params_;
  AdamWConfig config_;
  std::vector<at::Tensor> master_, exp_avg_, exp_avg_sq_, main_grad_;
  std::int64_t steps_ = 0;
};

// The global L2 norm of the gradients, Megatron's way: the squares of this rank's gradients (those of parameters
// duplicated across tensor-parallel ranks counted on one rank only, which the caller marks) summed, then summed over
// ranks by `all_reduce_sum` (the model-parallel group's all-reduce; identity for one rank). Undefined gradients are
// skipped. A CPU gradient's squares are summed in double by the fused kernel (kernels/sum_of_squares.h), or with
// `fused_kernels` false (the trainer's --no-fused-kernels) by ATen's widened chunks.
double global_grad_norm(const std::vector<at::Tensor>& grads, const std::vector<bool>& counted_here,
                        const std::function<double(double)>& all_reduce_sum, bool fused_kernels = true);
// Clipping by global norm (Megatron's and torch's rule): the gradients' multiplier max_norm / (norm + 1e-6) when that
// is below 1, else 1; max_norm <= 0: no clipping. Pass it to AdamW::step.
double clip_coefficient(double norm, double max_norm);

}  // namespace trestle
