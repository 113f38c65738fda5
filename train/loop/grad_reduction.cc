#include "train/loop/grad_reduction.h"

#include <string>

namespace trestle::train {

Result<GradReduction> GradReduction::create(std::size_t params, std::vector<Part> parts) {
  GradReduction r;
  r.grads_.resize(params);
  std::vector<bool> covered(params, false);
  for (Part& part : parts) {
    if (!part.buckets || part.buckets->grads().size() != part.params.size())
      return Status::Error("a gradient reduction part does not match its parameters");
    for (std::size_t i = 0; i < part.params.size(); ++i) {
      const std::size_t p = part.params[i];
      if (p >= params || covered[p])
        return Status::Error("parameter " + std::to_string(p) + " is reduced twice or does not exist");
      covered[p] = true;
      r.grads_[p] = part.buckets->grads()[i];
    }
    for (const OwnedParamRange& owned : part.buckets->owned_ranges())
      r.owned_.push_back(
          {part.params[owned.param], owned.in_param,
           part.buckets->buffer().narrow(0, owned.world.first, owned.in_param.second - owned.in_param.first)});
  }
  for (std::size_t p = 0; p < params; ++p)
    if (!covered[p]) return Status::Error("parameter " + std::to_string(p) + " has no gradient reduction");
  r.parts_ = std::move(parts);
  return r;
}

WeightGradSink* GradReduction::fused_sink(const at::Tensor& param) {
  for (Part& part : parts_)
    if (WeightGradSink* sink = part.buckets->fused_sink(param)) return sink;
  return nullptr;
}

void GradReduction::zero() {
  for (Part& part : parts_) part.buckets->zero();
}

void GradReduction::arm() {
  for (Part& part : parts_) part.buckets->arm();
}

Status GradReduction::finish() {
  Status status = OkStatus();
  for (Part& part : parts_) {
    Status s = part.buckets->finish();
    if (status.ok() && !s.ok()) status = s;
  }
  return status;
}

std::string GradReduction::nonfinite_buckets() const {
  std::string out;
  for (std::size_t p = 0; p < parts_.size(); ++p)
    for (const std::size_t b : parts_[p].buckets->nonfinite_buckets())
      out += (out.empty() ? "" : ", ") + ("bucket " + std::to_string(b)) +
             (parts_.size() > 1 ? " of reduction group " + std::to_string(p) : "");
  return out;
}

Status GradReduction::all_gather_parameters() {
  for (Part& part : parts_) TRESTLE_RETURN_IF_ERROR(part.buckets->all_gather_parameters());
  return OkStatus();
}

}  // namespace trestle::train
