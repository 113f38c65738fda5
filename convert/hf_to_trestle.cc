// Hugging Face -> Trestle: every rank of the target layout saves its pieces (layout_save.h), each produced just
// before it is written from the source tensors it needs, read whole once into a SourceTensorCache.
#include <chrono>
#include <filesystem>
#include <sstream>

#include "ckpt/byte_size.h"
#include "ckpt/dtype_cast.h"
#include "ckpt/layout_save.h"
#include "ckpt/process_memory.h"
#include "convert/bridge/bridge_copy.h"
#include "convert/bridge/hf_side_files.h"
#include "convert/bridge_convert.h"
#include "convert/output_dir.h"
#include "convert/reshard.h"
#include "convert/sources/hf_model.h"
#include "parallel/layout/placement.h"

namespace trestle {
namespace fs = std::filesystem;
namespace {

DType target_dtype(DType source, const std::optional<DType>& cast) {
  return cast && is_floating(source) && can_cast(source, *cast) ? *cast : source;
}

// The order in which the writers will want the source tensors: rank by rank (the writers run in rank order), piece by
// piece, each tensor where it is first wanted.
std::vector<std::size_t> read_order(const std::vector<std::vector<RankPiece>>& ranks,
                                    const std::vector<std::vector<std::size_t>>& sources, std::size_t count) {
  std::vector<std::size_t> order;
  std::vector<bool> seen(count, false);
  for (const auto& pieces : ranks)
    for (const auto& p : pieces)
      for (const std::size_t i : sources[p.tensor])
        if (i < count && !seen[i]) {
          seen[i] = true;
          order.push_back(i);
        }
  return order;
}

// How many pieces each source tensor feeds: one per distinct piece (a replicated piece is written, so filled, once).
std::vector<int> source_uses(const std::vector<std::vector<RankPiece>>& ranks,
                             const std::vector<std::vector<std::size_t>>& sources, std::size_t count) {
  std::vector<int> uses(count, 0);
  for (const RankPiece* p : distinct_pieces(ranks))
    for (const std::size_t i : sources[p->tensor])
      if (i < count) ++uses[i];
  return uses;
}

int writer_count(const HfToTrestleOptions& options) {
  return std::min(std::max(options.concurrent_writers, options.layout.tp), options.layout.world_size());
}

// A source tensor is read whole and a piece is filled whole, each into one buffer: one larger than the machine's memory
// cannot be allocated, so the plan is refused before any output is created.
Status check_buffers_fit(const std::string& src, const std::vector<StoredTensor>& stored, const BridgePlan& plan,
                         const std::vector<std::vector<RankPiece>>& ranks, const std::vector<DType>& dtypes) {
  const std::uint64_t memory = physical_memory_bytes();
  auto too_large = [&](const std::string& what, std::uint64_t bytes) {
    return Status::Error(src + ": " + what + " needs " + format_bytes(bytes) + " (" + std::to_string(bytes) +
                         " bytes) in memory at once, more than this machine's " + format_bytes(memory));
  };
  if (memory == 0) return OkStatus();
  for (const auto& t : stored)
    if (t.loaded_nbytes() > memory) return too_large("tensor '" + t.name + "'", t.loaded_nbytes());
  for (const auto& pieces : ranks)
    for (const auto& p : pieces) {
      const std::uint64_t bytes = static_cast<std::uint64_t>(p.piece.numel()) * dtype_size(dtypes[p.tensor]);
      if (bytes > memory) return too_large("a piece of '" + plan.tensors[p.tensor].name + "'", bytes);
    }
  return OkStatus();
}

std::string describe_plan(const BridgeModel& m, const ParallelLayout& l, const BridgePlan& plan,
                          const std::vector<std::vector<RankPiece>>& ranks, const std::vector<DType>& dtypes,
                          const HfToTrestleOptions& options, std::uint64_t staging, std::uint64_t cache_budget) {
  std::ostringstream out;
  const auto& c = m.hf;
  out << "model         " << m.architecture << ": " << c.num_layers << " layers, hidden " << c.hidden_size << ", ffn "
      << m.ffn_hidden_size << ", heads " << c.num_attention_heads << " (" << c.num_kv_heads << " KV groups), head dim "
      << c.head_dim << ", vocab " << c.vocab_size << " (padded "
      << padded_vocab_size(c.vocab_size, l.make_vocab_size_divisible_by, l.tp) << "), "
      << (c.tie_word_embeddings ? "tied" : "untied") << " embeddings";
  if (m.is_moe())
    out << ", " << c.num_experts << " experts top-" << c.experts_per_token << " (" << expert_layout_name(plan.experts)
        << " HF layout)";
  out << "\nlayout        tp " << l.tp << ", pp " << l.pp << ", vpp " << l.vpp << ", ep " << l.ep << ", dp " << l.dp()
      << " (world size " << l.world_size() << "), norms " << norm_naming_name(options.norms) << "\n";
  const auto stages = pipeline_layers(l, c.num_layers).value();
  for (std::size_t s = 0; s < stages.size(); ++s) {
    out << "stage " << s << "       layers";
    for (std::size_t v = 0; v < stages[s].size(); ++v)
      out << (v ? ", " : " ") << (l.vpp > 1 ? "chunk " + std::to_string(v) + " " : "") << "[" << stages[s][v].begin
          << ", " << stages[s][v].end << ")";
    out << "\n";
  }
  std::uint64_t largest = 0, total = 0;
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    std::uint64_t bytes = 0;
    for (const auto& p : ranks[r]) {
      const std::uint64_t b = static_cast<std::uint64_t>(p.piece.numel()) * dtype_size(dtypes[p.tensor]);
      bytes += b;
      largest = std::max(largest, b);
    }
    total += bytes;
    const auto rc = rank_coordinates(l, static_cast<int>(r));
    out << "rank " << r << "        tp " << rc.tp_rank << " pp " << rc.pp_rank << " dp " << rc.dp_rank << " ep "
        << rc.ep_rank << ": " << ranks[r].size() << " pieces, " << format_bytes(bytes)
        << " (before replica de-duplication)\n";
  }
  const int writers = writer_count(options);
  out << "tensors       " << plan.tensors.size() << " Megatron tensors from " << plan.hf.size()
      << " Hugging Face tensors, " << format_bytes(total) << " over all ranks\n";
  // Each writer holds one piece and its staging; the source tensors they are cut from are shared, under a budget, and
  // read ahead through each read-ahead thread's staging.
  const std::uint64_t read_ahead = SourceTensorCache::kReadAheadThreads * SourceTensorCache::kReadAheadGroupBytes;
  out << "memory        about "
      << format_bytes(static_cast<std::uint64_t>(writers) * (largest + staging) + cache_budget + read_ahead) << " ("
      << writers << " writer(s) x (largest piece " << format_bytes(largest) << " + staging " << format_bytes(staging)
      << ") + source tensors " << format_bytes(cache_budget) << " + read-ahead " << format_bytes(read_ahead) << ")\n";
  return out.str();
}

}  // namespace

Result<ConversionReport> convert_hf_to_trestle(const std::string& src, const std::string& dst,
                                               const HfToTrestleOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  TRESTLE_ASSIGN_OR_RETURN(const HfModel hf, open_hf_model(src, options.norms));
  const BridgeModel& model = hf.model;
  const BridgePlan& plan = hf.plan;
  const auto& config = model.hf;
  ParallelLayout layout = options.layout;
  if (options.pipeline_layout) {
    TRESTLE_ASSIGN_OR_RETURN(layout, with_pipeline_layout(layout, *options.pipeline_layout, model));
  }
  TRESTLE_RETURN_IF_ERROR(
      check_layout(layout, config.num_layers, config.num_kv_heads, model.is_moe() ? config.num_experts : 0));
  TRESTLE_RETURN_IF_ERROR(check_linear_attention_tp(model, layout.tp));
  TRESTLE_RETURN_IF_ERROR(check_mlp_split(megatron_spec(model, options.norms), layout.tp, layout.expert_tp()));
  std::vector<DType> dtypes;
  for (const DType in : hf.dtypes) dtypes.push_back(target_dtype(in, options.dtype));
  std::vector<PlacedTensor> placed;
  for (const auto& t : plan.tensors) placed.push_back({&t, Holding::kModelWeight, t.shape});
  TRESTLE_ASSIGN_OR_RETURN(const auto ranks, place_on_ranks(placed, megatron_spec(model, options.norms), layout));

  SaveOptions save = options.save;
  save.io.request_bytes = std::size_t{1} << 20;  // a conversion runs several writers: keep their staging small
  save.io.queue_depth = 16;
  const std::uint64_t staging = save.io.clamped().request_bytes * save.io.clamped().queue_depth;
  ConversionReport report;
  TRESTLE_ASSIGN_OR_RETURN(auto stored, stored_hf_tensors(hf.files, plan.hf, hf.quantization));
  TRESTLE_RETURN_IF_ERROR(check_buffers_fit(src, stored, plan, ranks, dtypes));
  const std::uint64_t cache_budget = default_cache_budget(stored);
  report.plan = describe_plan(model, layout, plan, ranks, dtypes, options, staging, cache_budget);
  // (float32 or wider holds a bfloat16 / float16 weight - 1 exactly)
  if (!options.dtype || dtype_size(*options.dtype) < 4) report.notes = hf.notes;
  if (options.dry_run) {
    TRESTLE_RETURN_IF_ERROR(StagedOutput::check_destination(dst, src));
    return report;
  }
  TRESTLE_ASSIGN_OR_RETURN(StagedOutput output, StagedOutput::begin(dst, src));

  BridgedModel bridged{model, layout, options.norms, plan.experts, hf_side_files(src)};
  if (options.dtype) set_model_dtype(bridged.model.hf, *options.dtype);  // the config describes the stored weights
  CheckpointInfo info;
  info.iteration = options.iteration;
  info.layout = layout_sizes_to_json(layout);
  TRESTLE_ASSIGN_OR_RETURN(info.model, checked_bridged_model_json(bridged, dst));
  TRESTLE_ASSIGN_OR_RETURN(info.files, side_files_to_record(src, bridged.side_files, SideFileLinks::kFollow));

  std::vector<LayoutTensor> tensors;
  for (std::size_t i = 0; i < plan.tensors.size(); ++i)
    tensors.push_back({plan.tensors[i].name, dtypes[i], plan.tensors[i].shape});
  SourceTensorCache cache(std::move(stored), cache_budget);
  const auto sources = hf_sources_per_tensor(plan);
  cache.read_ahead(read_order(ranks, sources, plan.hf.size()), source_uses(ranks, sources, plan.hf.size()),
                   cache.read_ahead_bytes(), SourceTensorCache::kReadAheadThreads);
  auto fill = [&](const RankPiece& piece, std::span<std::byte> out) -> Status {
    TRESTLE_ASSIGN_OR_RETURN(const auto pinned, cache.pin(sources[piece.tensor]));
    return gather_box(plan.tensors[piece.tensor], piece.piece.box, pinned.views(), dtypes[piece.tensor], out);
  };
  LayoutSaveOptions save_options{save, writer_count(options), options.progress,
                                 "hf -> trestle " + fs::path(dst).filename().string()};
  TRESTLE_ASSIGN_OR_RETURN(const LayoutSaveReport saved,
                           save_layout(output.path(), info, tensors, ranks, fill, save_options));
  TRESTLE_RETURN_IF_ERROR(output.commit());

  report.tensors = plan.tensors.size();
  report.bytes_written = saved.bytes_written;
  report.pieces = saved.pieces_written;
  report.bytes_read = cache.bytes_read();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  report.peak_rss_bytes = peak_rss_bytes();
  return report;
}

}  // namespace trestle
