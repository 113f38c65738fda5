#include "train/model/model_parameters.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "ckpt/torch_tensor.h"
#include "parallel/layout/tp_split.h"

namespace trestle::train {
namespace {

std::vector<std::int64_t> piece_shape(const CanonicalTensor& t, const std::vector<Box>& boxes,
                                      std::int64_t padded_vocab_size, int tp) {
  std::vector<std::int64_t> shape(t.shape.begin(), t.shape.end());
  if (shape.empty()) return shape;
  if (t.split == TpSplit::kVocab) {
    shape[0] = padded_vocab_size / tp;
    return shape;
  }
  shape[0] = 0;
  for (const Box& b : boxes) shape[0] += b.shape[0];
  if (t.split == TpSplit::kRow) shape[1] = boxes.front().shape[1];
  return shape;
}

bool summed_over_tp(const CanonicalTensor& t, bool sequence_parallel) {
  if (t.split != TpSplit::kReplicated) return false;
  const bool qk_norm = t.name.ends_with("q_layernorm.weight") || t.name.ends_with("k_layernorm.weight");
  // A routed expert's fc2 bias joins the output on one tensor-parallel rank only (its partial sums are added up
  // after it): the other ranks' gradients are zero.
  const bool expert_output_bias = t.expert >= 0 && t.name.ends_with(".linear_fc2.bias");
  // Multi-latent attention's latents (down projections replicated under Transformer Engine's names, and their norms)
  // are computed whole on every rank, whose own heads' up projections give each rank part of their gradients.
  // So are their replicated adapters'.
  const bool latent = t.name.ends_with("_down_proj.weight") || t.name.ends_with("_up_proj.layer_norm_weight") ||
                      t.name.ends_with("kv_layernorm.weight") ||
                      t.name.find("_down_proj.adapter.") != std::string::npos;
  // LoRA on an expert's or the shared expert's fc2: B is replicated and fed this rank's partial sum (lora.h).
  const bool partial_adapter = t.name.ends_with(".linear_fc2.adapter.linear_out.weight") &&
                               (t.expert >= 0 || t.name.find(".shared_experts.") != std::string::npos);
  // Gated DeltaNet's gated norm: one weight over every head's values, each rank normalising its own heads.
  const bool gated_norm = t.name.ends_with(".out_norm.weight");
  return qk_norm || gated_norm || expert_output_bias || latent || partial_adapter || sequence_parallel;
}

}  // namespace

Result<ModelParameters> ModelParameters::allocate(const std::vector<CanonicalTensor>& tensors,
                                                  const TensorParallelPlace& place, std::int64_t padded_vocab_size,
                                                  bool sequence_parallel, const at::TensorOptions& options,
                                                  const std::function<bool(const CanonicalTensor&)>& held) {
  ModelParameters p;
  std::vector<std::vector<std::int64_t>> shapes;
  std::int64_t total = 0;
  for (std::size_t index = 0; index < tensors.size(); ++index) {
    const CanonicalTensor& t = tensors[index];
    if (held && !held(t)) continue;
    const bool expert = t.expert >= 0 && place.expert_size > 0;
    const int tp = expert ? place.expert_size : place.size;
    auto boxes = tp_boxes(t.split, t.shape, tp, expert ? place.expert_rank : place.rank, padded_vocab_size);
    if (!boxes.ok()) return Status::Error(t.name + ": " + boxes.status().message());
    shapes.push_back(piece_shape(t, *boxes, padded_vocab_size, tp));
    total += c10::multiply_integers(shapes.back());
    p.parameters_.push_back({t, std::move(*boxes), at::Tensor(), summed_over_tp(t, sequence_parallel), index});
  }
  p.storage_ = at::zeros({total}, options);
  std::int64_t offset = 0;
  for (std::size_t i = 0; i < p.parameters_.size(); ++i) {
    const std::int64_t n = c10::multiply_integers(shapes[i]);
    p.parameters_[i].tensor = p.storage_.narrow(0, offset, n).view(shapes[i]).detach().requires_grad_(true);
    offset += n;
  }
  return p;
}

at::Tensor ModelParameters::get(const std::string& name) const {
  for (const auto& p : parameters_)
    if (p.name() == name) return p.tensor;
  return at::Tensor();
}

Status load_stacked_pieces(const CheckpointReader& reader, const std::vector<StackedPieceTarget>& targets) {
  // Each box lands in rows [row, row + box rows) of its target; boxes whose stored dtype differs (or whose target is
  // not in CPU memory) are read into a CPU staging tensor of the stored dtype and converted after the load.
  struct Conversion {
    at::Tensor staging;
    at::Tensor destination;
  };
  std::vector<LoadRequest> requests;
  std::vector<Conversion> conversions;
  for (const auto& t : targets) {
    const auto entry = reader.manifest().tensors.find(t.name);
    if (entry == reader.manifest().tensors.end())
      return Status::Error(reader.directory() + ": the checkpoint has no tensor " + t.name);
    const at::ScalarType stored = to_torch_dtype(entry->second.dtype);
    std::int64_t row = 0;
    for (const Box& box : *t.boxes) {
      at::Tensor target = t.tensor.dim() == 0 ? t.tensor.detach() : t.tensor.detach().narrow(0, row, box.shape[0]);
      row += t.tensor.dim() == 0 ? 0 : box.shape[0];
      at::Tensor destination = target;
      if (stored != target.scalar_type() || !target.is_cpu() || !target.is_contiguous()) {
        destination = at::empty(target.sizes(), at::TensorOptions().dtype(stored));
        conversions.push_back({destination, target});
      }
      requests.push_back({t.name, Piece{box, std::nullopt}, static_cast<std::byte*>(destination.data_ptr())});
    }
  }
  TRESTLE_RETURN_IF_ERROR(reader.load(requests));
  at::NoGradGuard no_grad;
  for (auto& c : conversions) c.destination.copy_(c.staging);
  return OkStatus();
}

Status load_model_pieces(ModelParameters& parameters, const CheckpointReader& reader) {
  std::vector<StackedPieceTarget> targets;
  for (auto& p : parameters.all()) {
    // The planner reads any box within a stored tensor: one stored larger than the model's would be cut to fit.
    const auto stored = reader.manifest().tensors.find(p.name());
    if (stored != reader.manifest().tensors.end() && stored->second.global_shape != p.canonical.shape)
      return Status::Error(reader.directory() + ": tensor " + p.name() + " has the global shape " +
                           to_string(stored->second.global_shape) + "; the model's is " + to_string(p.canonical.shape));
    targets.push_back({p.name(), &p.boxes, p.tensor});
  }
  return load_stacked_pieces(reader, targets);
}

}  // namespace trestle::train
