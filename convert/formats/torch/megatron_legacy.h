// Megatron's legacy checkpoints: `<root>/latest_checkpointed_iteration.txt` + `iter_{:07d}/` (or `release/`) holding
// `mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt`, each a torch.save of a dict with 'args'
// (argparse.Namespace), 'iteration', 'checkpoint_version', 'model' or virtual-pipeline 'model0', 'model1', ...,
// 'optimizer' and 'rng_state'. Each rank file is presented as a state dict of tensors named by their path in that
// dict ("model.decoder.layers.0.mlp.linear_fc1.weight", "model1....", "optimizer.state.3.exp_avg"), leaving the
// meaning of names to the bridge. Views are kept as stored (offset, strides); read() gathers them contiguous.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/mapped_file.h"
#include "convert/formats/torch/torch_save.h"

namespace trestle {

struct LegacyRankId {
  int tp = 0;
  int pp = -1;  // -1: no pipeline suffix in the directory name
  int ep = -1;  // -1: no expert suffix
};

struct LegacyTensor {
  std::string name;
  TorchTensorRef ref;
};

class LegacyRankFile {
 public:
  static Result<LegacyRankFile> open(const std::string& path, LegacyRankId id = {});

  const std::string& path() const { return path_; }
  const LegacyRankId& id() const { return id_; }
  const PickleValue* root() const { return archive_->root(); }
  const PickleValue* args() const { return root()->get("args"); }  // argparse.Namespace: args()->attr("num_layers")
  std::optional<std::int64_t> iteration() const;
  std::optional<double> checkpoint_version() const;
  // The model chunk keys present: {"model"} or {"model0", "model1", ...}.
  std::vector<std::string> model_keys() const;
  const std::vector<LegacyTensor>& tensors() const { return tensors_; }  // every tensor in the dict, in file order
  const LegacyTensor* find(const std::string& name) const;
  // Why find(name) found nothing: "no tensor 'name'", or what the entry of that name holds instead of a tensor.
  std::string no_tensor(const std::string& name) const;
  // Copies a tensor, contiguous row-major, into dst (numel × element size bytes), and checks its storage record's zip
  // CRC-32 (once per record): a corrupt file fails naming the tensor.
  Status read(const std::string& name, std::byte* dst) const;

 private:
  Status verify_record(const TorchTensorRef& ref, const std::byte* copied, const std::string& what) const;
  std::string path_;
  LegacyRankId id_;
  struct DirectReads;  // the file opened for O_DIRECT reads of large tensors, and their buffer; thread-safe
  std::shared_ptr<MappedFile> file_;  // the pickle and small tensors are read through the map
  std::shared_ptr<TorchSaveArchive> archive_;
  std::shared_ptr<DirectReads> direct_;
  std::vector<LegacyTensor> tensors_;
  std::map<std::string, std::string> non_tensors_;  // every other leaf of the dict: its path -> its value, in short
};

struct LegacyCheckpoint {
  std::string directory;                  // the iteration directory
  std::optional<std::int64_t> iteration;  // from the tracker or the directory name; nullopt for "release"
  std::vector<std::pair<LegacyRankId, std::string>> rank_files;  // sorted by (pp, tp, ep)
};

// Accepts the root (with the tracker file), an iter_N / release directory, or one mp_rank_* directory's parent.
Result<LegacyCheckpoint> find_legacy_checkpoint(const std::string& path);
// True when path looks like a legacy tree (tracker + mp_rank dirs, or mp_rank dirs directly), or is a root whose
// tracker names an iteration that is missing while its saved iterations are all legacy ones.
bool is_legacy_checkpoint(const std::string& path);
// Parses "mp_rank_01_002_003" into its ranks; nullopt for other names.
std::optional<LegacyRankId> parse_mp_rank_dir(const std::string& name);

}  // namespace trestle
