// The files of a Hugging Face model directory that travel with a converted checkpoint: everything that is neither a
// weights file nor config.json (tokenizer, generation config, chat template, ...). One rule for every converter.
#pragma once

#include <string>
#include <vector>

#include "ckpt/save.h"
#include "ckpt/status.h"

namespace trestle {

// Where a converted checkpoint keeps them: <iteration>/hf_files/ in a Trestle checkpoint (older ones:
// <root>/hf_files/), <iter_N>/hf_files/ in torch_dist.
inline constexpr const char* kSideFilesDir = "hf_files";

// Weights in any of Hugging Face's formats (safetensors and PyTorch .bin / .pt, with their index files).
bool is_hf_weight_file(const std::string& name);
// Neither weights, nor config.json, nor hidden.
bool is_hf_side_file(const std::string& name);

// The one subfolder whose files travel too: transformers (>= 4.54) saves a tokenizer's named chat templates beyond the
// default one as additional_chat_templates/<name>.jinja.
inline constexpr const char* kChatTemplatesDir = "additional_chat_templates";
// A side file's name as listed and recorded: a plain file name, or one in kChatTemplatesDir ("<dir>/<plain name>").
bool is_side_file_name(const std::string& name);

// The side files of `dir` (regular files, or links to them: a Hugging Face cache snapshot is made of links), sorted;
// empty when dir is not a directory. Entries that are not regular files are listed too (except subfolders, whose
// names have no extension), so that copying them fails naming them rather than leaving them out. The files of
// kChatTemplatesDir are listed as "additional_chat_templates/<name>".
std::vector<std::string> hf_side_files(const std::string& dir);

// Whether file `name` of Hugging Face model directory `dir` may be read: a regular file, or a symbolic link that
// resolves inside `dir` or into the blobs/ directory of the hub cache `dir` is a snapshot of (the cache's layout:
// models--org--name/{blobs/<hash>, snapshots/<rev>/<name> -> ../../blobs/<hash>}). A link anywhere else is refused,
// naming the file and its target, so that a cloned repository cannot carry a file of the user's (~/.ssh/id_rsa) into a
// checkpoint they share.
Status check_hf_file_link(const std::string& dir, const std::string& name);

// check_hf_file_link for every file of `dir` a converter may read: config.json, the weights and the side files.
Status check_hf_dir_links(const std::string& dir);

// Whether a side file may be a symbolic link: in a Hugging Face directory, as check_hf_file_link allows (cache
// snapshots link every file to a blob); never inside a checkpoint that Trestle wrote (its hf_files/ holds copies).
enum class SideFileLinks { kFollow, kRefuse };

// Copies `names` from directory `from` into directory `to` (created when missing). Each name must be a plain file name
// (no directory part, not '.' or '..') of a regular file, and a side file's (not config.json, a weights file or a
// hidden one, which a converter writes itself); errors name the file and the reason.
Status copy_side_files(const std::string& from, const std::string& to, const std::vector<std::string>& names,
                       SideFileLinks links);
// The same checks and copy for a Hugging Face directory's config.json (links followed as check_hf_file_link allows).
Status copy_hf_config_file(const std::string& from, const std::string& to);

// The same files as a Trestle checkpoint records them (checked the same way): "hf_files/<name>" in the iteration,
// copied in before the commit.
Result<std::vector<CheckpointInfo::File>> side_files_to_record(const std::string& from,
                                                               const std::vector<std::string>& names,
                                                               SideFileLinks links);

}  // namespace trestle
