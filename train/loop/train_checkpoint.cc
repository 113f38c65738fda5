#include "train/loop/train_checkpoint.h"

#include <ATen/ATen.h>

#include <mutex>
#include <utility>

#include "ckpt/torch_async_save.h"

namespace trestle::train {
namespace {

constexpr const char* kStates[] = {"fp32_param", "exp_avg", "exp_avg_sq"};
constexpr const char* kStep = "optimizer.step";

std::string state_name(const char* state, const std::string& name) {
  return std::string("optimizer.") + state + "." + name;
}

// The items of one stacked piece: each box is a contiguous run of rows of `tensor`.
void add_items(std::vector<TorchSaveItem>& items, const std::string& name, const CanonicalTensor& canonical,
               const std::vector<Box>& boxes, const at::Tensor& tensor) {
  std::int64_t row = 0;
  for (const Box& box : boxes) {
    at::Tensor part = tensor.dim() == 0 ? tensor : tensor.narrow(0, row, box.shape[0]);
    if (tensor.dim() > 0) row += box.shape[0];
    items.push_back({name, canonical.shape, Piece{box, std::nullopt}, part.detach().contiguous()});
  }
}

}  // namespace

std::string rng_state(at::Device device) {
  auto generator = at::globalContext().defaultGenerator(device);
  at::Tensor state;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    state = generator.get_state();
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  const auto* bytes = state.data_ptr<std::uint8_t>();
  for (std::int64_t i = 0; i < state.numel(); ++i) {
    out += kHex[bytes[i] >> 4];
    out += kHex[bytes[i] & 15];
  }
  return out;
}

Status restore_rng_state(at::Device device, const std::string& hex) {
  auto generator = at::globalContext().defaultGenerator(device);
  const std::string which = device.is_cpu() ? "CPU" : device.str();
  std::lock_guard<std::mutex> lock(generator.mutex());
  const at::Tensor current = generator.get_state();
  if (hex.size() != static_cast<std::size_t>(current.numel()) * 2)
    return Status::Error("the saved " + which + " RNG state has " + std::to_string(hex.size() / 2) +
                         " bytes; this LibTorch's has " + std::to_string(current.numel()));
  at::Tensor state = at::empty({current.numel()}, at::kByte);
  auto* bytes = state.data_ptr<std::uint8_t>();
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (std::size_t i = 0; i < hex.size() / 2; ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return Status::Error("the saved " + which + " RNG state is not hexadecimal");
    bytes[i] = static_cast<std::uint8_t>(hi * 16 + lo);
  }
  generator.set_state(state);
  return OkStatus();
}

Status save_training_checkpoint_async(AsyncSaver& saver, Collective& world, const TrainingCheckpoint& checkpoint,
                                      const ModelParameters& parameters, AdamW* optimizer, const SaveOptions& options) {
  std::vector<TorchSaveItem> items;
  for (const auto& p : parameters.all()) add_items(items, p.name(), p.canonical, p.boxes, p.tensor);
  if (optimizer) {
    const auto& optimized = optimizer->parameters();
    if (optimized.size() != parameters.all().size())
      return Status::Error("the optimizer holds " + std::to_string(optimized.size()) + " parameters, the model " +
                           std::to_string(parameters.all().size()));
    for (std::size_t i = 0; i < optimized.size(); ++i) {
      const auto& p = parameters.all()[i];
      add_items(items, state_name(kStates[0], p.name()), p.canonical, p.boxes, optimizer->fp32_param(i));
      add_items(items, state_name(kStates[1], p.name()), p.canonical, p.boxes, optimizer->exp_avg(i));
      add_items(items, state_name(kStates[2], p.name()), p.canonical, p.boxes, optimizer->exp_avg_sq(i));
    }
    items.push_back({kStep, Shape{}, Piece{Box{}, std::nullopt}, at::scalar_tensor(optimizer->steps(), at::kLong)});
  }
  CheckpointInfo info;
  info.iteration = checkpoint.progress.iteration;
  info.layout = checkpoint.layout;
  info.model = checkpoint.model;
  info.files = checkpoint.files;
  const auto& progress = checkpoint.progress;
  info.training = {{"iteration", progress.iteration},
                   {"consumed_train_samples", progress.consumed_train_samples},
                   {"skipped_iterations", progress.skipped_iterations},
                   {"scheduler", progress.scheduler},
                   {"loss_scaler", progress.loss_scaler},
                   {"args", progress.args}};
  info.rank_state = {{"cpu_rng_state", rng_state(at::kCPU)}};
  if (checkpoint.device.is_cuda()) info.rank_state["cuda_rng_state"] = rng_state(checkpoint.device);
  return save_tensors_async(saver, world, checkpoint.root, info, items, options);
}

Result<LoadedTraining> load_training_checkpoint(const CheckpointReader& reader, ModelParameters& parameters,
                                                AdamW& optimizer, const TrainingLoadOptions& options) {
  TRESTLE_RETURN_IF_ERROR(load_model_pieces(parameters, reader));
  LoadedTraining loaded;
  const auto& manifest = reader.manifest();
  const auto& training = manifest.training;
  const std::string where = reader.directory() + "/manifest.json";
  // A converted model (or --finetune) gives weights only; the optimizer's masters are copies of them.
  // Megatron's fp32 optimizers keep no fp32_param (the parameters are their own masters): the moments say it is there.
  auto has = [&](const char* state, const std::string& name) {
    return manifest.tensors.count(state_name(state, name)) > 0;
  };
  const bool has_optimizer = !parameters.all().empty() && has(kStates[1], parameters.all().front().name());
  if (options.weights_only) {
    optimizer.parameters_to_masters();
    return loaded;
  }
  try {
    loaded.progress.iteration = manifest.iteration;
    loaded.progress_recorded = training.contains("consumed_train_samples");
    loaded.progress.consumed_train_samples = training.value("consumed_train_samples", std::int64_t{0});
    loaded.progress.skipped_iterations = training.value("skipped_iterations", std::int64_t{0});
    loaded.progress.scheduler = training.value("scheduler", nlohmann::json::object());
    loaded.progress.loss_scaler = training.value("loss_scaler", nlohmann::json::object());
    loaded.progress.args = training.value("args", nlohmann::json::object());
  } catch (const nlohmann::json::exception& e) {
    return Status::Error(where + ": training state: " + e.what());
  }
  if (options.load_optimizer && has_optimizer) {
    optimizer.parameters_to_masters();
    std::vector<StackedPieceTarget> targets;
    for (std::size_t i = 0; i < parameters.all().size(); ++i) {
      const auto& p = parameters.all()[i];
      if (has(kStates[0], p.name()))
        targets.push_back({state_name(kStates[0], p.name()), &p.boxes, optimizer.fp32_param(i)});
      targets.push_back({state_name(kStates[1], p.name()), &p.boxes, optimizer.exp_avg(i)});
      targets.push_back({state_name(kStates[2], p.name()), &p.boxes, optimizer.exp_avg_sq(i)});
    }
    at::Tensor step = at::zeros({}, at::kLong);
    static const std::vector<Box> kScalar{Box{}};
    const bool has_step = manifest.tensors.count(kStep) > 0;
    if (has_step) targets.push_back({kStep, &kScalar, step});
    TRESTLE_RETURN_IF_ERROR(load_stacked_pieces(reader, targets));
    if (has_step) optimizer.set_steps(step.item<std::int64_t>());
    optimizer.masters_to_parameters();
    loaded.optimizer_loaded = true;
  } else {
    optimizer.parameters_to_masters();
  }
  if (options.load_rng && manifest.layout == options.layout && training.contains("ranks") &&
      training["ranks"].is_array() && options.rank < static_cast<int>(training["ranks"].size())) {
    const auto& mine = training["ranks"][static_cast<std::size_t>(options.rank)];
    // The CPU generator's state, and the GPU's when this run and the saving one both ran on GPUs.
    std::vector<std::pair<const char*, at::Device>> generators{{"cpu_rng_state", at::kCPU}};
    if (options.device.is_cuda()) generators.emplace_back("cuda_rng_state", options.device);
    for (const auto& [key, device] : generators) {
      if (!mine.is_object() || !mine.contains(key)) continue;
      if (!mine[key].is_string())
        return Status::Error(where + ": rank " + std::to_string(options.rank) + ": " + key + " is not a string");
      if (auto s = restore_rng_state(device, mine[key].get<std::string>()); !s.ok())
        return Status::Error(where + ": rank " + std::to_string(options.rank) + ": " + s.message());
      loaded.rng_loaded = loaded.rng_loaded || device.is_cpu();
    }
  }
  return loaded;
}

}  // namespace trestle::train
