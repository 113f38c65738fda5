#include "convert/formats/torch/megatron_legacy.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/crc32.h"
#include "ckpt/file_range_read.h"
#include "ckpt/regular_file.h"

namespace trestle {
namespace {

namespace fs = std::filesystem;

// Walks dicts, lists and tuples, naming each tensor by its path ("model.decoder.layers.0.weight"); every other leaf
// goes into `others` with a short description of its value.
Status collect(const TorchSaveArchive& archive, const PickleValue* v, const std::string& prefix, int depth,
               std::vector<LegacyTensor>& out, std::map<std::string, std::string>& others) {
  if (depth > kPickleMaxDepth)
    return Status::Error(archive.context() + ": state dict nested deeper than " + std::to_string(kPickleMaxDepth) +
                         " at '" + prefix + "'");
  TRESTLE_ASSIGN_OR_RETURN(auto ref, archive.tensor(v, prefix));
  if (ref) {
    out.push_back({prefix, std::move(*ref)});
    return OkStatus();
  }
  auto join = [&](const std::string& key) { return prefix.empty() ? key : prefix + "." + key; };
  if (v->kind == PickleKind::kDict) {
    for (const auto& [k, item] : v->entries) {
      std::string key;
      if (k->kind == PickleKind::kString) key = k->text;
      else if (k->kind == PickleKind::kInt) key = std::to_string(k->integer);
      else continue;
      TRESTLE_RETURN_IF_ERROR(collect(archive, item, join(key), depth + 1, out, others));
    }
  } else if (v->is_sequence()) {
    for (std::size_t i = 0; i < v->items.size(); ++i)
      TRESTLE_RETURN_IF_ERROR(collect(archive, v->items[i], join(std::to_string(i)), depth + 1, out, others));
  } else {
    others.emplace(prefix, pickle_repr(v, 60));
  }
  return OkStatus();
}

// A whole decimal iteration number, or nothing.
std::optional<std::int64_t> parse_iteration(std::string_view text) {
  std::int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < 0) return std::nullopt;
  return value;
}

bool has_mp_rank_dirs(const fs::path& dir) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code type_ec;
    if (it->is_directory(type_ec) && parse_mp_rank_dir(it->path().filename().string())) return true;
  }
  return false;
}

// What a legacy root's iteration directories (iter_* and release) hold: the names of those with mp_rank_*
// directories, in name order, and whether any holds another format's checkpoint (manifest.json, torch_dist .metadata).
struct SavedIterations {
  std::vector<std::string> legacy;
  bool other_formats = false;
};

SavedIterations saved_iterations(const fs::path& root) {
  SavedIterations saved;
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::error_code type_ec;
    if ((!name.starts_with("iter_") && name != "release") || !it->is_directory(type_ec)) continue;
    if (has_mp_rank_dirs(it->path())) saved.legacy.push_back(name);
    else if (fs::exists(it->path() / kManifestFile, type_ec) || fs::exists(it->path() / ".metadata", type_ec))
      saved.other_formats = true;
  }
  std::sort(saved.legacy.begin(), saved.legacy.end());
  return saved;
}

}  // namespace

std::optional<LegacyRankId> parse_mp_rank_dir(const std::string& name) {
  if (name.rfind("mp_rank_", 0) != 0) return std::nullopt;
  std::vector<int> parts;
  std::size_t at = 8;
  while (at <= name.size()) {
    const std::size_t end = std::min(name.find('_', at), name.size());
    const std::string part = name.substr(at, end - at);
    if (part.empty() || part.size() > 4 || !std::all_of(part.begin(), part.end(), ::isdigit)) return std::nullopt;
    parts.push_back(std::stoi(part));
    at = end + 1;
  }
  if (parts.empty() || parts.size() > 3) return std::nullopt;
  LegacyRankId id;
  id.tp = parts[0];
  if (parts.size() > 1) id.pp = parts[1];
  if (parts.size() > 2) id.ep = parts[2];
  return id;
}

bool is_legacy_checkpoint(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return false;
  if (has_mp_rank_dirs(path)) return true;
  const auto tracker = read_tracker(path);  // an unreadable one is reported by whoever reads the root
  if (!tracker.ok() || !tracker->present) return false;
  if (has_mp_rank_dirs(tracked_iteration_dir(path, *tracker))) return true;
  // A tracker naming an iteration that is not here, in a root whose saved iterations are legacy ones: still a legacy
  // tree, so that its reader says what the tracker names and which iterations are saved.
  const SavedIterations saved = saved_iterations(path);
  return !saved.legacy.empty() && !saved.other_formats;
}

Result<LegacyCheckpoint> find_legacy_checkpoint(const std::string& path) {
  LegacyCheckpoint ckpt;
  fs::path dir = path;
  if (!has_mp_rank_dirs(dir)) {
    TRESTLE_ASSIGN_OR_RETURN(const Tracker tracker, read_tracker(path));
    if (!tracker.present)
      return Status::Error(path + ": neither mp_rank_* directories nor a latest_checkpointed_iteration.txt tracker");
    dir = tracked_iteration_dir(path, tracker);
    TRESTLE_RETURN_IF_ERROR(refuse_checkpoint_link(dir.string()));
    if (!tracker.release) ckpt.iteration = tracker.iteration;
    if (!has_mp_rank_dirs(dir)) {
      const std::string named = tracker.release ? "'release'" : "iteration " + std::to_string(tracker.iteration);
      std::string saved;
      for (const auto& name : saved_iterations(path).legacy) saved += (saved.empty() ? "" : ", ") + name;
      return Status::Error(dir.string() + ": " + named + ", which " + (fs::path(path) / kTrackerFile).string() +
                           " names, is not a legacy checkpoint here (no mp_rank_* directories" +
                           (saved.empty() ? ")" : "; saved: " + saved + ")"));
    }
  } else {
    const std::string base = dir.filename().string();
    // A directory named otherwise (not iter_<number>) leaves the iteration unknown.
    if (base.starts_with("iter_")) ckpt.iteration = parse_iteration(std::string_view(base).substr(5));
  }
  ckpt.directory = dir.string();
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const auto id = parse_mp_rank_dir(it->path().filename().string());
    std::error_code type_ec;
    if (!id) continue;
    TRESTLE_RETURN_IF_ERROR(refuse_checkpoint_link(it->path().string()));
    if (!it->is_directory(type_ec)) continue;
    const fs::path file = it->path() / "model_optim_rng.pt";
    TRESTLE_RETURN_IF_ERROR(refuse_checkpoint_link(file.string()));
    const fs::file_status status = fs::symlink_status(file, type_ec);
    if (!fs::exists(status)) return Status::Error(it->path().string() + ": no model_optim_rng.pt");
    if (!fs::is_regular_file(status))
      return Status::Error(file.string() + ": not a regular file (" +
                           (fs::is_directory(status) ? "a directory" : "a special file") + ")");
    ckpt.rank_files.emplace_back(*id, file.string());
  }
  if (ec) return Status::Error(dir.string() + ": cannot list: " + ec.message());
  std::sort(ckpt.rank_files.begin(), ckpt.rank_files.end(), [](const auto& a, const auto& b) {
    return std::tie(a.first.pp, a.first.tp, a.first.ep) < std::tie(b.first.pp, b.first.tp, b.first.ep);
  });
  return ckpt;
}

Result<LegacyRankFile> LegacyRankFile::open(const std::string& path, LegacyRankId id) {
  LegacyRankFile f;
  f.path_ = path;
  f.id_ = id;
  TRESTLE_ASSIGN_OR_RETURN(MappedFile mapped, MappedFile::open(path, /*random_access=*/true));
  f.file_ = std::make_shared<MappedFile>(std::move(mapped));
  f.direct_ = std::make_shared<DirectReads>();
  TRESTLE_ASSIGN_OR_RETURN(TorchSaveArchive archive, TorchSaveArchive::parse(f.file_->bytes(), path));
  f.archive_ = std::make_shared<TorchSaveArchive>(std::move(archive));
  if (!f.root() || f.root()->kind != PickleKind::kDict)
    return Status::Error(path + ": expected a dict at the top level, found " + pickle_repr(f.root(), 80));
  TRESTLE_RETURN_IF_ERROR(collect(*f.archive_, f.root(), "", 0, f.tensors_, f.non_tensors_));
  return f;
}

std::optional<std::int64_t> LegacyRankFile::iteration() const {
  const PickleValue* v = root()->get("iteration");
  if (v && v->kind == PickleKind::kInt) return v->integer;
  return std::nullopt;
}

std::optional<double> LegacyRankFile::checkpoint_version() const {
  const PickleValue* v = root()->get("checkpoint_version");
  if (v && v->kind == PickleKind::kFloat) return v->real;
  if (v && v->kind == PickleKind::kInt) return static_cast<double>(v->integer);
  return std::nullopt;
}

std::vector<std::string> LegacyRankFile::model_keys() const {
  std::vector<std::string> keys;
  for (const auto& [k, v] : root()->entries) {
    if (k->kind != PickleKind::kString) continue;
    const std::string& s = k->text;
    if (s == "model" || (s.size() > 5 && s.rfind("model", 0) == 0 && std::all_of(s.begin() + 5, s.end(), ::isdigit)))
      keys.push_back(s);
  }
  return keys;
}

const LegacyTensor* LegacyRankFile::find(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

std::string LegacyRankFile::no_tensor(const std::string& name) const {
  const auto other = non_tensors_.find(name);
  if (other == non_tensors_.end()) return "no tensor '" + name + "'";
  return "'" + name + "' is not a tensor (it holds " + other->second + ")";
}

struct LegacyRankFile::DirectReads {
  ReadFiles file;
  std::mutex mu;  // buffer, verified
  AlignedBuffer buffer;
  std::set<std::string> verified;  // storage records whose zip CRC-32 matched
};

// Checks the zip CRC-32 of the record behind `ref`, once per record: over `copied` (the tensor's row-major bytes) when
// the tensor is its whole record, else over the record read through (small ones from the archive's bytes).
Status LegacyRankFile::verify_record(const TorchTensorRef& ref, const std::byte* copied,
                                     const std::string& what) const {
  const ZipEntry* record = archive_->zip().find("data/" + ref.storage_key);
  if (!record) return Status::Error(path_ + ": " + what + ": storage record data/" + ref.storage_key + " is missing");
  std::lock_guard lock(direct_->mu);
  if (direct_->verified.count(ref.storage_key)) return OkStatus();
  const std::size_t es = dtype_size(ref.dtype);
  std::uint32_t crc = 0;
  const std::uint64_t numel = static_cast<std::uint64_t>(trestle::numel(ref.shape));
  if (ref.contiguous() && ref.storage_offset == 0 && numel * es == record->size) {
    crc = crc32(std::span(copied, static_cast<std::size_t>(record->size)));
  } else if (record->size < kDirectReadMinBytes) {
    crc = crc32(archive_->bytes().subspan(static_cast<std::size_t>(record->data_offset),
                                          static_cast<std::size_t>(record->size)));
  } else {
    TRESTLE_ASSIGN_OR_RETURN(const OpenedFile file, direct_->file.get(path_));
    constexpr std::uint64_t kWindow = std::uint64_t{16} << 20;
    for (std::uint64_t done = 0; done < record->size; done += kWindow) {
      const std::uint64_t n = std::min(kWindow, record->size - done);
      TRESTLE_ASSIGN_OR_RETURN(const std::size_t first,
                               read_file_range(file, path_, record->data_offset + done, n, direct_->buffer, what));
      crc = crc32(std::span(direct_->buffer.data() + first, static_cast<std::size_t>(n)), crc);
    }
  }
  if (crc != record->crc32)
    return Status::Error(path_ + ": " + what + ": the data's CRC-32 is " + std::to_string(crc) +
                         ", its zip record says " + std::to_string(record->crc32) + " (the file is corrupt)");
  direct_->verified.insert(ref.storage_key);
  return OkStatus();
}

Status LegacyRankFile::read(const std::string& name, std::byte* dst) const {
  const LegacyTensor* t = find(name);
  if (!t) return Status::Error(path_ + ": " + no_tensor(name));
  const TorchTensorRef& ref = t->ref;
  const std::size_t es = dtype_size(ref.dtype);
  const std::string what = "tensor '" + name + "'";
  if (strided_span_bytes(ref.shape, ref.stride, es) >= kDirectReadMinBytes) {
    // Large tensors bypass the page cache: their span is read with O_DIRECT, then copied out.
    TRESTLE_ASSIGN_OR_RETURN(const OpenedFile file, direct_->file.get(path_));
    std::lock_guard lock(direct_->mu);
    TRESTLE_RETURN_IF_ERROR(
        copy_strided_from_file(file, path_, ref.data_offset + static_cast<std::uint64_t>(ref.storage_offset) * es,
                               ref.stride, dst, contiguous_strides(ref.shape), ref.shape, es, direct_->buffer, what));
  } else {
    archive_->copy_tensor(ref, dst);
  }
  return verify_record(ref, dst, what);
}

}  // namespace trestle
