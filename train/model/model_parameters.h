// A rank's parameters: every canonical Megatron tensor this rank holds (parallel/layout's canonical_tensors), each as
// exactly this rank's tensor-parallel piece, all viewed out of one contiguous allocation. A piece is its tp_boxes
// stacked along dim 0 (gated fc1: [gate_r; up_r]); a vocabulary piece has padded_vocab / tp rows, of which the rows
// past the real vocabulary are padding (zero, stored nowhere). load_model_pieces fills them through the load planner.
#pragma once

#include <ATen/Tensor.h>

#include <functional>
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
  // over this rank's heads): its gradient is summed over the tensor-parallel group after backward (a routed expert's:
  // over the experts' tensor-parallel group).
  bool grad_summed_over_tp = false;
  std::size_t canonical_index = 0;  // its place among all the model's canonical tensors (initialisation seeds by it)
  const std::string& name() const { return canonical.name; }
};

// This rank's place in the tensor-parallel group and in the routed experts' own (Megatron's expert tensor
// parallelism; expert_size 0: the same group).
struct TensorParallelPlace {
  int size = 1;
  int rank = 0;
  int expert_size = 0;
  int expert_rank = 0;
};

class ModelParameters {
 public:
  // Allocates (zero-filled) this rank's pieces of the tensors of `tensors` (all of the model's) that `held` selects
  // (all when empty: no pipeline) on `options`' device and dtype; routed experts' tensors are split over the
  // experts' tensor-parallel group. Errors name the tensor whose split does not divide.
  static Result<ModelParameters> allocate(const std::vector<CanonicalTensor>& tensors, const TensorParallelPlace& tp,
                                          std::int64_t padded_vocab_size, bool sequence_parallel,
                                          const at::TensorOptions& options,
                                          const std::function<bool(const CanonicalTensor&)>& held = {});

  std::vector<ModelParameter>& all() { return parameters_; }
  const std::vector<ModelParameter>& all() const { return parameters_; }
  // The piece named `name`; an undefined tensor when this rank holds no such parameter.
  at::Tensor get(const std::string& name) const;
  const at::Tensor& storage() const { return storage_; }  // every piece, contiguous

 private:
  at::Tensor storage_;
  std::vector<ModelParameter> parameters_;
};

// A tensor of `reader` to read into `tensor`: its `boxes` stacked along dim 0 (the layout of a piece), or the single
// box of a 0-d tensor. Rows of `tensor` past the boxes (vocabulary padding) are left alone.
struct StackedPieceTarget {
  std::string name;
  const std::vector<Box>* boxes = nullptr;
  at::Tensor tensor;  // any device and dtype; a stored dtype other than its own is converted
};
// Loads every target (any saved layout: the planner reads only the overlapping blocks). Errors name the tensor and
// the checkpoint.
Status load_stacked_pieces(const CheckpointReader& reader, const std::vector<StackedPieceTarget>& targets);

// Loads every parameter's piece from `reader` (load_stacked_pieces).
Status load_model_pieces(ModelParameters& parameters, const CheckpointReader& reader);

}  // namespace trestle::train
