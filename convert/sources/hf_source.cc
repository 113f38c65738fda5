// A Hugging Face directory as a canonical source: the bridge plan says which runs of which safetensors tensors make
// each canonical box; reads gather them from the source tensors, each read whole once into a SourceTensorCache.
#include <atomic>
#include <filesystem>
#include <map>
#include <mutex>

#include "convert/bridge/bridge_copy.h"
#include "convert/bridge/hf_side_files.h"
#include "convert/sources/canonical_source.h"
#include "convert/sources/hf_model.h"

namespace trestle {
namespace {

class HfSource final : public CanonicalSource {
 public:
  HfSource(HfModel hf, std::vector<StoredTensor> stored, std::uint64_t cache_budget, const std::string& dir)
      : hf_(std::move(hf)),
        sources_(hf_sources_per_tensor(hf_.plan)),
        cache_(std::move(stored), cache_budget),
        dir_(dir) {
    model_.model = hf_.model;
    model_.experts = hf_.plan.experts;
    model_.side_files = hf_side_files(dir);
    for (std::size_t i = 0; i < hf_.plan.tensors.size(); ++i) {
      index_[hf_.plan.tensors[i].name] = i;
      tensors_.push_back({hf_.plan.tensors[i].name, hf_.dtypes[i], hf_.plan.tensors[i].shape});
    }
    side_files_dir_ = dir;
    side_file_links_ = SideFileLinks::kFollow;
    notes_ = hf_.notes;
  }

  std::string description() const override { return "hf " + dir_; }

  Status read(const std::string& name, const Piece& piece, std::span<std::byte> out) const override {
    const auto it = index_.find(name);
    if (it == index_.end()) return Status::Error(description() + ": no tensor '" + name + "'");
    if (piece.flat) return Status::Error(description() + ": '" + name + "': flat pieces are not read from safetensors");
    const BridgeTensor& t = hf_.plan.tensors[it->second];
    TRESTLE_ASSIGN_OR_RETURN(const auto pinned, cache_.pin(sources_[it->second]));
    TRESTLE_RETURN_IF_ERROR(gather_box(t, piece.box, pinned.views(), tensors_[it->second].dtype, out));
    std::lock_guard lock(mu_);
    bytes_read_ = cache_.bytes_read();
    return OkStatus();
  }

  void expect_reads(std::span<const std::string> names) const override {
    if (reads_expected_.exchange(true)) return;  // the cache reads ahead in one order, set once
    std::vector<std::size_t> order;
    std::vector<int> uses(cache_.tensors().size(), 0);
    std::vector<bool> seen(uses.size(), false);
    for (const auto& name : names) {
      const auto it = index_.find(name);
      if (it == index_.end()) continue;  // read() reports it
      for (const std::size_t i : sources_[it->second]) {
        if (i >= uses.size()) continue;
        ++uses[i];
        if (!seen[i]) {
          seen[i] = true;
          order.push_back(i);
        }
      }
    }
    cache_.read_ahead(std::move(order), uses, cache_.read_ahead_bytes(), SourceTensorCache::kReadAheadThreads);
  }

  void set_norms(NormNaming norms) { model_.norms = norms; }

 private:
  HfModel hf_;
  std::vector<std::vector<std::size_t>> sources_;  // per canonical tensor, the hf tensors it is gathered from
  mutable SourceTensorCache cache_;
  mutable std::atomic<bool> reads_expected_{false};
  mutable std::mutex mu_;  // bytes_read_
  std::map<std::string, std::size_t> index_;
  std::string dir_;
};

}  // namespace

Result<std::unique_ptr<CanonicalSource>> open_hf_source(const std::string& path, const SourceOptions& options) {
  TRESTLE_ASSIGN_OR_RETURN(HfModel hf, open_hf_model(path, options.hf_norms, options.hf_config));
  TRESTLE_ASSIGN_OR_RETURN(auto stored, stored_hf_tensors(hf.files, hf.plan.hf, hf.quantization));
  const std::uint64_t budget = default_cache_budget(stored);
  auto source = std::make_unique<HfSource>(std::move(hf), std::move(stored), budget, path);
  source->set_norms(options.hf_norms);
  return std::unique_ptr<CanonicalSource>(std::move(source));
}

}  // namespace trestle
