// Megatron's --pipeline-model-parallel-layout: a string of the virtual pipeline stages in layer order, separated by
// '|', each a run of E (embedding), t (a decoder layer), m (an MTP layer) and L (the output layer and loss), with
// "x*n" and "(...)*n" repeats and cosmetic commas (megatron-core's PipelineParallelLayerLayout.parse_str_to_list).
// Entry v·pp + s is virtual chunk v of pipeline stage s. Parsed and checked as megatron-core's validate_layer_layout
// checks it, then as Trestle runs it: the embedding in the first stage's first chunk, the loss (with the MTP layers,
// if any) in the last stage's last chunk. And Megatron's other way to spell such a split, the embedding and loss
// counted as layers of an even split.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/status.h"

namespace trestle {

struct PipelineLayoutString {
  int vpp = 1;                             // virtual chunks per stage: the entries / pp
  std::vector<std::int64_t> chunk_layers;  // decoder layers of each entry, in the string's order (ParallelLayout's)
};

// Errors name the layout and what it breaks: an unknown character, entries not a multiple of pp, decoder or MTP
// layers other than the model's, the embedding or loss misplaced or repeated, MTP layers before a decoder layer, split
// over chunks or in a chunk of their own.
Result<PipelineLayoutString> parse_pipeline_layout(const std::string& layout, int pp, std::int64_t num_layers,
                                                   std::int64_t mtp_num_layers);

// The layout string of these counts (layout order) for a model with `mtp_layers` MTP layers: E first, the MTP
// layers and L last, "t" repeated in each virtual stage.
std::string pipeline_layout_string(const std::vector<std::int64_t>& chunk_layers, std::int64_t mtp_layers);

// Megatron's --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split: the embedding and the
// loss each count as one layer when the layers are split evenly over the pp x vpp virtual stages, so the first (last)
// virtual stage holds one decoder layer fewer (megatron-core's get_num_layers_to_build). The counts in layout order,
// as PipelineLayoutString::chunk_layers; errors say what does not divide.
Result<std::vector<std::int64_t>> accounted_chunk_layers(std::int64_t num_layers, int pp, int vpp, bool embedding,
                                                         bool loss);

}  // namespace trestle
