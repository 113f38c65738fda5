#include "ckpt/parallel_copy.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

namespace trestle {
namespace {

constexpr std::size_t kPieceBytes = std::size_t{8} << 20;  // large enough to amortise the hand-off, small to balance

}  // namespace

void parallel_copy(std::span<const CopyRange> ranges, unsigned threads) {
  std::vector<CopyRange> pieces;
  for (const CopyRange& r : ranges)
    for (std::size_t done = 0; done < r.bytes; done += kPieceBytes)
      pieces.push_back({r.source + done, r.destination + done, std::min(kPieceBytes, r.bytes - done)});
  if (pieces.empty()) return;
  const auto helpers = static_cast<unsigned>(std::min<std::size_t>(std::max(1u, threads), pieces.size())) - 1;
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t i; (i = next.fetch_add(1)) < pieces.size();)
      std::memcpy(pieces[i].destination, pieces[i].source, pieces[i].bytes);
  };
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < helpers; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
}

}  // namespace trestle
