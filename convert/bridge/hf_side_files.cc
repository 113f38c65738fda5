#include "convert/bridge/hf_side_files.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "ckpt/file_name.h"
#include "ckpt/json_file.h"
#include "ckpt/regular_file.h"

namespace trestle {
namespace fs = std::filesystem;

bool is_hf_weight_file(const std::string& name) {
  for (const char* ext : {".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth"})
    if (name.ends_with(ext)) return true;
  return false;
}

bool is_hf_side_file(const std::string& name) {
  return !name.starts_with(".") && name != "config.json" && !is_hf_weight_file(name);
}

bool is_side_file_name(const std::string& name) {
  const std::string prefix = std::string(kChatTemplatesDir) + "/";
  return is_plain_file_name(name.starts_with(prefix) ? std::string_view(name).substr(prefix.size()) : name);
}

std::vector<std::string> hf_side_files(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!is_hf_side_file(name)) continue;
    // A subfolder (original/, onnx/) holds no side file, but for the chat templates'; anything else is listed, so that
    // one which cannot be copied (a dangling link, a FIFO, a directory named like a file: tokenizer.json/) fails
    // naming it, never goes missing.
    std::error_code type_ec;
    if (name == kChatTemplatesDir && it->is_directory(type_ec)) {
      std::error_code inner_ec;
      for (fs::directory_iterator file(it->path(), inner_ec), last; !inner_ec && file != last; file.increment(inner_ec))
        if (const std::string inner = file->path().filename().string(); !inner.starts_with("."))
          names.push_back(name + "/" + inner);
      continue;
    }
    if (it->is_directory(type_ec) && name.find('.') == std::string::npos) continue;
    names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

namespace {

// Whether `path` lies strictly below `root` (both canonical).
bool inside(const fs::path& path, const fs::path& root) {
  const auto [r, p] = std::mismatch(root.begin(), root.end(), path.begin(), path.end());
  return r == root.end() && p != path.end();
}

// The blobs/ directory beside the snapshots/ directory that `dir` (canonical) lies in: <repo>/blobs for
// <repo>/snapshots/<rev>[/<subfolder>...]; empty when `dir` is not in a hub cache snapshot. The hub makes blobs/ a real
// directory; one that is a link (blobs -> /etc) could lead anywhere, so it is no cache's.
fs::path hub_cache_blobs(const fs::path& dir) {
  for (fs::path p = dir; p.has_relative_path(); p = p.parent_path()) {
    if (p.parent_path().filename() != "snapshots") continue;
    const fs::path blobs = p.parent_path().parent_path() / "blobs";
    std::error_code ec;
    return fs::is_directory(fs::symlink_status(blobs, ec)) ? blobs : fs::path();
  }
  return {};
}

}  // namespace

Status check_hf_file_link(const std::string& dir, const std::string& name) {
  const fs::path path = fs::path(dir) / name;
  std::error_code ec;
  if (!fs::is_symlink(fs::symlink_status(path, ec))) return OkStatus();
  const fs::path link = fs::read_symlink(path, ec);
  const fs::path target = fs::canonical(path, ec);
  if (ec)
    return Status::Error(path.string() + ": a symbolic link to " + link.string() +
                         " that cannot be followed: " + ec.message());
  const fs::path root = fs::canonical(dir, ec);
  if (!ec && inside(target, root)) return OkStatus();
  // root is canonical, so the repository directory above blobs/ is real and blobs/ itself is checked to be.
  const fs::path blobs = ec ? fs::path() : hub_cache_blobs(root);
  if (!blobs.empty() && inside(target, blobs)) return OkStatus();
  return Status::Error(path.string() + ": a symbolic link to " + target.string() +
                       ", outside the model directory and not into a Hugging Face cache's blobs/; refused, so that no "
                       "file from elsewhere is carried into the checkpoint (copy the file into the directory if it "
                       "belongs there)");
}

Status check_hf_dir_links(const std::string& dir) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::error_code type_ec;
    const bool read = is_hf_side_file(name) || name == "config.json" || is_hf_weight_file(name);
    if (!read || !it->is_symlink(type_ec)) continue;
    if (name == kChatTemplatesDir) {  // its files are read through it
      TRESTLE_RETURN_IF_ERROR(check_hf_file_link(dir, name));
      continue;
    }
    if (!fs::is_regular_file(it->path(), type_ec)) continue;  // a dangling link, or one to a directory, is never read
    TRESTLE_RETURN_IF_ERROR(check_hf_file_link(dir, name));
  }
  for (const std::string& name : hf_side_files(dir))
    if (name.find('/') != std::string::npos) TRESTLE_RETURN_IF_ERROR(check_hf_file_link(dir, name));
  return OkStatus();
}

namespace {

// `side`: a side file's name is not one a converter writes itself (config.json: the caller's own copy of it).
Status check_side_file(const std::string& from, const std::string& name, SideFileLinks links, bool side = true) {
  const fs::path source = fs::path(from) / name;
  if (!is_side_file_name(name))
    return Status::Error(source.string() + ": side file name '" + name + "' is not a plain file name (or one in " +
                         kChatTemplatesDir + "/)");
  // A side file travels beside the files a converter writes (config.json, the weights), never in their place.
  if (side && !is_hf_side_file(fs::path(name).filename().string()))
    return Status::Error(source.string() + ": '" + name +
                         "' cannot be a side file: it is config.json, a weights file or a hidden one, which a "
                         "converter writes itself");
  const bool in_subfolder = name.find('/') != std::string::npos;
  if (links == SideFileLinks::kFollow) {
    if (in_subfolder) TRESTLE_RETURN_IF_ERROR(check_hf_file_link(from, kChatTemplatesDir));
    TRESTLE_RETURN_IF_ERROR(check_hf_file_link(from, name));
  } else {
    TRESTLE_RETURN_IF_ERROR(refuse_checkpoint_link(from));  // the checkpoint's hf_files/ directory itself
    if (in_subfolder) TRESTLE_RETURN_IF_ERROR(refuse_checkpoint_link((fs::path(from) / kChatTemplatesDir).string()));
  }
  std::error_code ec;
  const fs::file_status status =
      links == SideFileLinks::kFollow ? fs::status(source, ec) : fs::symlink_status(source, ec);
  if (ec) return Status::Error(source.string() + ": cannot read side file: " + ec.message());
  if (fs::is_symlink(status))
    return Status::Error(source.string() + ": side file is a symbolic link (a checkpoint's own files are never links)");
  if (!fs::is_regular_file(status)) return Status::Error(source.string() + ": side file is not a regular file");
  // A JSON side file (tokenizer, generation config, ...) must parse: transformers refuses to load a model whose
  // generation_config.json does not, and a converted copy would carry it on unnoticed.
  // (Parsed as it is read, whatever its size: nothing of it is held.)
  if (name.ends_with(".json")) {
    std::ifstream in(source, std::ios::binary);
    if (!in) return Status::Error(source.string() + ": cannot open side file: " + std::strerror(errno));
    if (!nlohmann::json::accept(in))
      return Status::Error(source.string() + ": not valid JSON (transformers would refuse to load it)");
  }
  return OkStatus();
}

}  // namespace

Result<std::vector<CheckpointInfo::File>> side_files_to_record(const std::string& from,
                                                               const std::vector<std::string>& names,
                                                               SideFileLinks links) {
  std::vector<CheckpointInfo::File> files;
  for (const auto& name : names) {
    TRESTLE_RETURN_IF_ERROR(check_side_file(from, name, links));
    files.push_back({std::string(kSideFilesDir) + "/" + name, (fs::path(from) / name).string()});
  }
  return files;
}

namespace {

Status copy_checked_files(const std::string& from, const std::string& to, const std::vector<std::string>& names,
                          SideFileLinks links, bool side) {
  if (names.empty()) return OkStatus();
  std::error_code ec;
  fs::create_directories(to, ec);
  if (ec) return Status::Error(to + ": cannot create directory: " + ec.message());
  for (const auto& name : names) {
    TRESTLE_RETURN_IF_ERROR(check_side_file(from, name, links, side));
    const fs::path source = fs::path(from) / name;
    if (name.find('/') != std::string::npos) {
      fs::create_directories((fs::path(to) / name).parent_path(), ec);
      if (ec) return Status::Error((fs::path(to) / name).parent_path().string() + ": cannot create: " + ec.message());
    }
    fs::copy_file(source, fs::path(to) / name, fs::copy_options::overwrite_existing, ec);
    if (ec) return Status::Error((fs::path(to) / name).string() + ": cannot copy side file: " + ec.message());
  }
  return OkStatus();
}

}  // namespace

Status copy_side_files(const std::string& from, const std::string& to, const std::vector<std::string>& names,
                       SideFileLinks links) {
  return copy_checked_files(from, to, names, links, /*side=*/true);
}

Status copy_hf_config_file(const std::string& from, const std::string& to) {
  return copy_checked_files(from, to, {"config.json"}, SideFileLinks::kFollow, /*side=*/false);
}

}  // namespace trestle
