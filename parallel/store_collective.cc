#include "parallel/store_collective.h"

#include <cstdlib>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace trestle::parallel {
namespace {

std::string key(const std::string& prefix, std::uint64_t round, int rank) {
  return prefix + "/" + std::to_string(round) + "/" + std::to_string(rank);
}

std::optional<std::string> env(const char* name) {
  const char* value = std::getenv(name);
  return value && *value ? std::optional<std::string>(value) : std::nullopt;
}

Result<int> env_int(const char* name, int fallback) {
  const auto text = env(name);
  if (!text) return fallback;
  char* end = nullptr;
  const long value = std::strtol(text->c_str(), &end, 10);
  if (*end != '\0' || value < 0)
    return Status::Error(std::string("environment variable ") + name + "='" + *text + "' is not a number");
  return static_cast<int>(value);
}

}  // namespace

StoreCollective::StoreCollective(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::string prefix)
    : store_(std::move(store)), rank_(rank), size_(size), prefix_(std::move(prefix)) {}

StoreCollective::~StoreCollective() = default;

Result<std::vector<std::string>> StoreCollective::all_gather(const std::string& bytes) {
  const std::uint64_t round = round_++;
  try {
    store_->set(key(prefix_, round, rank_), std::vector<uint8_t>(bytes.begin(), bytes.end()));
    std::vector<std::string> out(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) {
      const auto value = store_->get(key(prefix_, round, r));
      out[static_cast<std::size_t>(r)].assign(value.begin(), value.end());
    }
    // Every rank has read round - 1 before writing this round, so its key of that round can go.
    if (round > 0) store_->deleteKey(key(prefix_, round - 1, rank_));
    return out;
  } catch (const std::exception& e) {
    return Status::Error("rank " + std::to_string(rank_) + ": all_gather over the c10d store failed: " + e.what());
  }
}

Result<Rendezvous> rendezvous_from_environment(std::chrono::milliseconds timeout) {
  Rendezvous out;
  const bool slurm = !env("RANK") && env("SLURM_PROCID");
  TRESTLE_ASSIGN_OR_RETURN(out.rank, env_int(slurm ? "SLURM_PROCID" : "RANK", 0));
  TRESTLE_ASSIGN_OR_RETURN(out.world_size, env_int(slurm ? "SLURM_NTASKS" : "WORLD_SIZE", 1));
  TRESTLE_ASSIGN_OR_RETURN(out.local_rank, env_int(slurm ? "SLURM_LOCALID" : "LOCAL_RANK", 0));
  if (out.rank >= out.world_size)
    return Status::Error("rank " + std::to_string(out.rank) + " is not below the world size " +
                         std::to_string(out.world_size));
  if (out.world_size == 1) {
    out.store = c10::make_intrusive<c10d::HashStore>();
    return out;
  }
  const auto host = env("MASTER_ADDR");
  TRESTLE_ASSIGN_OR_RETURN(const int port, env_int("MASTER_PORT", 0));
  if (!host || port == 0)
    return Status::Error("MASTER_ADDR and MASTER_PORT must be set for a job of " + std::to_string(out.world_size) +
                         " ranks");
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(port);
  options.isServer = out.rank == 0;
  options.numWorkers = static_cast<std::size_t>(out.world_size);
  options.timeout = timeout;
  // Rank 0 does not wait here for the others: ParallelState::create does, and names the ranks that never arrive.
  options.waitWorkers = false;
  try {
    out.store = c10::make_intrusive<c10d::TCPStore>(*host, options);
  } catch (const std::exception& e) {
    return Status::Error("cannot reach the c10d TCPStore at " + *host + ":" + std::to_string(port) + ": " + e.what());
  }
  return out;
}

Result<Rendezvous> rendezvous_with_file(const std::string& path, int rank, int world_size) {
  Rendezvous out;
  out.rank = rank;
  out.world_size = world_size;
  out.local_rank = rank;
  try {
    out.store = c10::make_intrusive<c10d::FileStore>(path, world_size);
  } catch (const std::exception& e) {
    return Status::Error(path + ": cannot open c10d FileStore: " + e.what());
  }
  return out;
}

}  // namespace trestle::parallel
