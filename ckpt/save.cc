#include "ckpt/save.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <map>

#include "ckpt/atomic_file.h"
#include "ckpt/checkpoint_dir.h"
#include "ckpt/chunk_codec.h"
#include "ckpt/file_writer.h"

namespace trestle {
namespace {

using json = nlohmann::json;

json piece_json(const Piece& p) {
  json out = {p.box.offset, p.box.shape};
  if (p.flat) out.push_back({p.flat->start, p.flat->stop});
  return out;
}

Piece piece_from(const json& j) {
  Piece p{Box{j[0].get<Shape>(), j[1].get<Shape>()}, std::nullopt};
  if (j.size() > 2) p.flat = FlatRange{j[2][0].get<std::int64_t>(), j[2][1].get<std::int64_t>()};
  return p;
}

std::string new_save_id() {
  const auto now = std::chrono::system_clock::now().time_since_epoch().count();
  return std::to_string(::getpid()) + "-" + std::to_string(now);
}

Status check_local_items(std::span<const SaveItem> items) {
  for (const auto& it : items) {
    if (!box_within(it.piece.box, it.global_shape))
      return Status::Error("tensor '" + it.name + "': box " + to_string(it.piece.box) +
                           " is not within its global shape " + to_string(it.global_shape));
    if (it.piece.flat && (it.piece.flat->start < 0 || it.piece.flat->start > it.piece.flat->stop ||
                          it.piece.flat->stop > it.piece.box.numel()))
      return Status::Error("tensor '" + it.name + "': flat range of " + to_string(it.piece) + " is not within its box");
    if (!it.data && it.nbytes() > 0) return Status::Error("tensor '" + it.name + "': no data given");
  }
  return OkStatus();
}

struct Holder {
  int rank;
  std::size_t index;
};
struct UniquePiece {
  std::string name;
  Piece piece;
  std::uint64_t bytes;
  std::vector<Holder> holders;
};

// Every tensor must be described identically by all ranks and covered exactly once by its distinct pieces.
Status check_tensors(const std::map<std::string, std::pair<DType, Shape>>& tensors,
                     const std::vector<UniquePiece>& pieces) {
  std::map<std::string, std::vector<const Piece*>> by_tensor;
  for (const auto& p : pieces) by_tensor[p.name].push_back(&p.piece);
  for (const auto& [name, list] : by_tensor) {
    std::int64_t covered = 0;
    for (std::size_t i = 0; i < list.size(); ++i) {
      covered += list[i]->numel();
      for (std::size_t j = 0; j < i; ++j)
        if (shared_elements(*list[i], *list[j]) > 0)
          return Status::Error("tensor '" + name + "': pieces " + to_string(*list[j]) + " and " + to_string(*list[i]) +
                               " overlap without being identical");
    }
    const auto& shape = tensors.at(name).second;
    if (covered != numel(shape))
      return Status::Error("tensor '" + name + "': the ranks' pieces hold " + std::to_string(covered) + " of its " +
                           std::to_string(numel(shape)) + " elements " + to_string(shape));
  }
  return OkStatus();
}

}  // namespace

Result<SavePlan> plan_save(Collective& group, const std::string& root, std::int64_t iteration,
                           std::span<const SaveItem> items) {
  json message = {{"items", json::array()}};
  Status local =
      iteration < 0
          ? Status::Error(root + ": iteration " + std::to_string(iteration) + ": a checkpoint's iteration is 0 or more")
          : check_local_items(items);
  SavePlan plan;
  if (local.ok() && group.rank() == 0) {
    auto temp = begin_iteration(root, iteration, new_save_id());
    if (temp.ok()) {
      plan.temp_dir = temp->path();
      plan.temp_owner = std::make_shared<OwnedDir>(std::move(temp).value());
    }
    local = temp.status();
  }
  if (!local.ok()) message["error"] = local.message();
  message["temp_dir"] = plan.temp_dir;
  for (const auto& it : items)
    message["items"].push_back({it.name, dtype_name(it.dtype), it.global_shape, piece_json(it.piece)});
  TRESTLE_ASSIGN_OR_RETURN(const auto gathered, group.all_gather(message.dump()));

  std::map<std::string, std::pair<DType, Shape>> tensors;
  std::map<std::pair<std::string, std::string>, UniquePiece> unique;
  for (int r = 0; r < group.size(); ++r) {
    const json m = json::parse(gathered[static_cast<std::size_t>(r)]);
    if (m.contains("error")) return Status::Error("rank " + std::to_string(r) + ": " + m["error"].get<std::string>());
    if (r == 0) plan.temp_dir = m["temp_dir"].get<std::string>();
    for (std::size_t i = 0; i < m["items"].size(); ++i) {
      const auto& it = m["items"][i];
      const auto name = it[0].get<std::string>();
      const DType dtype = *parse_dtype(it[1].get<std::string>());
      const Shape shape = it[2].get<Shape>();
      auto [known, inserted] = tensors.try_emplace(name, dtype, shape);
      if (!inserted && (known->second.first != dtype || known->second.second != shape))
        return Status::Error("tensor '" + name + "': rank " + std::to_string(r) + " saves it as " +
                             std::string(dtype_name(dtype)) + " " + to_string(shape) + ", another rank as " +
                             std::string(dtype_name(known->second.first)) + " " + to_string(known->second.second));
      const Piece piece = piece_from(it[3]);
      auto& u = unique[{name, it[3].dump()}];
      if (u.holders.empty()) u = {name, piece, static_cast<std::uint64_t>(piece.numel()) * dtype_size(dtype), {}};
      u.holders.push_back({r, i});
    }
  }
  std::vector<UniquePiece> pieces;
  for (auto& [key, u] : unique) pieces.push_back(std::move(u));
  TRESTLE_RETURN_IF_ERROR(check_tensors(tensors, pieces));

  // Largest pieces first, each to the least-loaded replica holding it (lowest rank on ties): the same on every rank.
  std::stable_sort(pieces.begin(), pieces.end(),
                   [](const UniquePiece& a, const UniquePiece& b) { return a.bytes > b.bytes; });
  std::vector<std::uint64_t> load(static_cast<std::size_t>(group.size()), 0);
  for (const auto& p : pieces) {
    const Holder* best = &p.holders.front();
    for (const auto& h : p.holders)
      if (load[static_cast<std::size_t>(h.rank)] < load[static_cast<std::size_t>(best->rank)]) best = &h;
    load[static_cast<std::size_t>(best->rank)] += p.bytes;
    if (best->rank == group.rank()) {
      plan.to_write.push_back(best->index);
      plan.bytes_to_write += p.bytes;
    }
  }
  return plan;
}

Result<RankChunks> write_rank_file(const std::string& temp_dir, int rank, std::span<const SaveItem> items,
                                   const std::vector<std::size_t>& to_write, const SaveOptions& options) {
  RankChunks out;
  if (to_write.empty()) return out;
  const std::string file = rank_file_name(rank);
  TRESTLE_ASSIGN_OR_RETURN(auto writer, FileWriter::create(temp_dir + "/" + file, options.io));
  for (std::size_t index : to_write) {
    const SaveItem& item = items[index];
    const std::span<const std::byte> raw(item.data, item.nbytes());
    StoredChunk chunk{item.piece, file, 0, raw.size(), options.codec, options.block_bytes, {}, {}};
    if (options.codec == Codec::kZstd) {
      TRESTLE_ASSIGN_OR_RETURN(auto encoded,
                               zstd_encode_blocks(raw, options.block_bytes, options.zstd_level, options.threads));
      chunk.block_checksums = std::move(encoded.checksums);
      chunk.block_stored_bytes = std::move(encoded.block_stored_bytes);
      chunk.stored_bytes = encoded.stored.size();
      TRESTLE_ASSIGN_OR_RETURN(chunk.byte_offset, writer->append(encoded.stored));
    } else {
      chunk.block_checksums = block_checksums(raw, options.block_bytes, options.threads);
      TRESTLE_ASSIGN_OR_RETURN(chunk.byte_offset, writer->append(raw));
    }
    out.bytes_written += chunk.stored_bytes;
    out.chunks.emplace_back(item.name, std::move(chunk));
  }
  TRESTLE_RETURN_IF_ERROR(writer->finish());
  return out;
}

Result<PreparedCommit> gather_commit(Collective& group, const std::string& root, const SavePlan& plan,
                                     const CheckpointInfo& info, std::span<const SaveItem> items,
                                     const Result<RankChunks>& mine, const SaveOptions& options) {
  std::map<std::string, const SaveItem*> by_name;
  for (const auto& it : items) by_name.emplace(it.name, &it);
  json message = {{"chunks", json::array()}, {"rank_state", info.rank_state}};
  if (!mine.ok()) message["error"] = mine.status().message();
  for (const auto& [name, chunk] : mine.ok() ? mine->chunks : decltype(mine->chunks){}) {
    const SaveItem& it = *by_name.at(name);
    message["chunks"].push_back({name, dtype_name(it.dtype), it.global_shape, chunk_to_json(chunk)});
  }
  TRESTLE_ASSIGN_OR_RETURN(const auto gathered, group.all_gather(message.dump()));

  PreparedCommit prepared;
  if (group.rank() != 0) return prepared;
  prepared.root = root;
  prepared.plan = plan;
  Status& result = prepared.status;
  Manifest& manifest = prepared.manifest;
  manifest.iteration = info.iteration;
  manifest.layout = info.layout;
  manifest.world_size = group.size();
  manifest.model = info.model;
  manifest.training = info.training;
  const bool keep_ranks = manifest.training.contains("ranks");  // e.g. an import that already has them
  if (!keep_ranks) manifest.training["ranks"] = json::array();
  for (std::size_t r = 0; r < gathered.size() && result.ok(); ++r) {
    const json m = json::parse(gathered[r]);
    if (m.contains("error")) {
      result = Status::Error("rank " + std::to_string(r) + ": " + m["error"].get<std::string>());
      break;
    }
    if (!keep_ranks) manifest.training["ranks"].push_back(m["rank_state"]);
    for (const auto& c : m["chunks"]) {
      auto& entry = manifest.tensors[c[0].get<std::string>()];
      entry.dtype = *parse_dtype(c[1].get<std::string>());
      entry.global_shape = c[2].get<Shape>();
      auto chunk = chunk_from_json(c[3], entry, "chunk table of rank " + std::to_string(r));
      if (!chunk.ok()) result = chunk.status();
      else entry.chunks.push_back(std::move(chunk).value());
    }
  }
  for (auto& [name, entry] : manifest.tensors) {
    std::sort(entry.chunks.begin(), entry.chunks.end(), [](const StoredChunk& a, const StoredChunk& b) {
      return std::tie(a.piece.box.offset, a.file, a.byte_offset) < std::tie(b.piece.box.offset, b.file, b.byte_offset);
    });
    // What the ranks wrote must hold every element once: a commit never records a gap or an overlap.
    if (result.ok()) result = check_exact_cover(entry, "tensor '" + name + "'");
  }
  for (const auto& f : info.files) {
    if (!result.ok()) break;
    result = check_recorded_file_name(f.name, "checkpoint file");
    if (result.ok() && (f.name == kManifestFile || f.name.starts_with("rank_") || manifest.files.count(f.name)))
      result = Status::Error("checkpoint file '" + f.name + "': name is reserved or given twice");
    if (!result.ok()) break;
    auto copied = copy_recorded_file(f.source, plan.temp_dir + "/" + f.name);
    if (!copied.ok()) result = copied.status();
    else manifest.files.emplace(f.name, *copied);
  }
  if (result.ok() && options.before_commit)
    result = write_file_atomically(plan.temp_dir + "/" + kManifestFile, manifest_file_text(manifest));
  return prepared;
}

Status finish_commit(int rank, PreparedCommit& prepared, const SaveOptions& options) {
  if (rank != 0) return OkStatus();
  Status result = prepared.status;
  if (result.ok() && options.before_commit) result = options.before_commit(prepared.plan.temp_dir, prepared.manifest);
  if (result.ok())
    result = commit_iteration(prepared.root, prepared.plan.temp_dir, prepared.manifest, options.overwrite);
  if (!result.ok() && prepared.plan.temp_owner) prepared.plan.temp_owner->discard();  // nothing of it stays behind
  return result;
}

Status agree_commit(Collective& group, std::int64_t iteration, const Status& committed) {
  TRESTLE_ASSIGN_OR_RETURN(const auto outcome, group.all_gather(committed.ok() ? "" : committed.message()));
  if (!outcome[0].empty())
    return Status::Error("commit of iteration " + std::to_string(iteration) + " failed: " + outcome[0]);
  return OkStatus();
}

Status commit_save(Collective& group, const std::string& root, const SavePlan& plan, const CheckpointInfo& info,
                   std::span<const SaveItem> items, const Result<RankChunks>& mine, const SaveOptions& options) {
  TRESTLE_ASSIGN_OR_RETURN(PreparedCommit prepared, gather_commit(group, root, plan, info, items, mine, options));
  return agree_commit(group, info.iteration, finish_commit(group.rank(), prepared, options));
}

Status save_checkpoint(Collective& group, const std::string& root, const CheckpointInfo& info,
                       std::span<const SaveItem> items, const SaveOptions& options) {
  TRESTLE_ASSIGN_OR_RETURN(const SavePlan plan, plan_save(group, root, info.iteration, items));
  // A failed write still joins the commit collective, so the other ranks are not left waiting.
  const auto written = write_rank_file(plan.temp_dir, group.rank(), items, plan.to_write, options);
  return commit_save(group, root, plan, info, items, written, options);
}

}  // namespace trestle
