// HDF5 interchange for Trestle checkpoints: one dataset per tensor (global shape, row-major), named as the tensor,
// with a "dtype" attribute giving the Trestle dtype. Types h5py reads natively are stored natively (f16/f32/f64,
// integers); bf16 and fp8 are stored as their raw bit patterns (u16 / u8) and bool as u8, so every value survives
// bit for bit. The root's "trestle_manifest" attribute keeps iteration, layout, model and training state as JSON.
#pragma once

#include <string>

#include "ckpt/load.h"

namespace trestle {

struct Hdf5Report {
  std::size_t tensors = 0;
  std::uint64_t bytes = 0;
};

// Streams the checkpoint a tensor at a time into a new HDF5 file at path (written beside it, then renamed).
Result<Hdf5Report> export_hdf5(const CheckpointReader& reader, const std::string& path);
// Reads an exported file back and saves it as iteration `iteration` (or the file's own) of a checkpoint at root.
Result<Hdf5Report> import_hdf5(const std::string& path, const std::string& root, std::optional<std::int64_t> iteration);

}  // namespace trestle
