// One rank of the model tests: `model_worker CKPT STORE_FILE TP RANK INPUT_JSON OUT_DIR [sp] [recompute] [ep=N]`.
// TP·N ranks (N = 1 without ep=) meet through a c10d FileStore and talk over Gloo in Megatron's groups (tp, and with
// N > 1 N data-parallel ranks forming one expert-parallel group). The rank builds the model from the checkpoint's
// model JSON at that layout, loads its pieces, runs forward on its expert-parallel rank's share of INPUT_JSON's
// sequences ({"tokens": [[...]], "labels": [[...]]}: the batch in N equal parts, positions 0..seq-1), the
// vocabulary-parallel loss and one backward of its sum; the dense gradients are then summed over the data-parallel
// ranks (the experts' already sum every rank's tokens), so each is the whole batch's. It writes OUT_DIR/rank<R>.json
// (vocab rows, batch rows, loss, each parameter's boxes) beside raw little-endian fp32 files: logits ([seq, batch
// share, rows]) and every gradient.
#include <ATen/ATen.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "ckpt/json_file.h"
#include "ckpt/load.h"
#include "parallel/layout/model_spec.h"
#include "parallel/parallel_state.h"
#include "parallel/process_group_collective.h"
#include "parallel/store_collective.h"
#include "train/model/gpt_model.h"

namespace trestle {
namespace {

int fail(const std::string& message) {
  std::fprintf(stderr, "model_worker: %s\n", message.c_str());
  return 1;
}

void write_f32(const std::filesystem::path& path, const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kFloat).contiguous();
  std::ofstream(path, std::ios::binary).write(static_cast<const char*>(c.data_ptr()), c.numel() * 4);
}

at::Tensor int_matrix(const nlohmann::json& rows) {
  std::vector<std::int64_t> flat;
  for (const auto& row : rows)
    for (const auto& v : row) flat.push_back(v.get<std::int64_t>());
  const std::int64_t batch = static_cast<std::int64_t>(rows.size());
  return at::tensor(flat, at::kLong).view({batch, -1});
}

nlohmann::json box_json(const Box& b) {
  return {{"offset", std::vector<std::int64_t>(b.offset.begin(), b.offset.end())},
          {"shape", std::vector<std::int64_t>(b.shape.begin(), b.shape.end())}};
}

int run(const std::string& ckpt, const std::string& store, int tp, int ep, int rank, const std::string& input,
        const std::filesystem::path& out, bool sp, bool recompute) {
  auto rendezvous = parallel::rendezvous_with_file(store, rank, tp * ep);
  if (!rendezvous.ok()) return fail(rendezvous.status().message());
  ParallelLayout layout;
  layout.tp = tp;
  layout.ep = ep;
  layout.data_parallel = ep;
  auto state = parallel::ParallelState::create(layout, *rendezvous);
  if (!state.ok()) return fail(state.status().message());
  auto ref = [](const parallel::ProcessGroup& g) {
    return train::TpGroup{g.size() > 1 ? g.backend : nullptr, g.rank, g.size()};
  };
  train::TpGroup group = ref(state->tp_group());
  auto reader = CheckpointReader::open(ckpt);
  if (!reader.ok()) return fail(reader.status().message());
  auto spec = gpt_spec_from_json(reader->manifest().model, reader->directory());
  if (!spec.ok()) return fail(spec.status().message());
  train::ModelOptions options;
  options.sequence_parallel = sp;
  options.recompute = recompute;
  options.fused_kernels = true;  // as the trainer runs by default
  options.ep = ref(state->ep_group());
  auto model = train::GptModel::create(*spec, layout, group, options);
  if (!model.ok()) return fail(model.status().message());
  if (auto s = train::load_model_pieces(**model, *reader); !s.ok()) return fail(s.message());

  auto batch = read_json_file(input);
  if (!batch.ok()) return fail(batch.status().message());
  at::Tensor tokens = int_matrix((*batch)["tokens"]), labels = int_matrix((*batch)["labels"]);
  const int dp_rank = state->coordinates().dp_rank;
  if (tokens.size(0) % ep != 0) return fail("the batch does not divide into ep parts");
  const std::int64_t share = tokens.size(0) / ep;
  tokens = tokens.narrow(0, dp_rank * share, share).contiguous();
  labels = labels.narrow(0, dp_rank * share, share).contiguous();
  at::Tensor positions = at::arange(tokens.size(1), at::kLong).unsqueeze(0).expand_as(tokens).contiguous();

  at::Tensor logits = (*model)->forward(tokens, positions);
  at::Tensor loss =
      train::vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), (*model)->vocab_range(), (*model)->tp_group())
          .transpose(0, 1);
  loss.sum().backward();
  std::vector<at::Tensor> grads;
  for (auto& p : (*model)->parameters()) grads.push_back(p.tensor.mutable_grad());
  (*model)->finish_grads(grads);
  const auto& dp = state->dp_group();
  for (std::size_t i = 0; i < grads.size(); ++i)
    if (dp.size() > 1 && (*model)->parameters()[i].canonical.expert < 0 && grads[i].defined()) {
      std::vector<at::Tensor> one{grads[i]};
      dp.backend->allreduce(one)->wait();
    }

  std::filesystem::create_directories(out);
  const std::string r = std::to_string(rank);
  const at::Tensor loss_values = loss.detach().contiguous();
  write_f32(out / ("logits_" + r + ".bin"), logits);
  nlohmann::json report = {
      {"vocab_start", (*model)->vocab_range().start},
      {"vocab_rows", (*model)->vocab_range().rows},
      {"batch_start", dp_rank * share},
      {"logits_shape", logits.sizes().vec()},
      {"loss", std::vector<float>(loss_values.data_ptr<float>(), loss_values.data_ptr<float>() + loss_values.numel())}};
  for (std::size_t i = 0; i < (*model)->parameters().size(); ++i) {
    const auto& p = (*model)->parameters()[i];
    // The router's expert bias (DeepSeek's aux-loss-free balancing) selects experts and is moved by the load, never
    // by a gradient.
    if (p.name().ends_with(".mlp.router.expert_bias")) continue;
    // Gemma 4's layer scalar is a constant (transformers' buffer): the layer reads it detached.
    if (p.name().ends_with(".layer_scalar")) continue;
    nlohmann::json boxes = nlohmann::json::array();
    for (const Box& b : p.boxes) boxes.push_back(box_json(b));
    const std::string file = "grad_" + r + "_" + std::to_string(i) + ".bin";
    if (!p.tensor.grad().defined()) return fail("no gradient for " + p.name());
    write_f32(out / file, p.tensor.grad());
    report["parameters"].push_back(
        {{"name", p.name()},
         {"boxes", boxes},
         {"shape", p.tensor.sizes().vec()},
         {"global_shape", std::vector<std::int64_t>(p.canonical.shape.begin(), p.canonical.shape.end())},
         {"grad", file}});
  }
  std::ofstream(out / ("rank" + r + ".json")) << report.dump();
  return 0;
}

}  // namespace
}  // namespace trestle

int main(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: model_worker CKPT STORE_FILE TP RANK INPUT_JSON OUT_DIR [sp] [recompute] [ep=N]\n");
    return 2;
  }
  bool sp = false, recompute = false;
  int ep = 1;
  for (int i = 7; i < argc; ++i) {
    sp = sp || std::strcmp(argv[i], "sp") == 0;
    recompute = recompute || std::strcmp(argv[i], "recompute") == 0;
    if (std::strncmp(argv[i], "ep=", 3) == 0) ep = std::atoi(argv[i] + 3);
  }
  if (ep < 1) return trestle::fail("ep must be at least 1");
  return trestle::run(argv[1], argv[2], std::atoi(argv[3]), ep, std::atoi(argv[4]), argv[5], argv[6], sp, recompute);
}
