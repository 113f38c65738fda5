#include "convert/reshard.h"

#include <chrono>
#include <filesystem>
#include <map>
#include <mutex>
#include <numeric>
#include <sstream>

#include "ckpt/byte_size.h"
#include "ckpt/layout_save.h"
#include "ckpt/process_memory.h"
#include "convert/bridge/bridge_copy.h"
#include "convert/bridge/bridge_model_json.h"
#include "convert/bridge/megatron_dist_names.h"
#include "convert/bridge_convert.h"
#include "convert/output_dir.h"
#include "convert/sources/canonical_source.h"
#include "parallel/layout/pipeline_layout_string.h"
#include "parallel/layout/placement.h"

namespace trestle {
namespace fs = std::filesystem;
namespace {

constexpr std::string_view kOptimizerPrefix = "optimizer.";

// The source's tensors, each classified: a model weight of the plan, an optimizer state of one, or a whole tensor.
struct Classified {
  std::vector<LayoutTensor> tensors;
  std::vector<PlacedTensor> placed;
  std::uint64_t optimizer_tensors = 0;
};

Result<Classified> classify(const std::vector<LayoutTensor>& stored, const BridgePlan& plan,
                            const std::string& source) {
  std::map<std::string, const BridgeTensor*> weights;
  for (const auto& t : plan.tensors) weights[t.name] = &t;
  std::map<std::string, Shape> planned = canonical_shapes(plan), present;
  Classified out;
  std::vector<std::string> unknown;
  bool has_step = false;
  for (const LayoutTensor& entry : stored) {
    const std::string& name = entry.name;
    if (weights.count(name)) {
      present[name] = entry.shape;
      out.placed.push_back({weights[name], Holding::kModelWeight, entry.shape});
    } else if (name.starts_with(kOptimizerPrefix)) {
      const std::string rest = name.substr(kOptimizerPrefix.size());
      const auto dot = rest.find('.');
      const auto weight = dot == std::string::npos ? weights.end() : weights.find(rest.substr(dot + 1));
      if (weight != weights.end()) {
        if (entry.shape != weight->second->shape)
          return Status::Error(source + ": tensor '" + name + "' has shape " + to_string(entry.shape) +
                               ", but its weight " + weight->first + " has " + to_string(weight->second->shape));
        if (!is_floating(entry.dtype))
          return Status::Error(source + ": tensor '" + name + "' is stored as " + std::string(dtype_name(entry.dtype)) +
                               "; Adam's state of a weight is floating point");
        out.placed.push_back({weight->second, Holding::kOptimizerShard, entry.shape});
        ++out.optimizer_tensors;
      } else {
        if (name == kTrestleOptimizerStep) {
          if (is_floating(entry.dtype) || entry.dtype == DType::kBool || numel(entry.shape) != 1)
            return Status::Error(source + ": tensor '" + name + "' is " + std::string(dtype_name(entry.dtype)) + " " +
                                 to_string(entry.shape) + "; Adam's step is one integer");
          has_step = true;
        }
        out.placed.push_back({nullptr, Holding::kEveryRank, entry.shape});
      }
    } else {
      unknown.push_back(name);
      continue;
    }
    out.tensors.push_back(entry);
  }
  if (!unknown.empty()) {
    std::string list;
    for (std::size_t i = 0; i < unknown.size() && i < 10; ++i) list += (i ? ", " : "") + unknown[i];
    if (std::all_of(unknown.begin(), unknown.end(),
                    [](const std::string& n) { return n.find(".adapter.") != std::string::npos; }))
      return Status::Error(source + ": LoRA adapters (" + list +
                           "): an adapter checkpoint is not resharded; `trestle train --load` reads it in any layout "
                           "as it is, and its base is resharded as any model");
    return Status::Error(
        source + ": " + std::to_string(unknown.size()) +
        " tensor(s) are neither weights of the model nor optimizer state, so their layout is unknown: " + list);
  }
  TRESTLE_RETURN_IF_ERROR(check_accounting(planned, present, source));
  // Adam's moments without its step would resume as another optimizer (the torch_dist reader refuses the same).
  if (out.optimizer_tensors > 0 && !has_step)
    return Status::Error(source + ": holds optimizer state but not Adam's step ('" +
                         std::string(kTrestleOptimizerStep) +
                         "'); convert the weights alone with --model-only (train: --no-load-optim)");
  return out;
}

std::string describe(const ParallelLayout& from, const ParallelLayout& to, const BridgeModel& model,
                     const Classified& c, const std::vector<std::vector<RankPiece>>& ranks, int writers) {
  auto layout_line = [](const ParallelLayout& l) {
    std::ostringstream s;
    s << "tp " << l.tp << ", pp " << l.pp << ", vpp " << l.vpp << ", ep " << l.ep << ", dp " << l.dp() << " (world "
      << l.world_size() << ")";
    if (l.first_stage_layers || l.last_stage_layers)
      s << ", first/last stage layers " << l.first_stage_layers << "/" << l.last_stage_layers;
    if (!l.chunk_layers.empty()) {
      s << ", layers per virtual stage";
      for (const std::int64_t n : l.chunk_layers) s << " " << n;
    }
    return s.str();
  };
  std::ostringstream out;
  out << "model         " << model.architecture << ", " << model.hf.num_layers << " layers, "
      << c.tensors.size() - c.optimizer_tensors << " tensors + " << c.optimizer_tensors << " optimizer states\n"
      << "from          " << layout_line(from) << "\n"
      << "to            " << layout_line(to) << "\n";
  std::uint64_t largest = 0;
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    std::uint64_t bytes = 0;
    for (const auto& p : ranks[r]) {
      const std::uint64_t b = static_cast<std::uint64_t>(p.piece.numel()) * dtype_size(c.tensors[p.tensor].dtype);
      bytes += b;
      largest = std::max(largest, b);
    }
    const auto rc = rank_coordinates(to, static_cast<int>(r));
    out << "rank " << r << "        tp " << rc.tp_rank << " pp " << rc.pp_rank << " dp " << rc.dp_rank << " ep "
        << rc.ep_rank << ": " << ranks[r].size() << " pieces, " << format_bytes(bytes) << "\n";
  }
  out << "writes        " << format_bytes(distinct_piece_bytes(c.tensors, ranks)) << " (replicas once)\n"
      << "memory        about " << format_bytes(static_cast<std::uint64_t>(writers) * largest + 2 * kReadBufferBytes)
      << " (" << writers << " writer(s) x largest piece " << format_bytes(largest) << " + read buffers)\n";
  return out.str();
}

}  // namespace

Status check_checkpoint_tensors(const BridgedModel& bridged, const std::vector<LayoutTensor>& tensors,
                                const std::string& source) {
  TRESTLE_ASSIGN_OR_RETURN(const BridgePlan plan, make_bridge_plan(bridged.model, bridged.norms, bridged.experts));
  return classify(tensors, plan, source).status();
}

ParallelLayout apply_layout_change(const ParallelLayout& source, const LayoutChange& change) {
  ParallelLayout l = source;
  if ((change.pp && *change.pp != source.pp) || (change.vpp && *change.vpp != source.vpp) ||
      (change.first_stage_layers && *change.first_stage_layers != source.first_stage_layers) ||
      (change.last_stage_layers && *change.last_stage_layers != source.last_stage_layers)) {
    l.first_stage_layers = l.last_stage_layers = 0;
    if (!l.chunk_layers.empty() && !change.vpp) l.vpp = 1;  // (the string's, not asked for)
    l.chunk_layers.clear();  // a pipeline layout string's split fits its own pp x vpp only
  }
  if (change.tp) l.tp = *change.tp;
  if (change.pp) l.pp = *change.pp;
  if (change.vpp) l.vpp = *change.vpp;
  if (change.ep) l.ep = *change.ep;
  if (change.etp) l.etp = *change.etp;
  if (l.etp == l.tp) l.etp = 0;
  l.data_parallel = change.dp ? *change.dp : source.dp();
  // Experts are split within cp x dp: where the source's dp cannot take the new ep, the smallest multiple of it that
  // can (run_reshard_request names the change).
  if (change.ep && !change.dp && l.cp * l.data_parallel % l.ep != 0)
    l.data_parallel = std::lcm(l.cp * l.data_parallel, l.ep) / l.cp;
  if (change.first_stage_layers) l.first_stage_layers = *change.first_stage_layers;
  if (change.last_stage_layers) l.last_stage_layers = *change.last_stage_layers;
  return l;
}

Result<ParallelLayout> with_pipeline_layout(ParallelLayout layout, const std::string& text, const BridgeModel& model) {
  if (model.nemotron_h())
    return Status::Error(
        "--pipeline-model-parallel-layout: a hybrid model's stages are split by its layer pattern "
        "(Megatron refuses the layout beside --hybrid-layer-pattern)");
  TRESTLE_ASSIGN_OR_RETURN(const PipelineLayoutString parsed,
                           parse_pipeline_layout(text, layout.pp, model.hf.num_layers, model.mtp_layers));
  if (layout.pp == 1 && parsed.vpp > 1)
    return Status::Error("--pipeline-model-parallel-layout " + text + ": " + std::to_string(parsed.vpp) +
                         " virtual stages at pipeline-parallel size 1; give the size the layout is for with --pp");
  layout.vpp = parsed.vpp;
  layout.chunk_layers = parsed.chunk_layers;
  layout.first_stage_layers = layout.last_stage_layers = 0;
  return layout;
}

Result<ReshardReport> reshard_to_trestle(const CanonicalSource& source, const std::string& dst,
                                         const ReshardOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  BridgedModel bridged = source.model();
  const ParallelLayout from = bridged.layout;
  ParallelLayout to = apply_layout_change(from, options.change);
  if (options.change.pipeline_layout) {
    TRESTLE_ASSIGN_OR_RETURN(to, with_pipeline_layout(to, *options.change.pipeline_layout, bridged.model));
  }
  const auto& config = bridged.model.hf;
  TRESTLE_RETURN_IF_ERROR(
      check_layout(to, config.num_layers, config.num_kv_heads, bridged.model.is_moe() ? config.num_experts : 0));
  TRESTLE_RETURN_IF_ERROR(check_linear_attention_tp(bridged.model, to.tp));
  TRESTLE_RETURN_IF_ERROR(check_mlp_split(megatron_spec(bridged.model, bridged.norms), to.tp, to.expert_tp()));
  TRESTLE_ASSIGN_OR_RETURN(const BridgePlan plan, make_bridge_plan(bridged.model, bridged.norms, bridged.experts));
  TRESTLE_ASSIGN_OR_RETURN(const Classified classified, classify(source.tensors(), plan, source.description()));
  TRESTLE_ASSIGN_OR_RETURN(const auto ranks,
                           place_on_ranks(classified.placed, megatron_spec(bridged.model, bridged.norms), to));

  const int writers = std::min(options.concurrent_writers, to.world_size());
  ReshardReport report;
  report.from = from;
  report.to = to;
  report.plan = describe(from, to, bridged.model, classified, ranks, writers);
  if (options.dry_run) {
    TRESTLE_RETURN_IF_ERROR(StagedOutput::check_destination(dst, source.path()));
    return report;
  }
  TRESTLE_ASSIGN_OR_RETURN(StagedOutput output, StagedOutput::begin(dst, source.path()));

  bridged.layout = to;
  CheckpointInfo info;
  info.iteration = source.iteration();
  info.layout = layout_sizes_to_json(to);
  TRESTLE_ASSIGN_OR_RETURN(info.model, checked_bridged_model_json(bridged, dst));
  info.training = source.training();
  // Per-rank state (RNG) belongs to the ranks of the layout that saved it: kept where that layout is unchanged.
  if (!(to == from)) info.training.erase("ranks");
  info.training["resharded_from"] = layout_to_json(from);
  info.training.erase(kWeightsOriginKey);  // the weights are moved, not changed: they keep a Trestle source's origin
  if (!source.weights_origin().empty()) info.training[kWeightsOriginKey] = source.weights_origin();
  TRESTLE_ASSIGN_OR_RETURN(info.files,
                           side_files_to_record(source.side_files_dir(), bridged.side_files, source.side_file_links()));

  auto fill = [&](const RankPiece& piece, std::span<std::byte> out) -> Status {
    return source.read(classified.tensors[piece.tensor].name, piece.piece, out);
  };
  SaveOptions save = options.save;
  save.io.request_bytes = std::size_t{1} << 20;  // several writers at once: keep their staging small
  save.io.queue_depth = 16;
  const LayoutSaveOptions save_options{save, writers, options.progress, "reshard " + fs::path(dst).filename().string()};
  TRESTLE_ASSIGN_OR_RETURN(const LayoutSaveReport saved,
                           save_layout(output.path(), info, classified.tensors, ranks, fill, save_options));
  TRESTLE_RETURN_IF_ERROR(output.commit());

  report.tensors = classified.tensors.size();
  report.optimizer_tensors = classified.optimizer_tensors;
  report.pieces = saved.pieces_written;
  report.bytes_read = source.bytes_read();
  report.bytes_written = saved.bytes_written;
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  report.peak_rss_bytes = peak_rss_bytes();
  return report;
}

}  // namespace trestle
