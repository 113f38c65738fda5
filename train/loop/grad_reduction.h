// The model's data-parallel gradient reduction as Megatron-Core lays it out: one GradBuckets per group of parameters
// reduced together — the dense parameters over the data-and-context-parallel group, the experts' over the
// expert-data-parallel group (the ranks holding the same experts) — seen as one: per model parameter its gradient, and
// under the distributed optimizer the pieces this rank owns, numbered by model parameter.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/status.h"
#include "train/loop/grad_buckets.h"

namespace trestle::train {

class GradReduction {
 public:
  struct Part {
    std::vector<std::size_t> params;  // indices into the model's parameters, in the order given to `buckets`
    std::unique_ptr<GradBuckets> buckets;
  };
  // `parts` together cover each of the model's `params` parameters exactly once.
  static Result<GradReduction> create(std::size_t params, std::vector<Part> parts);

  // Distributed optimizer: a piece of a parameter this rank owns and its reduced gradient (a view of its buffer).
  struct Owned {
    std::size_t param = 0;
    std::pair<std::int64_t, std::int64_t> in_param;  // the piece's flat range within the parameter
    at::Tensor grad;
  };
  const std::vector<Owned>& owned() const { return owned_; }

  WeightGradSink* fused_sink(const at::Tensor& param);
  void zero();
  void arm();
  Status finish();  // every part's; the first error
  Status all_gather_parameters();
  std::vector<at::Tensor>& grads() { return grads_; }  // per model parameter
  // After finish(): the buckets whose local gradients held a NaN or Inf before their reduction this step, as
  // "bucket B" ("bucket B of reduction group P" with several groups); empty when all were finite.
  std::string nonfinite_buckets() const;
  void check_nonfinite(bool on) {
    for (Part& part : parts_) part.buckets->check_nonfinite(on);
  }
  void poison_next_step_for_test() { parts_.front().buckets->poison_next_step_for_test(); }

 private:
  std::vector<Part> parts_;
  std::vector<at::Tensor> grads_;
  std::vector<Owned> owned_;
};

}  // namespace trestle::train
