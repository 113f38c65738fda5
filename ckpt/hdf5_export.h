// HDF5 interchange for Trestle checkpoints: one dataset per tensor (global shape, row-major), named as the tensor,
// with a "dtype" attribute giving the Trestle dtype. Types h5py reads natively are stored natively (f16/f32/f64,
// integers); bf16 and fp8 are stored as their raw bit patterns (u16 / u8) and bool as u8, so every value survives
// bit for bit. The root's "trestle_manifest" attribute keeps iteration, layout, model and training state as JSON, its
// "tensors" each dataset's dtype and global shape (no chunks) and its "files" the carried files' sizes and digests.
// Carried files (hf_files/...) are 1-d u8 datasets in the group "trestle_files", each with a "name" attribute.
//
// Import reads nothing it has not checked: every dataset must have its storage allocated in full (one never written
// reads as its fill value) and, unfiltered, as many stored bytes as its shape needs; when the header lists tensors,
// the datasets must be exactly those, with the listed dtype and shape (a file without the list, as h5py users write,
// is taken as its datasets); carried files must match the header's names, sizes and digests.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "ckpt/layout_tensor.h"
#include "ckpt/load.h"

namespace trestle {

struct Hdf5Report {
  std::size_t tensors = 0;
  std::uint64_t bytes = 0;
};

// Streams the checkpoint a tensor at a time into a new HDF5 file at path (written beside it, then renamed).
Result<Hdf5Report> export_hdf5(const CheckpointReader& reader, const std::string& path);
// The caller's own check of the file's header and datasets (the model description's accounting lives above ckpt/),
// run after the checks above and before any tensor data is read. True: the import replaces the iteration already in
// the root (see take_untracked_commit), else an existing one is an error.
using Hdf5ImportCheck = std::function<Result<bool>(const Manifest& header, const std::vector<LayoutTensor>& tensors)>;

// Reads an exported file back and saves it as iteration `iteration` (or the file's own) of a checkpoint at root,
// holding one tensor at a time.
Result<Hdf5Report> import_hdf5(const std::string& path, const std::string& root, std::optional<std::int64_t> iteration,
                               const Hdf5ImportCheck& check = {});

}  // namespace trestle
