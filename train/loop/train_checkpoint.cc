#include "train/loop/train_checkpoint.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <limits>
#include <mutex>
#include <utility>

#include "ckpt/torch_async_save.h"
#include "ckpt/torch_tensor.h"
#include "kernels/cast_pack.h"

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

// The pieces of a slice of a stacked piece: each box's part of the flat range (or the whole boxes), with where it
// starts in the slice's flat elements.
struct SlicePart {
  Piece piece;
  std::int64_t offset = 0;
};
std::vector<SlicePart> slice_parts(const std::vector<Box>& boxes, const std::optional<FlatRange>& range) {
  std::vector<SlicePart> parts;
  std::int64_t box_start = 0;  // the box's first element in the stacked piece
  for (const Box& box : boxes) {
    const std::int64_t n = box.numel();
    if (!range) {
      parts.push_back({Piece{box, std::nullopt}, box_start});
    } else {
      const std::int64_t begin = std::max(range->start, box_start), end = std::min(range->stop, box_start + n);
      if (begin < end) {
        std::optional<FlatRange> flat;
        if (end - begin != n) flat = FlatRange{begin - box_start, end - box_start};
        parts.push_back({Piece{box, flat}, begin - range->start});
      }
    }
    box_start += n;
  }
  return parts;
}

// The items of one optimizer state of one slice; `state` holds the slice's elements (any shape).
void add_slice_items(std::vector<TorchSaveItem>& items, const std::string& name, const CanonicalTensor& canonical,
                     const std::vector<Box>& boxes, const std::optional<FlatRange>& range, const at::Tensor& state) {
  const at::Tensor flat = state.detach().reshape(-1);
  for (const SlicePart& part : slice_parts(boxes, range))
    items.push_back({name, canonical.shape, part.piece, flat.narrow(0, part.offset, part.piece.numel()).contiguous()});
}

// Loads one optimizer state of every slice (through CPU staging in the stored dtype, then copied into place).
Status load_slices(const CheckpointReader& reader, const std::vector<std::string>& names,
                   const std::vector<const std::vector<Box>*>& boxes,
                   const std::vector<std::optional<FlatRange>>& ranges, const std::vector<at::Tensor>& destinations) {
  std::vector<LoadRequest> requests;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // staging, destination
  for (std::size_t i = 0; i < names.size(); ++i) {
    const auto entry = reader.manifest().tensors.find(names[i]);
    if (entry == reader.manifest().tensors.end())
      return Status::Error(reader.directory() + ": the checkpoint has no tensor " + names[i]);
    at::Tensor staging =
        at::zeros({destinations[i].numel()}, at::TensorOptions().dtype(to_torch_dtype(entry->second.dtype)));
    for (const SlicePart& part : slice_parts(*boxes[i], ranges[i]))
      requests.push_back(
          {names[i], part.piece, static_cast<std::byte*>(staging.data_ptr()) + part.offset * staging.element_size()});
    copies.emplace_back(staging, destinations[i]);
  }
  TRESTLE_RETURN_IF_ERROR(reader.load(requests));
  c10::NoGradGuard no_grad;
  for (auto& [staging, destination] : copies) destination.view(-1).copy_(staging);
  return OkStatus();
}

}  // namespace

std::vector<OptimizerSlice> whole_optimizer_slices(const ModelParameters& parameters) {
  std::vector<OptimizerSlice> slices;
  for (std::size_t i = 0; i < parameters.all().size(); ++i) slices.push_back({i, std::nullopt});
  return slices;
}

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
                                      const ModelParameters& parameters, AdamW* optimizer,
                                      const std::vector<OptimizerSlice>& slices, const SaveOptions& options,
                                      const ModelParameters* frozen) {
  std::vector<TorchSaveItem> items;
  for (const auto& p : parameters.all()) {
    const auto other = checkpoint.saved_as.find(p.name());
    add_items(items, p.name(), p.canonical, p.boxes, other != checkpoint.saved_as.end() ? other->second : p.tensor);
  }
  if (frozen)
    for (const auto& p : frozen->all()) add_items(items, p.name(), p.canonical, p.boxes, p.tensor);
  if (optimizer) {
    const auto& optimized = optimizer->parameters();
    if (optimized.size() != slices.size())
      return Status::Error("the optimizer holds " + std::to_string(optimized.size()) + " parameters, its slices " +
                           std::to_string(slices.size()));
    for (std::size_t i = 0; i < optimized.size(); ++i) {
      if (slices[i].parameter >= parameters.all().size()) return Status::Error("an optimizer slice has no parameter");
      const auto& p = parameters.all()[slices[i].parameter];
      const auto& range = slices[i].range;
      add_slice_items(items, state_name(kStates[0], p.name()), p.canonical, p.boxes, range, optimizer->fp32_param(i));
      add_slice_items(items, state_name(kStates[1], p.name()), p.canonical, p.boxes, range, optimizer->exp_avg(i));
      add_slice_items(items, state_name(kStates[2], p.name()), p.canonical, p.boxes, range, optimizer->exp_avg_sq(i));
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
                   {"consumed_valid_samples", progress.consumed_valid_samples},
                   {"skipped_iterations", progress.skipped_iterations},
                   {"skipped_train_samples", progress.skipped_train_samples},
                   {"scheduler", progress.scheduler},
                   {"loss_scaler", progress.loss_scaler},
                   {"args", progress.args},
                   {"megatron_args", progress.megatron_args}};
  info.rank_state = nlohmann::json::object();
  if (checkpoint.save_rng) {
    info.rank_state["cpu_rng_state"] = rng_state(at::kCPU);
    if (checkpoint.device.is_cuda()) info.rank_state["cuda_rng_state"] = rng_state(checkpoint.device);
  }
  return save_tensors_async(saver, world, checkpoint.root, info, items, options, kernels::cast_pack);
}

Result<LoadedTraining> load_training_checkpoint(const CheckpointReader& reader, ModelParameters& parameters,
                                                AdamW& optimizer, const std::vector<OptimizerSlice>& slices,
                                                const TrainingLoadOptions& options) {
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
  // The first parameter's moments say whether the optimizer's state is there; a rank without parameters (a pipeline
  // stage left empty by --pipeline-model-parallel-layout) asks whether any parameter's are.
  const std::string moments = state_name(kStates[1], "");
  const auto first_moment = manifest.tensors.lower_bound(moments);
  const bool has_optimizer = parameters.all().empty()
                                 ? first_moment != manifest.tensors.end() && first_moment->first.starts_with(moments)
                                 : has(kStates[1], parameters.all().front().name());
  if (options.weights_only) {
    optimizer.parameters_to_masters();
    return loaded;
  }
  // The counts are whole numbers, 0 or more (a 1.5 would be read as 1 and a 1e30 wrap around).
  for (const auto& [name, count] : {std::pair{"consumed_train_samples", &loaded.progress.consumed_train_samples},
                                    std::pair{"consumed_valid_samples", &loaded.progress.consumed_valid_samples},
                                    std::pair{"skipped_iterations", &loaded.progress.skipped_iterations},
                                    std::pair{"skipped_train_samples", &loaded.progress.skipped_train_samples}}) {
    const auto found = training.find(name);
    if (found == training.end()) continue;
    if (!found->is_number_integer() ||
        (found->is_number_unsigned() &&
         found->get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) ||
        found->get<std::int64_t>() < 0)
      return Status::Error(where + ": training state: " + name + " is " + found->dump().substr(0, 80) +
                           ", expected a count (a whole number, 0 or more)");
    *count = found->get<std::int64_t>();
  }
  try {
    loaded.progress.iteration = manifest.iteration;
    loaded.progress_recorded = training.contains("consumed_train_samples");
    loaded.progress.scheduler = training.value("scheduler", nlohmann::json::object());
    loaded.progress.loss_scaler = training.value("loss_scaler", nlohmann::json::object());
    loaded.progress.args = training.value("args", nlohmann::json::object());
  } catch (const nlohmann::json::exception& e) {
    return Status::Error(where + ": training state: " + e.what());
  }
  for (const auto& [name, state] :
       {std::pair{"scheduler", &loaded.progress.scheduler}, {"loss_scaler", &loaded.progress.loss_scaler}})
    if (!state->is_object())
      return Status::Error(where + ": training state: " + name + " is " + state->dump().substr(0, 80) +
                           ", expected an object");
  if (options.load_optimizer && !has_optimizer && manifest.iteration > 0)
    return Status::Error(reader.directory() + ": iteration " + std::to_string(manifest.iteration) +
                         " holds no optimizer state (saved with --no-save-optim, or converted with --model-only), "
                         "and Megatron-LM stops here too: give --no-load-optim to start the optimizer and the "
                         "learning-rate schedule afresh from its weights, or --finetune to start from them at "
                         "iteration 0");
  if (options.load_optimizer && has_optimizer) {
    optimizer.parameters_to_masters();
    if (slices.size() != optimizer.parameters().size())
      return Status::Error("the optimizer holds " + std::to_string(optimizer.parameters().size()) +
                           " parameters, its slices " + std::to_string(slices.size()));
    std::vector<std::string> names;
    std::vector<const std::vector<Box>*> boxes;
    std::vector<std::optional<FlatRange>> ranges;
    std::vector<at::Tensor> destinations;
    for (std::size_t i = 0; i < slices.size(); ++i) {
      const auto& p = parameters.all().at(slices[i].parameter);
      for (int s = 0; s < 3; ++s) {
        if (s == 0 && !has(kStates[0], p.name())) continue;
        names.push_back(state_name(kStates[s], p.name()));
        boxes.push_back(&p.boxes);
        ranges.push_back(slices[i].range);
        destinations.push_back(s == 0   ? optimizer.fp32_param(i)
                               : s == 1 ? optimizer.exp_avg(i)
                                        : optimizer.exp_avg_sq(i));
      }
    }
    TRESTLE_RETURN_IF_ERROR(load_slices(reader, names, boxes, ranges, destinations));
    at::Tensor step = at::zeros({}, at::kLong);
    static const std::vector<Box> kScalar{Box{}};
    const bool has_step = manifest.tensors.count(kStep) > 0;
    if (has_step) TRESTLE_RETURN_IF_ERROR(load_stacked_pieces(reader, {{kStep, &kScalar, step}}));
    if (has_step) optimizer.set_steps(step.item<std::int64_t>());
    optimizer.masters_to_parameters();
    loaded.optimizer_loaded = true;
  } else {
    optimizer.parameters_to_masters();
  }
  if (options.load_rng && manifest.layout == options.layout) {
    // Saved on this layout: each rank's entry is there unless saved with --no-save-rng or edited away.
    static const nlohmann::json kNone = nlohmann::json::object();
    const auto ranks = training.find("ranks");
    if (ranks != training.end() && !ranks->is_array())
      return Status::Error(where + ": training state: ranks is " + ranks->dump().substr(0, 80) + ", expected a list");
    const bool listed = ranks != training.end() && options.rank < static_cast<int>(ranks->size());
    const auto& mine = listed ? (*ranks)[static_cast<std::size_t>(options.rank)] : kNone;
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
    loaded.rng_absent = !loaded.rng_loaded;
  }
  return loaded;
}

}  // namespace trestle::train
