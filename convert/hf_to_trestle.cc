// Hugging Face -> Trestle: every rank of the target layout runs the ordinary save protocol (plan, write, commit) in
// its own thread of a ThreadGroup, producing its pieces from the memory-mapped source one at a time.
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <semaphore>
#include <set>
#include <sstream>
#include <thread>

#include "ckpt/byte_size.h"
#include "ckpt/dtype_cast.h"
#include "ckpt/progress.h"
#include "ckpt/save_stream.h"
#include "convert/bridge_convert.h"
#include "convert/bridge_copy.h"
#include "convert/safetensors_checkpoint.h"

namespace trestle {
namespace fs = std::filesystem;
namespace {

struct RankPiece {
  std::size_t tensor;
  Box box;
};

int owner_stage(const BridgeTensor& t, const std::vector<std::vector<LayerRange>>& stages) {
  switch (t.placement) {
    case Placement::kFirstStage:
      return 0;
    case Placement::kLastStage:
      return static_cast<int>(stages.size()) - 1;
    case Placement::kLayer:
      return stage_of_layer(stages, t.layer);
  }
  return -1;
}

// The pieces each rank holds: its stage's layers, its EP rank's experts, its TP rank's boxes. Dense tensors are held
// by every data-parallel rank; the save's replica planning writes each once.
Result<std::vector<std::vector<RankPiece>>> assign_pieces(const BridgePlan& plan, const BridgeModel& m,
                                                          const MegatronLayout& layout) {
  TRESTLE_ASSIGN_OR_RETURN(const auto stages, pipeline_layers(layout, m.hf.num_layers));
  const std::int64_t padded = padded_vocab_size(m.hf.vocab_size, layout.make_vocab_size_divisible_by, layout.tp);
  std::vector<std::vector<RankPiece>> ranks(static_cast<std::size_t>(layout.world_size()));
  for (int rank = 0; rank < layout.world_size(); ++rank) {
    const RankCoordinates c = rank_coordinates(layout, rank);
    const LayerRange experts = experts_of_rank(layout, m.hf.num_experts, c.ep_rank);
    for (std::size_t i = 0; i < plan.tensors.size(); ++i) {
      const BridgeTensor& t = plan.tensors[i];
      if (owner_stage(t, stages) != c.pp_rank) continue;
      if (t.expert >= 0 && (t.expert < experts.begin || t.expert >= experts.end)) continue;
      TRESTLE_ASSIGN_OR_RETURN(const auto boxes, tp_boxes(t.split, t.shape, layout.tp, c.tp_rank, padded));
      for (const auto& box : boxes) ranks[static_cast<std::size_t>(rank)].push_back({i, box});
    }
  }
  return ranks;
}

Status check_destination(const std::string& dst) {
  std::error_code ec;
  if (fs::exists(dst, ec) && (!fs::is_directory(dst, ec) || !fs::is_empty(dst, ec)))
    return Status::Error(dst + ": destination exists and is not an empty directory; choose a new path");
  return OkStatus();
}

bool is_side_file(const std::string& name) {
  if (name.starts_with(".") || name == "config.json") return false;
  for (const char* ext : {".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth", ".bin.index.json"})
    if (name.ends_with(ext)) return false;
  return true;
}

std::vector<std::string> side_files(const std::string& src) {
  std::vector<std::string> names;
  if (!fs::is_directory(src)) return names;
  for (const auto& e : fs::directory_iterator(src))
    if (e.is_regular_file() && is_side_file(e.path().filename().string()))
      names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

Status copy_side_files(const std::string& src, const std::string& dir, const std::vector<std::string>& names) {
  if (names.empty()) return OkStatus();
  std::error_code ec;
  fs::create_directories(dir, ec);
  for (const auto& n : names) {
    fs::copy_file(fs::path(src) / n, fs::path(dir) / n, fs::copy_options::overwrite_existing, ec);
    if (ec) return Status::Error((fs::path(dir) / n).string() + ": cannot copy: " + ec.message());
  }
  return OkStatus();
}

DType target_dtype(DType source, const std::optional<DType>& cast) {
  return cast && is_floating(source) && can_cast(source, *cast) ? *cast : source;
}

std::string describe_plan(const BridgeModel& m, const MegatronLayout& l, const BridgePlan& plan,
                          const std::vector<std::vector<RankPiece>>& ranks, const std::vector<DType>& dtypes,
                          const HfToTrestleOptions& options, std::uint64_t staging) {
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
      << " (world size " << l.world_size() << "), norms "
      << (l.norms == NormNaming::kLocal ? "local" : "transformer_engine") << "\n";
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
      const std::uint64_t b = static_cast<std::uint64_t>(numel(p.box.shape)) * dtype_size(dtypes[p.tensor]);
      bytes += b;
      largest = std::max(largest, b);
    }
    total += bytes;
    const auto rc = rank_coordinates(l, static_cast<int>(r));
    out << "rank " << r << "        tp " << rc.tp_rank << " pp " << rc.pp_rank << " dp " << rc.dp_rank << " ep "
        << rc.ep_rank << ": " << ranks[r].size() << " pieces, " << format_bytes(bytes)
        << " (before replica de-duplication)\n";
  }
  const int writers = std::min(options.concurrent_writers, l.world_size());
  out << "tensors       " << plan.tensors.size() << " Megatron tensors from " << plan.hf.size()
      << " Hugging Face tensors, " << format_bytes(total) << " over all ranks\n";
  // Each writer holds one piece, the mapped source pages it is read from (released after the piece), and its staging.
  out << "memory        about " << format_bytes(static_cast<std::uint64_t>(writers) * (2 * largest + staging)) << " ("
      << writers << " writer(s) x (largest piece " << format_bytes(largest) << " and its mapped source + staging "
      << format_bytes(staging) << "))\n";
  return out.str();
}

}  // namespace

std::uint64_t peak_rss_bytes() {
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<std::uint64_t>(usage.ru_maxrss) * 1024;
}

Result<ConversionReport> convert_hf_to_trestle(const std::string& src, const std::string& dst,
                                               const HfToTrestleOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const MegatronLayout& layout = options.layout;
  TRESTLE_ASSIGN_OR_RETURN(const auto config, read_hf_config((fs::path(src) / "config.json").string()));
  TRESTLE_ASSIGN_OR_RETURN(const BridgeModel model, bridge_model_from_config(config));
  TRESTLE_RETURN_IF_ERROR(
      check_layout(layout, config.num_layers, config.num_kv_heads, model.is_moe() ? config.num_experts : 0));
  TRESTLE_ASSIGN_OR_RETURN(auto source, SafetensorsCheckpoint::open(src));
  TRESTLE_ASSIGN_OR_RETURN(const BridgePlan plan,
                           make_bridge_plan(model, layout.norms, detect_expert_layout(source.names())));

  std::map<std::string, Shape> present;
  for (const auto& name : source.names()) present[name] = source.find(name)->entry->shape;
  TRESTLE_RETURN_IF_ERROR(check_accounting(hf_shapes(plan), present, src));
  std::vector<ConstTensorView> views;
  for (const auto& t : plan.hf) {
    TRESTLE_ASSIGN_OR_RETURN(auto view, source.view(t.name));
    views.push_back(view);
  }
  std::vector<DType> dtypes;
  for (const auto& t : plan.tensors) {
    const DType in = views[t.runs.front().hf_index].dtype;
    for (const auto& r : t.runs)
      if (views[r.hf_index].dtype != in)
        return Status::Error("'" + t.name + "': its sources " + plan.hf[t.runs.front().hf_index].name + " and " +
                             plan.hf[r.hf_index].name + " have different dtypes");
    dtypes.push_back(target_dtype(in, options.dtype));
  }
  TRESTLE_ASSIGN_OR_RETURN(const auto ranks, assign_pieces(plan, model, layout));

  SaveOptions save = options.save;
  save.io.request_bytes = std::size_t{1} << 20;  // a conversion runs several writers: keep their staging small
  save.io.queue_depth = 16;
  const std::uint64_t staging = save.io.clamped().request_bytes * save.io.clamped().queue_depth;
  ConversionReport report;
  report.plan = describe_plan(model, layout, plan, ranks, dtypes, options, staging);
  if (options.dry_run) return report;
  TRESTLE_RETURN_IF_ERROR(check_destination(dst));

  BridgedModel bridged{model, layout, plan.experts, side_files(src)};
  if (options.dtype) set_config_dtype(bridged.model.hf.raw, *options.dtype);  // the config describes the stored weights
  CheckpointInfo info;
  info.iteration = options.iteration;
  info.layout = layout.parallel_layout();
  info.model = bridged_model_to_json(bridged);

  const int world = layout.world_size();
  ThreadGroup group(world);
  std::counting_semaphore<1024> writers(std::max(1, options.concurrent_writers));
  std::atomic<std::uint64_t> done{0};
  std::atomic<int> finished{0};
  std::vector<Status> results(static_cast<std::size_t>(world));
  std::vector<std::uint64_t> written_bytes(static_cast<std::size_t>(world), 0),
      written_pieces(static_cast<std::size_t>(world), 0);
  std::uint64_t total = 0;  // replicas are written once
  std::set<std::pair<std::size_t, Shape>> distinct;
  for (const auto& pieces : ranks)
    for (const auto& p : pieces)
      if (distinct.insert({p.tensor, p.box.offset}).second)
        total += static_cast<std::uint64_t>(numel(p.box.shape)) * dtype_size(dtypes[p.tensor]);

  auto run_rank = [&](int rank) {
    auto member = group.member(rank);
    const auto& pieces = ranks[static_cast<std::size_t>(rank)];
    std::vector<SaveItem> items;
    for (const auto& p : pieces) {
      const BridgeTensor& t = plan.tensors[p.tensor];
      items.push_back({t.name, dtypes[p.tensor], t.shape, Piece{p.box, std::nullopt}, streamed_data()});
    }
    auto fill = [&](std::size_t index, std::span<std::byte> out) -> Status {
      const BridgeTensor& t = plan.tensors[pieces[index].tensor];
      TRESTLE_RETURN_IF_ERROR(gather_box(t, pieces[index].box, views, dtypes[pieces[index].tensor], out));
      for (const auto& r : t.runs) release_mapped(views[r.hf_index].bytes());
      return OkStatus();
    };
    Status status;
    auto planned = plan_save(*member, dst, options.iteration, items);
    if (planned.ok()) {
      writers.acquire();
      auto mine = write_rank_file_streaming(planned->temp_dir, rank, items, planned->to_write, fill, save,
                                            [&](std::uint64_t bytes) { done += bytes; });
      writers.release();
      if (mine.ok()) {
        written_bytes[static_cast<std::size_t>(rank)] = mine->bytes_written;
        written_pieces[static_cast<std::size_t>(rank)] = mine->chunks.size();
      }
      status = commit_save(*member, dst, *planned, info, items, mine, save);
    } else {
      status = planned.status();
    }
    results[static_cast<std::size_t>(rank)] = status;
    ++finished;
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back(run_rank, r);
  Progress progress("hf -> trestle " + fs::path(dst).filename().string(), total, options.progress);
  std::uint64_t shown = 0;
  while (finished.load() < world) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const std::uint64_t now = done.load();
    progress.advance(now - shown);
    shown = now;
  }
  for (auto& t : threads) t.join();
  progress.advance(done.load() - shown);
  for (int r = 0; r < world; ++r)
    if (!results[static_cast<std::size_t>(r)].ok())
      return results[static_cast<std::size_t>(r)].with_context("rank " + std::to_string(r));
  progress.finish();
  TRESTLE_RETURN_IF_ERROR(copy_side_files(src, (fs::path(dst) / kSideFilesDir).string(), bridged.side_files));

  report.tensors = plan.tensors.size();
  for (int r = 0; r < world; ++r) {
    report.bytes_written += written_bytes[static_cast<std::size_t>(r)];
    report.pieces += written_pieces[static_cast<std::size_t>(r)];
  }
  for (const auto& v : views) report.bytes_read += v.nbytes();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  report.peak_rss_bytes = peak_rss_bytes();
  return report;
}

}  // namespace trestle
