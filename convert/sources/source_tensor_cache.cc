#include "convert/sources/source_tensor_cache.h"

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

#include "convert/formats/safetensors/fp8_blocks.h"
#include "convert/formats/safetensors/mxfp4.h"

namespace trestle {
namespace {

// A recycled buffer fits a request when it is large enough without wasting more than about half of itself.
bool fits(const AlignedBuffer& buffer, std::uint64_t bytes) {
  return buffer.size() >= bytes && buffer.size() <= 2 * bytes + kIoAlignment * 16;
}

}  // namespace

std::uint64_t default_cache_budget(const std::vector<StoredTensor>& tensors) {
  std::uint64_t largest = 0;
  for (const auto& t : tensors) largest = std::max(largest, t.loaded_nbytes());
  return std::max(largest, std::uint64_t{64} << 20);
}

SourceTensorCache::Pin::Pin(SourceTensorCache* cache) : cache_(cache) {
  std::lock_guard lock(cache->mu_);
  if (cache->view_tables_.empty()) {
    views_.resize(cache->tensors_.size());
  } else {
    views_ = std::move(cache->view_tables_.back());
    cache->view_tables_.pop_back();
  }
}

SourceTensorCache::Pin::Pin(Pin&& other) noexcept
    : cache_(other.cache_), pinned_(std::move(other.pinned_)), views_(std::move(other.views_)) {
  other.pinned_.clear();
  other.views_.clear();
}

SourceTensorCache::Pin::~Pin() {
  if (views_.empty()) return;  // moved from
  for (const std::size_t i : pinned_) views_[i] = {};
  cache_->unpin(pinned_, std::move(views_));
}

SourceTensorCache::SourceTensorCache(std::vector<StoredTensor> tensors, std::uint64_t budget_bytes)
    : tensors_(std::move(tensors)), budget_(budget_bytes), entries_(tensors_.size()) {}

SourceTensorCache::~SourceTensorCache() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  work_.notify_all();
  for (auto& t : read_ahead_threads_) t.join();
}

void SourceTensorCache::read_ahead(std::vector<std::size_t> order, const std::vector<int>& uses,
                                   std::uint64_t lookahead_bytes, int threads) {
  std::lock_guard lock(mu_);
  for (std::size_t i = 0; i < entries_.size() && i < uses.size(); ++i) entries_[i].wanted = std::max(uses[i], 0);
  place_.assign(tensors_.size(), order.size());
  for (std::size_t k = order.size(); k-- > 0;)
    if (order[k] < tensors_.size()) place_[order[k]] = k;  // first place
  order_ = std::move(order);
  lookahead_ = lookahead_bytes;
  std::vector<std::size_t> by_place(tensors_.size());
  for (std::size_t i = 0; i < by_place.size(); ++i) by_place[i] = i;
  std::sort(by_place.begin(), by_place.end(), [&](std::size_t a, std::size_t b) {
    return std::tie(tensors_[a].file, tensors_[a].offset) < std::tie(tensors_[b].file, tensors_[b].offset);
  });
  next_in_file_.assign(tensors_.size(), std::string::npos);
  auto plain = [&](const StoredTensor& t) { return !t.fp8 && !t.mxfp4; };
  for (std::size_t k = 0; k + 1 < by_place.size(); ++k) {
    const StoredTensor &a = tensors_[by_place[k]], &b = tensors_[by_place[k + 1]];
    if (plain(a) && plain(b) && a.file == b.file && a.offset + a.nbytes() == b.offset && a.nbytes() > 0)
      next_in_file_[by_place[k]] = by_place[k + 1];
  }
  for (int t = 0; t < threads; ++t) read_ahead_threads_.emplace_back([this] { read_ahead_loop(); });
}

std::uint64_t SourceTensorCache::buffer_bytes(std::size_t index) const {
  const StoredTensor& t = tensors_[index];
  const std::size_t lead = t.fp8 || t.mxfp4 ? 0 : static_cast<std::size_t>(t.offset % kIoAlignment);
  return std::max<std::uint64_t>(align_up(lead + t.loaded_nbytes(), kIoAlignment), kIoAlignment);
}

void SourceTensorCache::queue_read_ahead(std::span<const std::size_t> pinned) {
  if (order_.empty()) return;
  std::size_t from = order_.size();
  for (const std::size_t i : pinned)
    if (place_[i] < order_.size()) from = from == order_.size() ? place_[i] : std::max(from, place_[i]);
  if (from == order_.size()) return;
  std::uint64_t ahead = 0;
  bool queued = false;
  for (std::size_t k = from + 1; k < order_.size(); ++k) {
    ahead += tensors_[order_[k]].loaded_nbytes();
    if (ahead > lookahead_) break;
    if (k < queued_until_) continue;
    queued_until_ = k + 1;
    Entry& e = entries_[order_[k]];
    if (e.state == State::kAbsent && !e.queued) {
      e.queued = true;
      queued_.push_back(order_[k]);
      queued = true;
    }
  }
  if (queued) work_.notify_all();
}

std::vector<std::pair<std::size_t, AlignedBuffer>> SourceTensorCache::read_ahead_group(
    std::size_t first, std::unique_lock<std::mutex>& lock) {
  std::vector<std::pair<std::size_t, AlignedBuffer>> group;
  std::uint64_t bytes = 0;
  for (std::size_t i = first; i != std::string::npos; i = next_in_file_[i]) {
    Entry& e = entries_[i];
    if (e.state != State::kAbsent || (i != first && !e.queued)) break;
    if (i != first && bytes + tensors_[i].nbytes() > kReadAheadGroupBytes) break;
    std::optional<AlignedBuffer> buffer = take_buffer(buffer_bytes(i), lock, /*for_read_ahead=*/true);
    if (!buffer) break;
    if (e.state != State::kAbsent) {  // a pin took it while the buffer was made
      free_.push_back(std::move(*buffer));
      break;
    }
    e.state = State::kLoading;
    e.queued = false;
    bytes += tensors_[i].nbytes();
    group.emplace_back(i, std::move(*buffer));
  }
  return group;
}

Status SourceTensorCache::load_group(std::vector<std::pair<std::size_t, AlignedBuffer>>& group,
                                     AlignedBuffer& staging) {
  for (auto& [i, buffer] : group) entries_[i].buffer = std::move(buffer);
  if (group.size() == 1) return load(group[0].first, entries_[group[0].first]);
  const StoredTensor& head = tensors_[group.front().first];
  const StoredTensor& tail = tensors_[group.back().first];
  TRESTLE_ASSIGN_OR_RETURN(const OpenedFile file, files_.get(head.file));
  TRESTLE_ASSIGN_OR_RETURN(const std::size_t lead,
                           read_file_range(file, head.file, head.offset, tail.offset + tail.nbytes() - head.offset,
                                           staging, "tensors '" + head.name + "' to '" + tail.name + "'"));
  for (const auto& member : group) {
    const std::size_t i = member.first;
    Entry& entry = entries_[i];
    entry.lead = 0;
    std::memcpy(entry.buffer.data(), staging.data() + lead + (tensors_[i].offset - head.offset), tensors_[i].nbytes());
  }
  return OkStatus();
}

void SourceTensorCache::read_ahead_loop() {
  AlignedBuffer staging;  // a group's bytes, read at once
  std::unique_lock lock(mu_);
  while (true) {
    work_.wait(lock, [&] { return stopping_ || !queued_.empty(); });
    if (stopping_) return;
    ++read_ahead_busy_;
    read_ahead_next(lock, staging);
    if (--read_ahead_busy_ == 0 && queued_.empty()) read_ahead_idle_.notify_all();
  }
}

void SourceTensorCache::read_ahead_next(std::unique_lock<std::mutex>& lock, AlignedBuffer& staging) {
  const std::size_t first = queued_.front();
  queued_.pop_front();
  entries_[first].queued = false;
  if (entries_[first].state != State::kAbsent) return;
  auto group = read_ahead_group(first, lock);
  if (group.empty()) return;
  lock.unlock();
  const Status status = load_group(group, staging);
  lock.lock();
  for (const auto& member : group) {
    const std::size_t i = member.first;
    Entry& entry = entries_[i];
    if (status.ok()) {
      entry.state = State::kReady;
      entry.last_use = ++clock_;
      bytes_read_ += tensors_[i].nbytes();
    } else {
      free_.push_back(std::move(entry.buffer));
      entry.state = State::kAbsent;
    }
  }
  loaded_.notify_all();
}

void SourceTensorCache::wait_read_ahead_idle() const {
  std::unique_lock lock(mu_);
  read_ahead_idle_.wait(lock, [&] { return stopping_ || (queued_.empty() && read_ahead_busy_ == 0); });
}

std::uint64_t SourceTensorCache::bytes_read() const {
  std::lock_guard lock(mu_);
  return bytes_read_;
}

std::uint64_t SourceTensorCache::peak_held_bytes() const {
  std::lock_guard lock(mu_);
  return peak_held_;
}

Result<SourceTensorCache::Pin> SourceTensorCache::pin(std::span<const std::size_t> indices) {
  std::vector<std::size_t> wanted(indices.begin(), indices.end());
  std::sort(wanted.begin(), wanted.end());
  wanted.erase(std::unique(wanted.begin(), wanted.end()), wanted.end());
  if (!wanted.empty() && wanted.back() >= tensors_.size())
    return Status::Error("source tensor " + std::to_string(wanted.back()) + " asked for; there are " +
                         std::to_string(tensors_.size()));
  {
    std::lock_guard lock(mu_);
    queue_read_ahead(wanted);
  }
  Pin pin(this);
  for (const std::size_t i : wanted) {
    const StoredTensor& t = tensors_[i];
    std::unique_lock lock(mu_);
    Entry& entry = entries_[i];
    loaded_.wait(lock, [&] { return entry.state != State::kLoading; });
    ++entry.pins;
    if (entry.wanted > 0) --entry.wanted;
    pin.pinned_.push_back(i);
    if (entry.state == State::kAbsent) {
      entry.state = State::kLoading;
      AlignedBuffer buffer = *take_buffer(buffer_bytes(i), lock);
      lock.unlock();
      entry.buffer = std::move(buffer);
      const Status status = load(i, entry);
      lock.lock();
      if (!status.ok()) {
        free_.push_back(std::move(entry.buffer));
        entry.state = State::kAbsent;
        loaded_.notify_all();
        return status;
      }
      entry.state = State::kReady;
      bytes_read_ += t.nbytes();
      loaded_.notify_all();
    }
    entry.last_use = ++clock_;
    pin.views_[i] = {t.loaded_dtype(), t.shape, entry.buffer.data() + entry.lead};
  }
  return pin;
}

void SourceTensorCache::unpin(std::span<const std::size_t> indices, std::vector<ConstTensorView> views) {
  std::lock_guard lock(mu_);
  for (const std::size_t i : indices) --entries_[i].pins;
  view_tables_.push_back(std::move(views));
}

SourceTensorCache::Entry* SourceTensorCache::eviction_victim(bool even_wanted) {
  Entry* victim = nullptr;
  for (auto& e : entries_)
    if (e.state == State::kReady && e.pins == 0 && e.wanted == 0 && (!victim || e.last_use < victim->last_use))
      victim = &e;
  if (victim || !even_wanted) return victim;
  std::size_t furthest = 0;
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    Entry& e = entries_[i];
    const std::size_t place = place_.empty() ? 0 : place_[i];
    if (e.state == State::kReady && e.pins == 0 && (!victim || place > furthest)) {
      victim = &e;
      furthest = place;
    }
  }
  return victim;
}

std::optional<AlignedBuffer> SourceTensorCache::take_buffer(std::uint64_t bytes, std::unique_lock<std::mutex>& lock,
                                                            bool for_read_ahead) {
  auto best_free = [&] {
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (fits(*it, bytes) && (best == free_.end() || it->size() < best->size())) best = it;
    return best;
  };
  auto take = [&](std::vector<AlignedBuffer>::iterator it) {
    AlignedBuffer out = std::move(*it);
    free_.erase(it);
    return out;
  };
  if (auto it = best_free(); it != free_.end()) return take(it);
  // Over budget: evict unpinned tensors (for a read-ahead only those no longer wanted), reusing a freed buffer as soon
  // as one fits.
  while (held_ + bytes > budget_) {
    Entry* victim = eviction_victim(/*even_wanted=*/!for_read_ahead);
    if (!victim) break;
    victim->state = State::kAbsent;
    free_.push_back(std::move(victim->buffer));
    if (auto it = best_free(); it != free_.end()) return take(it);
  }
  // Still nothing to reuse: give back free buffers until the new one fits the budget (or none are left).
  std::vector<AlignedBuffer> dropped;
  std::sort(free_.begin(), free_.end(), [](const auto& a, const auto& b) { return a.size() < b.size(); });
  while (held_ + bytes > budget_ && !free_.empty()) {
    held_ -= free_.back().size();
    dropped.push_back(std::move(free_.back()));
    free_.pop_back();
  }
  if (for_read_ahead && held_ + bytes > budget_) return std::nullopt;
  held_ += bytes;
  peak_held_ = std::max(peak_held_, held_);
  lock.unlock();
  dropped.clear();
  AlignedBuffer buffer(static_cast<std::size_t>(bytes));
  lock.lock();
  return buffer;
}

Status SourceTensorCache::load(std::size_t index, Entry& entry) {
  const StoredTensor& t = tensors_[index];
  if (t.fp8) return load_fp8(t, entry);
  if (t.mxfp4) return load_mxfp4(t, entry);
  TRESTLE_ASSIGN_OR_RETURN(const OpenedFile file, files_.get(t.file));
  TRESTLE_ASSIGN_OR_RETURN(const std::size_t lead, read_file_range(file, t.file, t.offset, t.nbytes(), entry.buffer,
                                                                   "tensor '" + t.name + "'"));
  entry.lead = lead;
  return OkStatus();
}

Result<SourceTensorCache::Packed> SourceTensorCache::read_packed(const StoredTensor& t, const std::string& scale_name,
                                                                   const std::string& scale_file,
                                                                   std::uint64_t scale_offset, std::uint64_t scale_bytes) {
  Packed p;
  TRESTLE_ASSIGN_OR_RETURN(const OpenedFile file, files_.get(t.file));
  TRESTLE_ASSIGN_OR_RETURN(const std::size_t lead,
                           read_file_range(file, t.file, t.offset, t.nbytes(), p.data_buffer, "tensor '" + t.name + "'"));
  TRESTLE_ASSIGN_OR_RETURN(const OpenedFile scales, files_.get(scale_file));
  TRESTLE_ASSIGN_OR_RETURN(const std::size_t scale_lead,
                           read_file_range(scales, scale_file, scale_offset, scale_bytes, p.scale_buffer,
                                           "tensor '" + scale_name + "'"));
  p.data = std::span<const std::byte>(p.data_buffer.data() + lead, t.nbytes());
  p.scales = std::span<const std::byte>(p.scale_buffer.data() + scale_lead, scale_bytes);
  return p;
}

Status SourceTensorCache::load_fp8(const StoredTensor& t, Entry& entry) {
  const Fp8BlockScale& scale = *t.fp8;
  TRESTLE_ASSIGN_OR_RETURN(const Packed p, read_packed(t, scale.name, scale.file, scale.offset, scale.nbytes()));
  std::vector<float> factors(static_cast<std::size_t>(numel(scale.shape)));
  std::memcpy(factors.data(), p.scales.data(), scale.nbytes());
  const Status status = dequantize_fp8_blocks(p.data, t.shape, factors, scale.block_rows, scale.block_cols,
                                              entry.buffer.first(t.loaded_nbytes()));
  if (!status.ok()) return Status::Error("tensor '" + t.name + "': " + status.message());
  entry.lead = 0;
  return OkStatus();
}

Status SourceTensorCache::load_mxfp4(const StoredTensor& t, Entry& entry) {
  const Mxfp4Scales& scale = *t.mxfp4;
  TRESTLE_ASSIGN_OR_RETURN(const Packed p, read_packed(t, scale.name, scale.file, scale.offset, scale.nbytes()));
  const Status status =
      dequantize_mxfp4_transposed(p.data, scale.blocks_shape, p.scales, entry.buffer.first(t.loaded_nbytes()));
  if (!status.ok()) return Status::Error("tensor '" + t.name + "': " + status.message());
  entry.lead = 0;
  return OkStatus();
}

}  // namespace trestle
