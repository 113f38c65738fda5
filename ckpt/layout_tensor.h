// A tensor of a checkpoint as a layout sees it (name, dtype, canonical global shape) and one rank's piece of it: the
// vocabulary shared by checkpoint readers (canonical sources), the layout description and the multi-rank writer.
#pragma once

#include <cstddef>
#include <string>

#include "ckpt/box.h"
#include "ckpt/dtype.h"

namespace trestle {

struct LayoutTensor {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;  // global
};

struct RankPiece {
  std::size_t tensor;  // index into the tensor list
  Piece piece;
};

}  // namespace trestle
