// Checkpoint collectives over a c10d process group backend (Gloo on CPU, NCCL on GPU): all_gather of byte strings is
// an all_gather of their lengths, then of the bytes padded to the longest, as uint8 tensors on the backend's device.
#pragma once

#include <chrono>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <vector>

#include "ckpt/collective.h"
#include "parallel/store_collective.h"

namespace trestle::parallel {

class ProcessGroupCollective final : public Collective {
 public:
  // `device` is where the exchanged tensors live: CPU for Gloo, the rank's GPU for NCCL.
  explicit ProcessGroupCollective(c10::intrusive_ptr<c10d::Backend> backend, c10::Device device = c10::kCPU);
  ~ProcessGroupCollective() override;
  int rank() const override;
  int size() const override;
  Result<std::vector<std::string>> all_gather(const std::string& bytes) override;
  const c10::intrusive_ptr<c10d::Backend>& backend() const { return backend_; }

 private:
  c10::intrusive_ptr<c10d::Backend> backend_;
  c10::Device device_;
};

// A Gloo process group (TCP transport on this host's default interface) over the rendezvous store.
Result<c10::intrusive_ptr<c10d::Backend>> make_gloo_backend(
    const Rendezvous& rendezvous, std::chrono::milliseconds timeout = std::chrono::minutes(5));

}  // namespace trestle::parallel
