// Full activation recompute of one layer (torch.utils.checkpoint's reentrant form in C++): the forward runs without
// keeping activations and saves only the layer's input; the backward runs the layer forward again with autograd on
// and back-propagates through it, accumulating the parameters' gradients and returning the input's. Collectives
// inside the layer run again in the same order on every rank. The layer and context must outlive the backward. Gemma
// 4's per-layer inputs in the context are an input of the recomputed function too (their gradient returned), and its
// shared keys and values an output of the layer that makes them and an input of each layer that reuses them (stored in
// the context's shared_kv with that function's autograd history).
#pragma once

#include <ATen/Tensor.h>

#include "train/model/transformer_layer.h"

namespace trestle::train {

at::Tensor recomputed_layer_forward(const TransformerLayer& layer, const at::Tensor& x, const LayerContext& context);

}  // namespace trestle::train
