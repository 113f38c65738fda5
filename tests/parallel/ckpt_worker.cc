// One rank of a multi-process checkpoint test: `ckpt_worker save|load ROOT STORE_FILE WORLD RANK [zstd] [store]
// [async]`. Ranks meet through a c10d FileStore and talk through a Gloo process group (or, with `store`, through the
// store). The model state is synthetic but laid out as Megatron lays it out for world W: tp = W / 2 (1 for W = 1), dp =
// W / tp; column-parallel tensors split dim 0 and row-parallel ones dim 1 across TP, norms and step counters are
// replicated, and Adam moments are distributed-optimizer flat shards of each rank's TP piece across DP. save writes it
// (with `async`, twice through AsyncSaver); load loads every piece of the loading layout and compares bytes.
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/async_saver.h"
#include "ckpt/load.h"
#include "ckpt/save.h"
#include "parallel/process_group_collective.h"
#include "parallel/store_collective.h"
#include "tests/support/global_tensor.h"

namespace trestle {
namespace {

using testing::GlobalTensor;

struct Slot {
  const GlobalTensor* tensor;
  Piece piece;
};

std::vector<GlobalTensor> model_state() {
  return {GlobalTensor("embedding.word_embeddings.weight", DType::kBF16, {50, 12}, 1),
          GlobalTensor("decoder.layers.0.self_attention.linear_qkv.weight", DType::kF32, {24, 12}, 2),
          GlobalTensor("decoder.layers.0.self_attention.linear_proj.weight", DType::kF32, {12, 24}, 3),
          GlobalTensor("decoder.final_layernorm.weight", DType::kF32, {12}, 4),
          GlobalTensor("optimizer.exp_avg.decoder.layers.0.self_attention.linear_qkv.weight", DType::kF32, {24, 12}, 5),
          GlobalTensor("optimizer.step", DType::kI64, {}, 6)};
}

std::vector<Slot> my_pieces(const std::vector<GlobalTensor>& state, int world, int rank) {
  const int tp = world > 1 ? world / 2 : 1, dp = world / tp;
  const int tp_rank = rank % tp, dp_rank = rank / tp;
  return {{&state[0], testing::split_part(state[0].shape, 0, tp, tp_rank)},
          {&state[1], testing::split_part(state[1].shape, 0, tp, tp_rank)},
          {&state[2], testing::split_part(state[2].shape, 1, tp, tp_rank)},
          {&state[3], Piece{whole_box(state[3].shape), std::nullopt}},
          {&state[4], testing::flat_part(testing::split_part(state[4].shape, 0, tp, tp_rank), dp, dp_rank)},
          {&state[5], Piece{whole_box(state[5].shape), std::nullopt}}};
}

std::unique_ptr<Collective> connect(const std::string& store, int world, int rank, bool over_store) {
  auto rendezvous = parallel::rendezvous_with_file(store, rank, world);
  if (!rendezvous.ok()) {
    std::fprintf(stderr, "%s\n", rendezvous.status().message().c_str());
    return nullptr;
  }
  if (over_store) return std::make_unique<parallel::StoreCollective>(rendezvous->store, rank, world);
  auto gloo = parallel::make_gloo_backend(*rendezvous);
  if (!gloo.ok()) {
    std::fprintf(stderr, "%s\n", gloo.status().message().c_str());
    return nullptr;
  }
  return std::make_unique<parallel::ProcessGroupCollective>(*gloo);
}

int save_or_load(Collective& group, const std::string& mode, const std::string& root, int world, int rank, bool zstd,
                 bool async) {
  const auto state = model_state();
  const auto pieces = my_pieces(state, world, rank);
  std::vector<std::vector<std::byte>> data;
  for (const auto& s : pieces) data.push_back(s.tensor->extract(s.piece));

  if (mode == "save") {
    std::vector<SaveItem> items;
    for (std::size_t i = 0; i < pieces.size(); ++i)
      items.push_back(
          {pieces[i].tensor->name, pieces[i].tensor->dtype, pieces[i].tensor->shape, pieces[i].piece, data[i].data()});
    CheckpointInfo info;
    info.iteration = 1000 + world;
    const int tp = world > 1 ? world / 2 : 1;
    info.layout = {{"tp", tp}, {"dp", world / tp}};
    info.rank_state = {{"rank", rank}};
    SaveOptions options;
    options.codec = zstd ? Codec::kZstd : Codec::kRaw;
    options.block_bytes = 256;  // many blocks even for small tensors
    options.io.queue_depth = 16;
    options.io.request_bytes = 1 << 20;
    Status s;
    if (async) {
      // Two saves in a row: the second waits for the first, whose commit collective runs inside it.
      AsyncSaver saver;
      CheckpointInfo earlier = info;
      earlier.iteration = 1;
      s = saver.save_async(group, root, earlier, items, options);
      if (s.ok()) s = saver.save_async(group, root, info, items, options);
      if (s.ok()) s = saver.finalize();
    } else {
      s = save_checkpoint(group, root, info, items, options);
    }
    if (!s.ok()) std::fprintf(stderr, "rank %d: %s\n", rank, s.message().c_str());
    return s.ok() ? 0 : 1;
  }
  IoOptions io;
  io.queue_depth = 16;
  io.request_bytes = 1 << 20;
  auto reader = CheckpointReader::open(root, std::nullopt, io);
  if (!reader.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, reader.status().message().c_str());
    return 1;
  }
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    std::vector<std::byte> got(data[i].size(), std::byte{0xee});
    const LoadRequest request{pieces[i].tensor->name, pieces[i].piece, got.data()};
    const Status s = reader->load({&request, 1});
    if (!s.ok() || got != data[i]) {
      std::fprintf(stderr, "rank %d of %d: %s %s: %s\n", rank, world, pieces[i].tensor->name.c_str(),
                   to_string(pieces[i].piece).c_str(), s.ok() ? "bytes differ" : s.message().c_str());
      return 1;
    }
  }
  const auto& ranks = reader->manifest().training["ranks"];
  if (ranks.size() != static_cast<std::size_t>(reader->manifest().world_size)) {
    std::fprintf(stderr, "rank %d: manifest lists %zu rank states\n", rank, ranks.size());
    return 1;
  }
  return 0;
}

int run(const std::string& mode, const std::string& root, const std::string& store, int world, int rank, bool zstd,
        bool over_store, bool async) {
  const auto group = connect(store, world, rank, over_store);
  if (!group) return 1;
  const int code = save_or_load(*group, mode, root, world, rank, zstd, async);
  // Ranks leave together: one that exits while the others are still connecting breaks their process group.
  const auto done = group->all_gather(std::to_string(code));
  if (!done.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, done.status().message().c_str());
    return 1;
  }
  return code;
}

}  // namespace
}  // namespace trestle

int main(int argc, char** argv) {
  if (argc < 6 || (std::strcmp(argv[1], "save") != 0 && std::strcmp(argv[1], "load") != 0)) {
    std::fprintf(stderr, "usage: ckpt_worker save|load ROOT STORE_FILE WORLD RANK [zstd] [store] [async]\n");
    return 2;
  }
  bool zstd = false, over_store = false, async = false;
  for (int i = 6; i < argc; ++i) {
    zstd = zstd || std::strcmp(argv[i], "zstd") == 0;
    over_store = over_store || std::strcmp(argv[i], "store") == 0;
    async = async || std::strcmp(argv[i], "async") == 0;
  }
  return trestle::run(argv[1], argv[2], argv[3], std::atoi(argv[4]), std::atoi(argv[5]), zstd, over_store, async);
}
