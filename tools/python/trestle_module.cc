// trestle._trestle: the checkpoint engine for Python (pybind11, LibTorch's tensors). save / save_async write a Trestle
// checkpoint of a flat {name: tensor} state dict from one process (the pinned staging pool of one AsyncSaver reused
// across saves); load fills preallocated tensors from a checkpoint of any layout (the load planner reads only what
// each tensor needs); manifest returns the manifest as JSON text. The GIL is released while bytes move.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>
#include <vector>

#include "ckpt/async_saver.h"
#include "ckpt/collective.h"
#include "ckpt/load.h"
#include "ckpt/printable_text.h"
#include "ckpt/torch_async_save.h"
#include "ckpt/torch_tensor.h"

namespace py = pybind11;

namespace trestle::python {
namespace {

[[noreturn]] void raise(const Status& status) { throw std::runtime_error(printable_text(status.message())); }

// The save items of a flat state dict: each tensor whole (its own global shape), contiguous, in the stored dtype.
std::vector<TorchSaveItem> save_items(const py::dict& state_dict) {
  std::vector<TorchSaveItem> items;
  for (const auto& [key, value] : state_dict) {
    const std::string name = py::cast<std::string>(key);
    if (!THPVariable_Check(value.ptr())) throw py::type_error("state_dict['" + name + "'] is not a torch.Tensor");
    at::Tensor tensor = THPVariable_Unpack(value.ptr()).detach();
    Shape shape(tensor.sizes().begin(), tensor.sizes().end());
    items.push_back({name, shape, Piece{whole_box(shape), std::nullopt}, tensor.contiguous()});
  }
  return items;
}

Result<Codec> codec_of(const std::string& name) {
  if (name == "raw") return Codec::kRaw;
  if (name == "zstd") return Codec::kZstd;
  return Status::Error("codec '" + name + "': raw or zstd");
}

// One saver per process: its pinned staging pool is allocated once and reused by every save.
class Saver {
 public:
  Saver() : saver_(0, torch_pool_allocator()) {}

  // Stages every tensor and returns; the writing goes on in the background until wait().
  void save_async(const py::dict& state_dict, const std::string& path, std::int64_t iteration, const std::string& codec,
                  bool overwrite, const std::string& training_json) {
    auto items = save_items(state_dict);
    auto c = codec_of(codec);
    if (!c.ok()) raise(c.status());
    CheckpointInfo info;
    info.iteration = iteration;
    try {
      info.training = nlohmann::json::parse(training_json);
    } catch (const nlohmann::json::exception& e) {
      throw py::value_error(std::string("training: not JSON: ") + e.what());
    }
    SaveOptions options;
    options.codec = *c;
    options.overwrite = overwrite;
    Status status = OkStatus();
    {
      py::gil_scoped_release release;
      status = save_tensors_async(saver_, solo_, path, info, items, options);
    }
    if (!status.ok()) raise(status);
  }

  // Waits for the save in flight and commits it.
  void wait() {
    Status status = OkStatus();
    {
      py::gil_scoped_release release;
      status = saver_.finalize();
    }
    if (!status.ok()) raise(status);
  }
  bool in_flight() const { return saver_.in_flight(); }

 private:
  SoloCollective solo_;
  AsyncSaver saver_;
};

// Fills every tensor of `state_dict` (preallocated with the stored shape; any dtype, converted) from the checkpoint.
void load(const std::string& path, const py::dict& state_dict, std::optional<std::int64_t> iteration) {
  auto reader = CheckpointReader::open(path, iteration);
  if (!reader.ok()) raise(reader.status());
  struct Target {
    std::string name;
    at::Tensor destination, staging;
  };
  std::vector<Target> targets;
  std::vector<LoadRequest> requests;
  for (const auto& [key, value] : state_dict) {
    const std::string name = py::cast<std::string>(key);
    if (!THPVariable_Check(value.ptr())) throw py::type_error("state_dict['" + name + "'] is not a torch.Tensor");
    at::Tensor destination = THPVariable_Unpack(value.ptr()).detach();
    const auto entry = reader->manifest().tensors.find(name);
    if (entry == reader->manifest().tensors.end())
      raise(Status::Error(reader->directory() + ": the checkpoint has no tensor " + name));
    const Shape shape(destination.sizes().begin(), destination.sizes().end());
    if (shape != entry->second.global_shape)
      raise(Status::Error(name + ": the tensor has shape " + to_string(whole_box(shape)) + ", the checkpoint " +
                          to_string(whole_box(entry->second.global_shape))));
    at::Tensor staging = at::empty(destination.sizes(), at::TensorOptions().dtype(to_torch_dtype(entry->second.dtype)));
    targets.push_back({name, destination, staging});
    requests.push_back({name, Piece{whole_box(shape), std::nullopt}, static_cast<std::byte*>(staging.data_ptr())});
  }
  Status status = OkStatus();
  {
    py::gil_scoped_release release;
    status = reader->load(requests);
    if (status.ok()) {
      c10::NoGradGuard no_grad;
      for (auto& t : targets) t.destination.copy_(t.staging);
    }
  }
  if (!status.ok()) raise(status);
}

std::string manifest(const std::string& path, std::optional<std::int64_t> iteration) {
  auto reader = CheckpointReader::open(path, iteration);
  if (!reader.ok()) raise(reader.status());
  return to_json(reader->manifest()).dump();
}

}  // namespace
}  // namespace trestle::python

PYBIND11_MODULE(_trestle, m) {
  using namespace trestle::python;
  m.doc() = "Trestle's checkpoint engine (C++): save, save_async, load and inspect Trestle checkpoints";
  py::class_<Saver>(m, "Saver")
      .def(py::init<>())
      .def("save_async", &Saver::save_async, py::arg("state_dict"), py::arg("path"), py::arg("iteration"),
           py::arg("codec"), py::arg("overwrite"), py::arg("training"))
      .def("wait", &Saver::wait)
      .def_property_readonly("in_flight", &Saver::in_flight);
  m.def("load", &load, py::arg("path"), py::arg("state_dict"), py::arg("iteration") = py::none());
  m.def("manifest", &manifest, py::arg("path"), py::arg("iteration") = py::none());
}
