// The files of a Hugging Face model directory that travel with a converted checkpoint: everything that is neither a
// weights file nor config.json (tokenizer, generation config, chat template, ...). One rule for every converter.
#pragma once

#include <string>
#include <vector>

#include "ckpt/status.h"

namespace trestle {

// Weights in any of Hugging Face's formats (safetensors and PyTorch .bin / .pt, with their index files).
bool is_hf_weight_file(const std::string& name);
// Neither weights, nor config.json, nor hidden.
bool is_hf_side_file(const std::string& name);

// The side files of `dir` (regular files only, symlinks left out), sorted; empty when dir is not a directory.
std::vector<std::string> hf_side_files(const std::string& dir);

// Copies `names` from directory `from` into directory `to` (created when missing). Each name must be a plain file name
// (no directory part, not '.' or '..') of a regular file that is not a symlink; errors name the file and the reason.
Status copy_side_files(const std::string& from, const std::string& to, const std::vector<std::string>& names);

}  // namespace trestle
