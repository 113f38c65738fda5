// A legacy mp_rank_* tree as a canonical source. Which canonical boxes each rank file holds comes from bridge_layout.h
// for the layout the tree has (tp / pp / ep from the directory names, vpp from the model0.. chunks): a rank's local
// tensor is its boxes concatenated along the TP split dimension (linear_fc1: [gate_r; up_r]; embedding: its padded
// vocab rows, padding last; a Mamba mixer's or Gated DeltaNet's in_proj / conv1d: its parts' slices one after
// another). Local names are numbered from 0 in each model chunk and experts from 0 on each EP rank (a
// multi-token-prediction layer's too), as Megatron writes them. Every model tensor of every rank file must be consumed
// (except _extra_state entries, the router's token counter and a later stage's copy of the embedding: tied, or for
// multi-token prediction); a TP rank whose vocabulary rows are all padding holds its embedding of the padded shape.
// Optimizer state (indexed by parameter position, not name) is not mapped: a rank file holding it is an error unless
// SourceOptions::model_only, never a silent drop.
#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

#include "convert/bridge/megatron_args.h"
#include "convert/formats/torch/megatron_legacy.h"
#include "convert/sources/canonical_source.h"
#include "parallel/layout/placement.h"

namespace trestle {
namespace fs = std::filesystem;
namespace {

// One canonical box stored as `box.numel()` contiguous elements at element `at` of a rank file's local tensor.
struct Segment {
  std::size_t file;
  std::string local;
  Box box;
  std::int64_t at = 0;
};

class LegacySource final : public CanonicalSource {
 public:
  LegacySource(std::vector<LegacyRankFile> files, BridgedModel model, std::int64_t iteration,
               std::map<std::string, std::vector<Segment>> segments,
               std::map<std::string, std::vector<Segment>> replicas, std::vector<LayoutTensor> tensors, std::string dir)
      : files_(std::move(files)), segments_(std::move(segments)), replicas_(std::move(replicas)), dir_(std::move(dir)) {
    model_ = std::move(model);
    tensors_ = std::move(tensors);
    iteration_ = iteration;
    // The run's dropout and sequence length, which Megatron-LM's --use-checkpoint-args takes.
    training_["megatron_args"] = kept_megatron_args(files_[0].args());
  }

  std::string description() const override { return "megatron-legacy " + dir_; }

  Status read(const std::string& name, const Piece& piece, std::span<std::byte> out) const override {
    const auto it = segments_.find(name);
    const LayoutTensor* tensor = find(name);
    if (it == segments_.end() || !tensor) return Status::Error(description() + ": no tensor '" + name + "'");
    if (piece.flat)
      return Status::Error(description() + ": '" + name + "': flat pieces are not read from legacy files");
    const std::size_t es = dtype_size(tensor->dtype);
    std::vector<std::byte> local;
    std::pair<std::size_t, std::string> loaded{SIZE_MAX, ""};
    std::int64_t copied = 0;
    for (const Segment& s : it->second) {
      if (!intersect(s.box, piece.box)) continue;
      const LegacyRankFile& f = files_[s.file];
      if (loaded != std::make_pair(s.file, s.local)) {
        const LegacyTensor* t = f.find(s.local);
        local.resize(static_cast<std::size_t>(numel(t->ref.shape)) * es);
        TRESTLE_RETURN_IF_ERROR(f.read(s.local, local.data()));
        loaded = {s.file, s.local};
        std::lock_guard lock(mutex_);
        bytes_read_ += local.size();
      }
      const std::byte* from = local.data() + static_cast<std::size_t>(s.at) * es;
      for_each_shared_run(Piece{s.box, std::nullopt}, piece, [&](const SharedRun& r) {
        std::memcpy(out.data() + static_cast<std::size_t>(r.b_index) * es,
                    from + static_cast<std::size_t>(r.a_index) * es, static_cast<std::size_t>(r.count) * es);
        copied += r.count;
      });
    }
    if (copied != piece.numel())
      return Status::Error(description() + ": '" + name + "': the rank files hold " + std::to_string(copied) +
                           " of the " + std::to_string(piece.numel()) + " elements of " + to_string(piece));
    return OkStatus();
  }

  Status check_replicas() const override {
    std::vector<std::byte> local, kept, other;  // (reused across tensors)
    for (const auto& [name, copies] : replicas_) {
      const std::size_t es = dtype_size(find(name)->dtype);
      for (const Segment& first : segments_.at(name)) {
        bool read = false;  // the copy reads take, read once for all of its replicas
        for (const Segment& copy : copies) {
          if (!(copy.box == first.box)) continue;
          if (!read) TRESTLE_RETURN_IF_ERROR(read_segment(first, es, local, kept));
          read = true;
          TRESTLE_RETURN_IF_ERROR(read_segment(copy, es, local, other));
          if (kept != other)
            return Status::Error(description() + ": tensor '" + name + "' " + to_string(copy.box) +
                                 " differs between " + files_[first.file].path() + " ('" + first.local + "') and " +
                                 files_[copy.file].path() + " ('" + copy.local + "'), which hold the same copy of it");
        }
      }
    }
    return OkStatus();
  }

 private:
  // The elements of `s.box` as its rank file stores them, read through `local` (its whole local tensor).
  Status read_segment(const Segment& s, std::size_t es, std::vector<std::byte>& local,
                      std::vector<std::byte>& out) const {
    const LegacyRankFile& f = files_[s.file];
    local.resize(static_cast<std::size_t>(numel(f.find(s.local)->ref.shape)) * es);
    TRESTLE_RETURN_IF_ERROR(f.read(s.local, local.data()));
    const auto begin = local.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(s.at) * es);
    out.assign(begin, begin + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(s.box.numel()) * es));
    return OkStatus();
  }

  std::vector<LegacyRankFile> files_;
  std::map<std::string, std::vector<Segment>> segments_;
  std::map<std::string, std::vector<Segment>> replicas_;  // further copies of segments' boxes, in other rank files
  std::string dir_;
  mutable std::mutex mutex_;
};

// A Mamba mixer's or Gated DeltaNet's in_proj / conv1d part (canonical `….in_proj.weight.z`, Megatron-Core's
// sharded_state_dict split): a legacy rank file holds the module's whole local tensor, `….in_proj.weight`, its parts'
// TP slices concatenated in order. The whole tensor's name for a part; the name itself otherwise.
std::string stored_module_tensor(const std::string& name) {
  const std::size_t last = name.rfind('.');
  if (last == std::string::npos) return name;
  const std::string whole = name.substr(0, last);
  for (const char* module : {".in_proj.weight", ".conv1d.weight", ".conv1d.bias"})
    if (whole.ends_with(module)) return whole;
  return name;
}

// The local name of canonical tensor t in the rank file of (stage, ep rank): chunk key, chunk-local layer, EP-local
// expert (a multi-token-prediction layer's experts too). Parts of a split module are named as their whole tensor.
Result<std::string> local_name(const BridgeTensor& t, const std::vector<std::vector<LayerRange>>& stages, int stage,
                               const LayerRange& experts, int vpp) {
  auto chunk_key = [&](std::size_t v) { return vpp > 1 ? "model" + std::to_string(v) : std::string("model"); };
  auto ep_local = [&](std::string name) {
    const std::string local_experts = "mlp.experts.local_experts.";
    const std::size_t at = name.find(local_experts);
    if (t.expert < 0 || at == std::string::npos) return name;
    const std::size_t number = at + local_experts.size();
    return name.substr(0, number) + std::to_string(t.expert - experts.begin) + name.substr(name.find('.', number));
  };
  if (t.layer < 0)
    return chunk_key(t.placement == Placement::kFirstStage ? 0 : stages[static_cast<std::size_t>(stage)].size() - 1) +
           "." + stored_module_tensor(ep_local(t.name));
  const auto& chunks = stages[static_cast<std::size_t>(stage)];
  for (std::size_t v = 0; v < chunks.size(); ++v) {
    if (t.layer < chunks[v].begin || t.layer >= chunks[v].end) continue;
    const std::string prefix = "decoder.layers.";
    const std::string rest = t.name.substr(t.name.find('.', prefix.size()) + 1);
    return chunk_key(v) + "." + prefix + std::to_string(t.layer - chunks[v].begin) + "." +
           stored_module_tensor(ep_local(rest));
  }
  return Status::Error("internal: layer " + std::to_string(t.layer) + " is not on stage " + std::to_string(stage));
}

// The rank of each directory. Megatron appends the EP rank to `mp_rank_{tp}` when there is no pipeline, so with pp 1
// and ep > 1 in args, `mp_rank_01_002` is tp 1, ep 2.
std::vector<LegacyRankId> rank_ids(const LegacyCheckpoint& tree, const ParallelLayout& args_layout) {
  std::vector<LegacyRankId> ids;
  for (const auto& [id, path] : tree.rank_files) ids.push_back(id);
  const bool ep_without_pp = args_layout.pp == 1 && args_layout.ep > 1 &&
                             std::all_of(ids.begin(), ids.end(), [](const LegacyRankId& id) { return id.ep < 0; });
  if (ep_without_pp)
    for (auto& id : ids) std::swap(id.pp, id.ep);
  return ids;
}

// tp, pp, ep and vpp as the tree has them.
Result<ParallelLayout> tree_layout(const LegacyCheckpoint& tree, const std::vector<LegacyRankId>& ids,
                                   const LegacyRankFile& first, ParallelLayout layout) {
  std::set<int> tps, pps, eps;
  for (const auto& id : ids) {
    tps.insert(id.tp);
    pps.insert(std::max(id.pp, 0));
    eps.insert(std::max(id.ep, 0));
  }
  layout.tp = static_cast<int>(tps.size());
  layout.pp = static_cast<int>(pps.size());
  layout.ep = static_cast<int>(eps.size());
  layout.data_parallel = layout.ep;
  const auto keys = first.model_keys();
  layout.vpp = std::max<int>(1, static_cast<int>(keys.size()));
  if (keys.size() == 1 && keys[0] == "model") layout.vpp = 1;
  if (static_cast<std::size_t>(layout.tp * layout.pp * layout.ep) != tree.rank_files.size() ||
      *tps.rbegin() != layout.tp - 1 || *pps.rbegin() != layout.pp - 1 || *eps.rbegin() != layout.ep - 1)
    return Status::Error(tree.directory + ": the mp_rank_* directories do not form a complete tp x pp x ep grid (" +
                         std::to_string(tree.rank_files.size()) + " rank directories for tp " +
                         std::to_string(layout.tp) + ", pp " + std::to_string(layout.pp) + ", ep " +
                         std::to_string(layout.ep) + ")");
  return layout;
}

}  // namespace

Result<nlohmann::json> read_legacy_run_args(const std::string& path) {
  TRESTLE_ASSIGN_OR_RETURN(const LegacyCheckpoint tree, find_legacy_checkpoint(path));
  if (tree.rank_files.empty()) return Status::Error(tree.directory + ": no mp_rank_* rank files");
  TRESTLE_ASSIGN_OR_RETURN(const auto file, LegacyRankFile::open(tree.rank_files[0].second, tree.rank_files[0].first));
  return kept_megatron_args(file.args());
}

Result<std::unique_ptr<CanonicalSource>> open_legacy_source(const std::string& path, const SourceOptions& options) {
  TRESTLE_ASSIGN_OR_RETURN(const LegacyCheckpoint tree, find_legacy_checkpoint(path));
  if (tree.rank_files.empty()) return Status::Error(tree.directory + ": no mp_rank_* rank files");
  std::vector<LegacyRankFile> files;
  for (const auto& [id, file] : tree.rank_files) {
    TRESTLE_ASSIGN_OR_RETURN(auto opened, LegacyRankFile::open(file, id));
    // Megatron-LM reorders the query/key/value rows of checkpoints older than version 2.0 (read as 0 when absent:
    // fix_query_key_value_ordering), which Trestle does not: such a file would convert with its heads scrambled.
    if (const std::optional<double> version = opened.checkpoint_version(); !version || !(*version >= 2.0)) {
      std::ostringstream shown;
      if (version) shown << *version;
      return Status::Error(
          opened.path() + ": checkpoint_version " +
          (version ? shown.str() : std::string("missing or not a number (Megatron-LM reads it as 0)")) +
          ": Megatron-LM saves 3.0 and reorders the query/key/value rows of a checkpoint older than "
          "2.0 as it loads, which Trestle does not convert");
    }
    files.push_back(std::move(opened));
  }
  TRESTLE_ASSIGN_OR_RETURN(BridgedModel model, megatron_source_model(options, "", files[0].args(), files[0].path()));
  const std::vector<LegacyRankId> ids = rank_ids(tree, model.layout);
  TRESTLE_ASSIGN_OR_RETURN(ParallelLayout layout, tree_layout(tree, ids, files[0], model.layout));
  std::vector<std::string> names;
  for (const auto& t : files[0].tensors()) names.push_back(t.name);
  model.norms = detect_norm_naming(names);
  std::vector<std::string> every_rank;  // (the multi-token-prediction layers are on the last stage's ranks)
  for (const auto& file : files)
    for (const auto& t : file.tensors()) every_rank.push_back(t.name);
  count_stored_mtp_layers(model, every_rank);
  model.layout = layout;
  const auto& c = model.model.hf;
  TRESTLE_RETURN_IF_ERROR(check_layout(layout, c.num_layers, c.num_kv_heads, model.model.is_moe() ? c.num_experts : 0)
                              .with_context(tree.directory + " (the layout its mp_rank_* directories give: tp " +
                                            std::to_string(layout.tp) + ", pp " + std::to_string(layout.pp) + ", ep " +
                                            std::to_string(layout.ep) + ")"));
  TRESTLE_RETURN_IF_ERROR(check_linear_attention_tp(model.model, layout.tp));
  TRESTLE_ASSIGN_OR_RETURN(const BridgePlan plan, make_bridge_plan(model.model, model.norms, model.experts));
  std::vector<PlacedTensor> placed;
  for (const auto& t : plan.tensors) placed.push_back({&t, Holding::kModelWeight, t.shape});
  TRESTLE_ASSIGN_OR_RETURN(const auto ranks, place_on_ranks(placed, megatron_spec(model.model, model.norms), layout));
  TRESTLE_ASSIGN_OR_RETURN(const auto stages, pipeline_layers(layout, c.num_layers));
  const std::int64_t padded = padded_vocab_size(c.vocab_size, layout.make_vocab_size_divisible_by, layout.tp);

  std::map<std::string, std::vector<Segment>> segments, replicas;
  std::vector<std::optional<DType>> dtypes(plan.tensors.size());
  std::vector<std::set<std::string>> consumed(files.size());
  for (std::size_t f = 0; f < files.size(); ++f) {
    const LegacyRankId& id = ids[f];
    const int stage = std::max(id.pp, 0), ep_rank = std::max(id.ep, 0);
    const LayerRange experts = experts_of_rank(layout, c.num_experts, ep_rank);
    const auto& pieces =
        ranks[static_cast<std::size_t>(global_rank(layout, {.tp_rank = id.tp, .dp_rank = ep_rank, .pp_rank = stage}))];
    // The rank's pieces by the local tensor holding them: one canonical tensor's, or a split module's parts' (in
    // the plan's order, each its TP slice, stacked along dim 0).
    std::vector<std::string> order;
    std::map<std::string, std::map<std::size_t, std::vector<const RankPiece*>>> held_by;
    for (const RankPiece& piece : pieces) {
      TRESTLE_ASSIGN_OR_RETURN(const std::string local,
                               local_name(plan.tensors[piece.tensor], stages, stage, experts, layout.vpp));
      if (!held_by.count(local)) order.push_back(local);
      held_by[local][piece.tensor].push_back(&piece);
    }
    for (const std::string& local : order) {
      const LegacyTensor* stored = files[f].find(local);
      if (!stored)
        return Status::Error(files[f].path() + ": " + files[f].no_tensor(local) + " (" +
                             plan.tensors[held_by[local].begin()->first].name + ", tp rank " + std::to_string(id.tp) +
                             ")");
      Shape expected;
      std::string held;
      std::int64_t at = 0;
      for (const auto& [index, its] : held_by[local]) {
        const BridgeTensor& t = plan.tensors[index];
        const std::size_t dim = t.split == TpSplit::kRow ? 1 : 0;
        Shape mine_shape = t.shape;
        mine_shape[dim] = 0;
        for (const RankPiece* piece : its) {
          const Box& box = piece->piece.box;
          auto& mine = segments[t.name];
          // Replicated tensors (norms, router) are in every TP rank's file: read from the first, the others checked
          // against it by check_replicas().
          if (std::none_of(mine.begin(), mine.end(), [&](const Segment& s) { return s.box == box; }))
            mine.push_back({f, local, box, at});
          else replicas[t.name].push_back({f, local, box, at});
          at += box.numel();
          mine_shape[dim] += box.shape[dim];
        }
        if (t.split == TpSplit::kVocab) mine_shape[0] = padded / layout.tp;
        held += (held.empty() ? "" : ", ") + std::string(tp_split_name(t.split)) + " split of " + t.name + " " +
                to_string(t.shape);
        if (expected.empty()) {
          expected = mine_shape;
        } else {  // a further part: the same trailing dimensions, stacked along dim 0
          if (dim != 0 || !std::equal(mine_shape.begin() + 1, mine_shape.end(), expected.begin() + 1, expected.end()))
            return Status::Error("internal: " + t.name + " " + to_string(mine_shape) + " does not stack onto " +
                                 local + " " + to_string(expected));
          expected[0] += mine_shape[0];
        }
        auto& dtype = dtypes[index];
        if (dtype && *dtype != stored->ref.dtype)
          return Status::Error(files[f].path() + ": tensor '" + local + "' is " +
                               std::string(dtype_name(stored->ref.dtype)) + " but other ranks hold " + t.name +
                               " as " + std::string(dtype_name(*dtype)));
        dtype = stored->ref.dtype;
      }
      if (stored->ref.shape != expected)
        return Status::Error(files[f].path() + ": tensor '" + local + "' has shape " + to_string(stored->ref.shape) +
                             ", expected " + to_string(expected) + " (tp rank " + std::to_string(id.tp) + " of " +
                             std::to_string(layout.tp) + ", " + held + ")");
      consumed[f].insert(local);
    }
    // A TP rank whose vocabulary rows are all padding (a small vocabulary over many ranks) holds no piece of the
    // embedding or output layer, but its file still holds the local tensor: padding rows only, of the padded shape.
    for (const BridgeTensor& t : plan.tensors) {
      const bool on_stage = t.placement == Placement::kFirstStage ? stage == 0 : stage == layout.pp - 1;
      if (t.split != TpSplit::kVocab || t.layer >= 0 || !on_stage) continue;
      TRESTLE_ASSIGN_OR_RETURN(const std::string local, local_name(t, stages, stage, experts, layout.vpp));
      const LegacyTensor* stored = files[f].find(local);
      if (!stored || consumed[f].count(local)) continue;
      Shape padding = t.shape;
      padding[0] = padded / layout.tp;
      if (stored->ref.shape != padding)
        return Status::Error(files[f].path() + ": tensor '" + local + "' has shape " + to_string(stored->ref.shape) +
                             ", expected " + to_string(padding) + " (tp rank " + std::to_string(id.tp) + " of " +
                             std::to_string(layout.tp) + ": padding rows of " + t.name + ")");
      consumed[f].insert(local);
    }
    // Megatron-LM's legacy save with the distributed optimizer keeps Adam's state beside the rank file.
    const fs::path distributed = fs::path(files[f].path()).parent_path() / "distrib_optim.pt";
    std::error_code exists_ec;
    if (!options.model_only && fs::exists(fs::symlink_status(distributed, exists_ec)))
      return Status::Error(distributed.string() +
                           ": the distributed optimizer's state (a legacy save with --use-distributed-optimizer), "
                           "which Trestle does not map; pass --model-only to read the weights without it");
    for (const auto& t : files[f].tensors()) {
      if (t.name.starts_with("optimizer.") && !options.model_only)
        return Status::Error(files[f].path() + ": holds optimizer state ('" + t.name +
                             "'), which a legacy checkpoint "
                             "indexes by parameter position and Trestle does not map; pass --model-only to read the "
                             "weights without it");
      const bool model_tensor = t.name.starts_with("model.") || (t.name.starts_with("model") && t.name.size() > 5 &&
                                                                 std::isdigit(static_cast<unsigned char>(t.name[5])));
      // With tied embeddings, later stages keep a copy of the embedding as output_layer.weight; with
      // multi-token prediction the last stage keeps one for its MTP layers under the embedding's own name.
      // (A single stage has no copy: with the embeddings tied its output layer holds no weight, so a stored one means
      // the args describe another model than the file's.)
      const bool tied_copy =
          (model.model.tied() && stage > 0 && stage == layout.pp - 1 && t.name.ends_with(".output_layer.weight")) ||
          (model.model.mtp_layers > 0 && stage > 0 && stage == layout.pp - 1 &&
           t.name.ends_with(".embedding.word_embeddings.weight"));
      // Megatron-Core's router with an expert bias keeps its per-step token counts as a buffer state_dict saves.
      const bool counter = t.name.ends_with(".mlp.router.local_tokens_per_expert");
      if (model_tensor && !consumed[f].count(t.name) && !t.name.ends_with("_extra_state") && !tied_copy && !counter)
        return Status::Error(files[f].path() + ": tensor '" + t.name + "' is not a weight of the " +
                             model.model.architecture + " model in layout tp " + std::to_string(layout.tp) + ", pp " +
                             std::to_string(layout.pp) + ", vpp " + std::to_string(layout.vpp) + ", ep " +
                             std::to_string(layout.ep));
    }
  }
  std::vector<LayoutTensor> tensors;
  for (std::size_t i = 0; i < plan.tensors.size(); ++i) {
    if (!dtypes[i]) return Status::Error(tree.directory + ": no rank file holds " + plan.tensors[i].name);
    tensors.push_back({plan.tensors[i].name, *dtypes[i], plan.tensors[i].shape});
  }
  const std::int64_t iteration = tree.iteration.value_or(files[0].iteration().value_or(0));
  return std::unique_ptr<CanonicalSource>(new LegacySource(std::move(files), std::move(model), iteration,
                                                           std::move(segments), std::move(replicas), std::move(tensors),
                                                           tree.directory));
}

}  // namespace trestle
