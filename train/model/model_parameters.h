// A rank's parameters: every canonical Megatron tensor this rank holds (parallel/layout's canonical_tensors), each as
// exactly this rank's tensor-parallel piece, all viewed out of one contiguous allocation. A piece is its tp_boxes
// stacked along dim 0 (gated fc1: [gate_r; up_r]); a vocabulary piece has padded_vocab / tp rows, of which the rows
// past the real vocabulary are padding (zero, stored nowhere). load_model_pieces fills them through the load planner.
#pragma once

#include <ATen/Tensor.h>

#include <string>
#include <vector>

#include "ckpt/box.h"
#include "ckpt/load.h"
#include "ckpt/status.h"
#include "parallel/layout/model_spec.h"

namespace trestle::train {

struct ModelParameter {
  CanonicalTensor canonical;  // name, global shape, split, layer
  std::vector<Box> boxes;     // this rank's boxes of the canonical tensor, in the order they are stacked in `tensor`
  at::Tensor tensor;          // the piece (a leaf that requires grad)
  // Replicated over tp but fed only part of the data on each rank (norms under sequence parallelism, q/k norms
  // over this rank's heads): its gradient is summed over the tensor-parallel group after backward.
  bool grad_summed_over_tp = false;
  const std::string& name() const { return canonical.name; }
};

class ModelParameters {
 public:
  // Allocates (zero-filled) this rank's pieces of `tensors` on `options`' device and dtype. Errors name the tensor
  // whose split does not divide.
  static Result<ModelParameters> allocate(const std::vector<CanonicalTensor>& tensors, int tp, int tp_rank,
                                          std::int64_t padded_vocab_size, bool sequence_parallel,
                                          const at::TensorOptions& options);

  std::vector<ModelParameter>& all() { return parameters_; }
  const std::vector<ModelParameter>& all() const { return parameters_; }
  // The piece named `name`; an undefined tensor when this rank holds no such parameter.
  at::Tensor get(const std::string& name) const;
  const at::Tensor& storage() const { return storage_; }  // every piece, contiguous

 private:
  at::Tensor storage_;
  std::vector<ModelParameter> parameters_;
};

// Loads every piece from `reader` (any saved layout: the planner reads only the overlapping blocks). A stored dtype
// other than the parameters' is converted. Errors name the tensor and the checkpoint.
Status load_model_pieces(ModelParameters& parameters, const CheckpointReader& reader);

}  // namespace trestle::train
