#include "parallel/process_group_collective.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>

#include <algorithm>
#include <cstring>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

namespace trestle::parallel {
namespace {

Status group_error(int rank, const char* what, const std::exception& e) {
  return Status::Error("rank " + std::to_string(rank) + ": " + what +
                       " over the c10d process group failed (a peer died or hung): " + e.what());
}

}  // namespace

ProcessGroupCollective::ProcessGroupCollective(c10::intrusive_ptr<c10d::Backend> backend, c10::Device device)
    : backend_(std::move(backend)), device_(device) {}

ProcessGroupCollective::~ProcessGroupCollective() = default;

int ProcessGroupCollective::rank() const { return backend_->getRank(); }
int ProcessGroupCollective::size() const { return backend_->getSize(); }

Result<std::vector<std::string>> ProcessGroupCollective::all_gather(const std::string& bytes) {
  const int world = size();
  try {
    const auto on_device = at::TensorOptions().device(device_);
    std::vector<at::Tensor> length{at::tensor({static_cast<std::int64_t>(bytes.size())}, on_device.dtype(at::kLong))};
    std::vector<std::vector<at::Tensor>> lengths(1);
    for (int r = 0; r < world; ++r) lengths[0].push_back(at::empty({1}, on_device.dtype(at::kLong)));
    backend_->allgather(lengths, length)->wait();
    std::vector<std::int64_t> sizes;
    for (const auto& t : lengths[0]) sizes.push_back(t.cpu().item<std::int64_t>());
    const std::int64_t longest = std::max<std::int64_t>(1, *std::max_element(sizes.begin(), sizes.end()));

    at::Tensor mine = at::empty({longest}, at::TensorOptions().dtype(at::kByte));
    std::memcpy(mine.data_ptr(), bytes.data(), bytes.size());
    std::vector<at::Tensor> input{mine.to(device_)};
    std::vector<std::vector<at::Tensor>> gathered(1);
    for (int r = 0; r < world; ++r) gathered[0].push_back(at::empty({longest}, on_device.dtype(at::kByte)));
    backend_->allgather(gathered, input)->wait();

    std::vector<std::string> out(static_cast<std::size_t>(world));
    for (int r = 0; r < world; ++r) {
      const at::Tensor host = gathered[0][static_cast<std::size_t>(r)].cpu();
      out[static_cast<std::size_t>(r)].assign(static_cast<const char*>(host.data_ptr()),
                                              static_cast<std::size_t>(sizes[static_cast<std::size_t>(r)]));
    }
    return out;
  } catch (const std::exception& e) {
    return group_error(backend_->getRank(), "all_gather", e);
  }
}

Result<c10::intrusive_ptr<c10d::Backend>> make_gloo_backend(const Rendezvous& rendezvous,
                                                            std::chrono::milliseconds timeout) {
  try {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    // The store is shared with other users (the checkpoint's own keys): give the group a namespace of its own.
    auto store = c10::make_intrusive<c10d::PrefixStore>("trestle/gloo", rendezvous.store);
    return c10::intrusive_ptr<c10d::Backend>(
        c10::make_intrusive<c10d::ProcessGroupGloo>(store, rendezvous.rank, rendezvous.world_size, options));
  } catch (const std::exception& e) {
    return Status::Error("rank " + std::to_string(rendezvous.rank) + ": cannot create the Gloo process group of " +
                         std::to_string(rendezvous.world_size) + " ranks: " + e.what());
  }
}

}  // namespace trestle::parallel
