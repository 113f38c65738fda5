#include "parallel/store_collective.h"

#include <chrono>
#include <future>
#include <memory>
#include <thread>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <utility>

#include "parallel/launch_environment.h"
#include "parallel/seconds_text.h"

namespace trestle::parallel {
namespace {

std::string key(const std::string& prefix, std::uint64_t round, int rank) {
  return prefix + "/" + std::to_string(round) + "/" + std::to_string(rank);
}

// c10's errors carry a C++ backtrace in what(); a user's message needs only the first line.
std::string message_without_backtrace(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) return error->what_without_backtrace();
  return e.what();
}

// The client of a c10d TCPStore at host:port. c10d's constructor connects (retrying for the timeout), then pings the
// server and waits for the answer with no timeout: a port held by something other than a c10d store (a stale process,
// an HTTP server) hung every client forever. The constructor runs on a thread of its own, given the timeout and a
// grace; a stuck one is left behind (the process ends with the error).
Result<c10::intrusive_ptr<c10d::TCPStore>> connect_store_client(const std::string& host,
                                                                const c10d::TCPStoreOptions& options) {
  using Outcome = std::pair<c10::intrusive_ptr<c10d::TCPStore>, std::string>;
  auto promise = std::make_shared<std::promise<Outcome>>();
  std::future<Outcome> future = promise->get_future();
  std::thread([promise, host, options] {
    try {
      promise->set_value({c10::make_intrusive<c10d::TCPStore>(host, options), ""});
    } catch (const std::exception& e) {
      promise->set_value({{}, message_without_backtrace(e)});
    }
  }).detach();
  const auto grace = std::chrono::seconds(10);
  if (future.wait_for(options.timeout + grace) != std::future_status::ready)
    return Status::Error("connected, but no c10d store answered within " +
                         std::to_string(std::chrono::duration_cast<std::chrono::seconds>(options.timeout).count()) +
                         " s: something other than the job's store listens on the port (another program, or a "
                         "stale job)");
  Outcome outcome = future.get();
  if (!outcome.second.empty()) return Status::Error(outcome.second);
  return std::move(outcome.first);
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
  auto launch = read_launch_environment();
  if (!launch.ok()) return launch.status();
  Rendezvous out;
  out.rank = launch->rank;
  out.world_size = launch->world_size;
  out.local_rank = launch->local_rank;
  out.node = launch->node;
  if (out.world_size == 1) {
    out.store = c10::make_intrusive<c10d::HashStore>();
    return out;
  }
  out.store_address = launch->master_addr + ":" + std::to_string(launch->master_port);
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(launch->master_port);
  // Under torchrun's c10d rendezvous its agent serves the store (torch's _create_c10d_store makes every rank a
  // client then); otherwise rank 0 does.
  options.isServer = out.rank == 0 && !launch->store_served_by_agent;
  out.store_served_by_rank_0 = !launch->store_served_by_agent;
  // Under `trestle train --nproc-per-node`, rank 0 serves on the socket its launcher bound.
  if (options.isServer) options.masterListenFd = launch->store_listen_fd;
  options.numWorkers = static_cast<std::size_t>(out.world_size);
  options.timeout = timeout;
  // Rank 0 does not wait here for the others: ParallelState::create does, and names the ranks that never arrive.
  options.waitWorkers = false;
  auto failed = [&](const std::string& why) {
    return Status::Error("rank " + std::to_string(out.rank) + " (" + launch->launcher + "): cannot " +
                         (options.isServer ? "serve" : "reach") + " the c10d TCPStore at " + out.store_address + ": " +
                         why);
  };
  if (options.isServer) {
    try {
      out.store = c10::make_intrusive<c10d::TCPStore>(launch->master_addr, options);
    } catch (const std::exception& e) {
      return failed(message_without_backtrace(e));
    }
  } else {
    auto client = connect_store_client(launch->master_addr, options);
    if (!client.ok()) return failed(client.status().message());
    out.store = std::move(*client);
  }
  if (!launch->store_prefix.empty())
    out.store = c10::make_intrusive<c10d::PrefixStore>(launch->store_prefix, out.store);
  return out;
}

Status leave_rendezvous(const Rendezvous& rendezvous, bool succeeded, std::chrono::milliseconds timeout) {
  if (rendezvous.world_size == 1 || !rendezvous.store_served_by_rank_0) return OkStatus();
  const auto left_key = [](int r) { return "trestle/left/" + std::to_string(r); };
  try {
    if (rendezvous.rank != 0) rendezvous.store->set(left_key(rendezvous.rank), std::vector<std::uint8_t>{1});
    else if (succeeded) {
      std::vector<std::string> keys;
      for (int r = 1; r < rendezvous.world_size; ++r) keys.push_back(left_key(r));
      try {
        rendezvous.store->wait(keys, timeout);
      } catch (const c10::Error&) {
        std::string missing;
        for (int r = 1; r < rendezvous.world_size; ++r)
          if (!rendezvous.store->check({left_key(r)})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        if (missing.empty()) throw;
        return Status::Error("rank 0: its work is done, but rank(s) " + missing + " never left the job's c10d store " +
                             "(which rank 0 serves) within " + seconds_text(timeout) +
                             ": they died or hung after the last collective");
      }
    }
  } catch (const std::exception& e) {
    return Status::Error("rank " + std::to_string(rendezvous.rank) +
                         ": leaving the job's c10d store: " + message_without_backtrace(e));
  }
  return OkStatus();
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
