// trestle._trestle: the checkpoint engine for Python (pybind11, LibTorch's tensors). Saver writes a Trestle checkpoint
// of named tensor pieces from one process or from every rank of a job (the ranks agree through a Python all_gather
// callback, torch.distributed's), the pinned staging pool of one AsyncSaver reused across saves; load fills
// preallocated pieces from a checkpoint of any layout (the load planner reads only what each piece needs); manifest
// returns the manifest as JSON text; convert / reshard run the CLI's conversions with progress reported to a Python
// callback. write_dcp_file / DcpReader are the byte paths of the torch.distributed.checkpoint
// storage plugin (trestle/dcp.py). The GIL is released while bytes move.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ckpt/async_saver.h"
#include "ckpt/collective.h"
#include "ckpt/load.h"
#include "ckpt/printable_text.h"
#include "ckpt/progress.h"
#include "ckpt/torch_async_save.h"
#include "ckpt/torch_tensor.h"
#include "convert/formats/torch/dcp_checkpoint.h"
#include "convert/operations.h"

namespace py = pybind11;

namespace trestle::python {
namespace {

[[noreturn]] void raise(const Status& status) { throw std::runtime_error(printable_text(status.message())); }

at::Tensor tensor_of(const py::handle& value, const std::string& name) {
  if (!THPVariable_Check(value.ptr())) throw py::type_error("'" + name + "' is not a torch.Tensor");
  at::Tensor tensor = THPVariable_Unpack(value.ptr()).detach();
  if (tensor.layout() != at::kStrided) {  // sparse, mkldnn, ...: no elements in memory to write or read in place
    std::ostringstream layout;
    layout << tensor.layout();
    throw py::type_error("'" + name + "' is a " + layout.str() +
                         " tensor; Trestle saves and loads dense (strided) tensors: pass its .to_dense()");
  }
  return tensor;
}

// A piece named in Python: (name, tensor, global_shape, offset): the tensor holds the box of the global tensor that
// starts at `offset` (the tensor's own shape is the box's).
struct PieceArg {
  std::string name;
  at::Tensor tensor;
  Box box;
  Shape global_shape;
};

std::vector<PieceArg> piece_args(const py::list& pieces) {
  std::vector<PieceArg> out;
  for (const auto& entry : pieces) {
    const auto t = py::cast<py::tuple>(entry);
    PieceArg a;
    a.name = py::cast<std::string>(t[0]);
    a.tensor = tensor_of(t[1], a.name);
    if (auto dtype = from_torch_dtype(a.tensor.scalar_type()); !dtype.ok())
      throw py::type_error("tensor '" + a.name + "': " + dtype.status().message());
    a.global_shape = py::cast<Shape>(t[2]);
    a.box = Box{py::cast<Shape>(t[3]), Shape(a.tensor.sizes().begin(), a.tensor.sizes().end())};
    if (a.box.offset.size() != a.global_shape.size() || !box_within(a.box, a.global_shape))
      throw py::value_error("'" + a.name + "': piece " + to_string(a.box) + " does not fit global shape " +
                            to_string(a.global_shape));
    out.push_back(std::move(a));
  }
  return out;
}

// What save_async checks of the pieces before anything is written (names, layouts, dtypes, boxes), alone: the ranks
// of a job agree on its outcome before their collective save, so that one rank's bad input fails them all at once.
void check_pieces(const py::list& pieces) { piece_args(pieces); }

// The ranks of a job as Python sees them: all_gather(bytes) -> list of every rank's bytes (torch.distributed's
// all_gather_object over the process group), called with the GIL taken.
class PythonCollective final : public Collective {
 public:
  PythonCollective(int rank, int size, py::object all_gather)
      : rank_(rank), size_(size), gather_(std::move(all_gather)) {}
  ~PythonCollective() override {
    py::gil_scoped_acquire gil;
    gather_ = py::object();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Result<std::vector<std::string>> all_gather(const std::string& bytes) override {
    py::gil_scoped_acquire gil;
    try {
      const auto gathered = py::cast<std::vector<py::bytes>>(gather_(py::bytes(bytes)));
      if (gathered.size() != static_cast<std::size_t>(size_))
        return Status::Error("all_gather returned " + std::to_string(gathered.size()) + " contributions for " +
                             std::to_string(size_) + " ranks");
      std::vector<std::string> out;
      for (const auto& b : gathered) out.push_back(std::string(b));
      return out;
    } catch (const py::error_already_set& e) {
      return Status::Error(std::string("all_gather across the ranks failed: ") + e.what());
    }
  }

 private:
  int rank_, size_;
  py::object gather_;
};

Result<Codec> codec_of(const std::string& name) {
  if (name == "raw") return Codec::kRaw;
  if (name == "zstd") return Codec::kZstd;
  return Status::Error("codec '" + name + "': raw or zstd");
}

// One saver per process: its pinned staging pool is allocated once and reused by every save.
class Saver {
 public:
  Saver() : saver_(0, torch_pool_allocator()) {}

  // Stages every piece and returns; the writing goes on in the background until wait(). `all_gather` (None for one
  // process) connects the ranks that save together: each passes its own pieces; identical pieces are written once.
  void save_async(const py::list& pieces, const std::string& path, std::int64_t iteration, const std::string& codec,
                  bool overwrite, const std::string& training_json, int rank, int size, py::object all_gather) {
    std::vector<TorchSaveItem> items;
    for (auto& a : piece_args(pieces))
      items.push_back({a.name, a.global_shape, Piece{a.box, std::nullopt}, a.tensor.contiguous()});
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
    wait();  // the save in flight commits with the ranks it started with
    if (all_gather.is_none()) group_ = std::make_shared<SoloCollective>();
    else group_ = std::make_shared<PythonCollective>(rank, size, std::move(all_gather));
    Status status = OkStatus();
    {
      py::gil_scoped_release release;
      status = save_tensors_async(saver_, *group_, path, info, items, options);
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
  std::shared_ptr<Collective> group_ = std::make_shared<SoloCollective>();
  AsyncSaver saver_;
};

// Fills every piece (name, tensor, global_shape, offset) from the checkpoint, whatever layout saved it; the tensor may
// have any strides, and a floating-point tensor any floating-point dtype (converted); other dtypes must match.
void load(const std::string& path, const py::list& pieces, std::optional<std::int64_t> iteration) {
  auto reader = CheckpointReader::open(path, iteration);
  if (!reader.ok()) raise(reader.status());
  struct Target {
    at::Tensor destination, staging;
  };
  std::vector<Target> targets;
  std::vector<LoadRequest> requests;
  for (auto& a : piece_args(pieces)) {
    const auto entry = reader->manifest().tensors.find(a.name);
    if (entry == reader->manifest().tensors.end())
      raise(Status::Error(reader->directory() + ": the checkpoint has no tensor " + a.name));
    if (a.global_shape != entry->second.global_shape)
      raise(Status::Error(a.name + ": the tensor has shape " + to_string(a.global_shape) + ", the checkpoint " +
                          to_string(entry->second.global_shape)));
    const auto stored = to_torch_dtype(entry->second.dtype);
    if (a.tensor.is_meta())
      raise(Status::Error(a.name + ": the tensor is on the meta device, which holds no data to load into"));
    const auto wanted = a.tensor.scalar_type();
    if (wanted != stored && !(at::isFloatingType(wanted) && at::isFloatingType(stored)))
      raise(Status::Error(a.name + ": the tensor is " + std::string(c10::toString(wanted)) + ", the checkpoint's " +
                          std::string(c10::toString(stored)) +
                          "; only floating-point tensors are converted on load (integers and booleans would be "
                          "truncated or wrapped)"));
    const bool direct = a.tensor.device().is_cpu() && a.tensor.is_contiguous() && a.tensor.scalar_type() == stored;
    at::Tensor staging = direct ? a.tensor : at::empty(a.tensor.sizes(), at::TensorOptions().dtype(stored));
    requests.push_back({a.name, Piece{a.box, std::nullopt}, static_cast<std::byte*>(staging.data_ptr())});
    targets.push_back({a.tensor, staging});
  }
  Status status = OkStatus();
  {
    py::gil_scoped_release release;
    status = reader->load(requests);
    if (status.ok()) {
      c10::NoGradGuard no_grad;
      for (auto& t : targets)
        if (!t.staging.is_same(t.destination)) t.destination.copy_(t.staging);
    }
  }
  if (!status.ok()) raise(status);
}

// One rank's DCP item file for the storage plugin: `items` are ("tensor", fqn, tensor, global_shape, offset) or
// ("bytes", fqn, bytes); writes <dir>/__{rank}_0.distcp through the project's FileWriter and returns, per item in
// order, (file name, offset, length) for DCP's _StorageInfo.
std::vector<std::tuple<std::string, std::uint64_t, std::uint64_t>> write_dcp_file(const std::string& dir, int rank,
                                                                                  const py::list& items) {
  struct Item {
    bool tensor = false;
    DcpTensorPiece piece;
    at::Tensor holder;
    DcpObjectPiece object;
  };
  std::vector<Item> list;
  for (const auto& entry : items) {
    const auto t = py::cast<py::tuple>(entry);
    Item it;
    const auto kind = py::cast<std::string>(t[0]);
    const auto name = py::cast<std::string>(t[1]);
    if (kind == "bytes") {
      it.object = {name, py::cast<std::string>(t[2])};
    } else {
      it.tensor = true;
      it.holder = tensor_of(t[2], name).to(at::kCPU).contiguous();
      auto dtype = from_torch_dtype(it.holder.scalar_type());
      if (!dtype.ok()) raise(dtype.status().with_context(dir + ": tensor '" + name + "'"));
      it.piece.name = name;
      it.piece.dtype = *dtype;
      it.piece.global_shape = py::cast<Shape>(t[3]);
      it.piece.box = Box{py::cast<Shape>(t[4]), Shape(it.holder.sizes().begin(), it.holder.sizes().end())};
      it.piece.data = {static_cast<const std::byte*>(it.holder.data_ptr()), it.holder.nbytes()};
    }
    list.push_back(std::move(it));
  }
  std::vector<std::tuple<std::string, std::uint64_t, std::uint64_t>> out;
  Status status = OkStatus();
  {
    py::gil_scoped_release release;
    status = [&]() -> Status {
      TRESTLE_ASSIGN_OR_RETURN(auto writer, DcpRankFileWriter::create(dir, rank));
      for (const auto& it : list)
        TRESTLE_RETURN_IF_ERROR(it.tensor ? writer.add_tensor(it.piece) : writer.add_object(it.object));
      TRESTLE_ASSIGN_OR_RETURN(const DcpRankItems written, writer.finish());
      std::size_t t = 0, b = 0;
      for (const auto& it : list) {
        const DcpStorage& s = it.tensor ? written.tensors.at(t++).chunks.at(0).storage : written.bytes.at(b++).storage;
        out.emplace_back(s.file, s.offset, s.length);
      }
      return OkStatus();
    }();
  }
  if (!status.ok()) raise(status);
  return out;
}

// The read side of the storage plugin: boxes of a DCP checkpoint's tensors (any chunking; each torch.save record's
// CRC-32 checked) read into tensors, several at once.
class DcpReader {
 public:
  // metadata: ".metadata", or a rank's "__<rank>.metadata" (a save without collectives).
  DcpReader(const std::string& dir, const std::string& metadata) {
    DcpCheckpoint::OpenOptions options;
    options.metadata_name = metadata;
    options.refuse_unreadable = false;  // a partial load reads what it asks for
    auto opened = DcpCheckpoint::open(dir, options);
    if (!opened.ok()) raise(opened.status());
    checkpoint_ = std::make_unique<DcpCheckpoint>(std::move(opened).value());
  }

  // requests: (fqn, global offset of the box, tensor shaped as the box; any dtype, device or strides).
  void read(const py::list& requests, int threads) {
    struct Request {
      std::string name;
      Box box;
      at::Tensor destination, staging;
      Status status = OkStatus();
    };
    std::vector<Request> list;
    for (const auto& entry : requests) {
      const auto t = py::cast<py::tuple>(entry);
      Request r;
      r.name = py::cast<std::string>(t[0]);
      r.destination = tensor_of(t[2], r.name);
      r.box = Box{py::cast<Shape>(t[1]), Shape(r.destination.sizes().begin(), r.destination.sizes().end())};
      const DcpTensor* stored = checkpoint_->metadata().find_tensor(r.name);
      if (!stored)
        raise(Status::Error(checkpoint_->metadata_path() + ": " + checkpoint_->metadata().missing_tensor(r.name)));
      const auto dtype = to_torch_dtype(stored->dtype);
      const bool direct =
          r.destination.device().is_cpu() && r.destination.is_contiguous() && r.destination.scalar_type() == dtype;
      r.staging = direct ? r.destination : at::empty(r.destination.sizes(), at::TensorOptions().dtype(dtype));
      list.push_back(std::move(r));
    }
    {
      py::gil_scoped_release release;
      std::atomic<std::size_t> next{0};
      auto work = [&] {
        c10::NoGradGuard no_grad;
        for (std::size_t i; (i = next++) < list.size();) {
          Request& r = list[i];
          r.status = checkpoint_->read_box(r.name, r.box, static_cast<std::byte*>(r.staging.data_ptr()));
          if (r.status.ok() && !r.staging.is_same(r.destination)) r.destination.copy_(r.staging);
        }
      };
      std::vector<std::thread> pool;
      const std::size_t n = std::min<std::size_t>(static_cast<std::size_t>(std::max(threads, 1)), list.size());
      for (std::size_t i = 1; i < n; ++i) pool.emplace_back(work);
      work();
      for (auto& t : pool) t.join();
    }
    for (const auto& r : list)
      if (!r.status.ok()) raise(r.status);
  }

  // The stored bytes of the non-tensor item `fqn`.
  py::bytes read_bytes(const std::string& fqn) const {
    const DcpBytesItem* item = checkpoint_->metadata().find_bytes(fqn);
    if (!item) raise(Status::Error(checkpoint_->metadata_path() + ": no bytes item '" + fqn + "'"));
    Result<std::string> bytes = Status::Error("");
    {
      py::gil_scoped_release release;
      bytes = checkpoint_->read_bytes(*item);
    }
    if (!bytes.ok()) raise(bytes.status());
    return py::bytes(*bytes);
  }

 private:
  std::unique_ptr<DcpCheckpoint> checkpoint_;
};

std::string manifest(const std::string& path, std::optional<std::int64_t> iteration) {
  auto reader = CheckpointReader::open(path, iteration);
  if (!reader.ok()) raise(reader.status());
  return to_json(reader->manifest()).dump();
}

// Runs `operation` with the GIL released; progress goes to `progress` (None: none; True: stderr; a callable:
// progress(label, done_bytes, total_bytes, final) called from the engine's reporting thread with the GIL taken). An
// exception the callback raises, or a signal handler's (Ctrl-C's KeyboardInterrupt, checked every 100 ms), cancels the
// operation: it stops at its next piece of work, leaves no destination, and the exception is raised.
std::string run_with_progress(const py::object& progress, bool& enabled,
                              const std::function<Result<std::string>()>& operation) {
  const bool callback = !progress.is_none() && !py::isinstance<py::bool_>(progress);
  enabled = callback || (py::isinstance<py::bool_>(progress) && progress.cast<bool>());
  std::optional<py::error_already_set> raised;
  Result<std::string> shown = Status::Error("");
  {
    py::gil_scoped_release release;
    std::optional<ScopedProgressSink> sink;
    if (callback)
      sink.emplace([&](const std::string& label, std::uint64_t done, std::uint64_t total, bool final) {
        py::gil_scoped_acquire gil;
        if (raised) return;
        try {
          progress(label, done, total, final);
        } catch (py::error_already_set& e) {
          raised.emplace(std::move(e));
          cancel();
        }
      });
    // The interpreter's signal handlers run in its main thread only; from another thread this finds nothing.
    const ScopedCancelCheck interrupted([&] {
      py::gil_scoped_acquire gil;
      if (PyErr_CheckSignals() == 0) return false;
      raised.emplace();  // takes the handler's exception
      return true;
    });
    shown = operation();
  }
  if (raised) throw std::move(*raised);
  if (!shown.ok()) raise(shown.status());
  return *shown;
}

template <typename T>
std::optional<T> optional_arg(const py::dict& args, const char* key) {
  if (!args.contains(key) || args[key].is_none()) return std::nullopt;
  return args[key].cast<T>();
}

CheckpointFormat format_arg(const py::dict& args, const char* key) {
  auto format = parse_format(args[key].cast<std::string>());
  if (!format.ok()) throw py::value_error(std::string(key) + ": " + format.status().message());
  return *format;
}

// The dist_optimizer keyword (a dict of Megatron-LM's argument names in snake case, or None): the dp_reshardable
// optimizer format for a megatron-dist destination.
std::optional<DpReshardableWriteOptions> dist_optimizer_arg(const py::dict& args, bool with_dp) {
  if (args["dist_optimizer"].is_none()) return std::nullopt;
  const auto given = args["dist_optimizer"].cast<py::dict>();
  std::set<std::string> known = {
      "overlap_grad_reduce", "ddp_bucket_size", "grad_reduce_in_bf16", "transformer_impl", "lr", "min_lr",
      "weight_decay",        "adam_beta1",      "adam_beta2",          "adam_eps"};
  if (with_dp) known.insert("dp");
  for (const auto& [key, value] : given)
    if (!known.count(key.cast<std::string>()))
      throw py::value_error("dist_optimizer: unknown setting '" + key.cast<std::string>() + "'");
  DpReshardableWriteOptions o;
  auto take = [&](const char* key, auto& field) {
    if (given.contains(key) && !given[key].is_none()) field = given[key].cast<std::decay_t<decltype(field)>>();
  };
  take("dp", o.dp);
  take("overlap_grad_reduce", o.overlap_grad_reduce);
  take("grad_reduce_in_bf16", o.grad_reduce_in_bf16);
  take("min_lr", o.min_lr);
  take("weight_decay", o.weight_decay);
  take("adam_beta1", o.adam_beta1);
  take("adam_beta2", o.adam_beta2);
  take("adam_eps", o.adam_eps);
  if (given.contains("ddp_bucket_size") && !given["ddp_bucket_size"].is_none())
    o.bucket_size = given["ddp_bucket_size"].cast<std::int64_t>();
  if (given.contains("lr") && !given["lr"].is_none()) o.lr = given["lr"].cast<double>();
  if (given.contains("transformer_impl") && !given["transformer_impl"].is_none()) {
    const auto impl = given["transformer_impl"].cast<std::string>();
    if (impl != "local" && impl != "transformer_engine")
      throw py::value_error("dist_optimizer: transformer_impl '" + impl + "' is not one of local, transformer_engine");
    o.transformer_impl = impl == "local" ? NormNaming::kLocal : NormNaming::kTransformerEngine;
  }
  const Status checked = check_dp_reshardable_options(o);
  if (!checked.ok()) throw py::value_error("dist_optimizer: " + checked.message());
  return o;
}

// trestle.convert's keywords (tools/python/trestle/__init__.py) as the CLI's request.
std::string convert(const std::string& src, const std::string& dst, const py::dict& args, const py::object& progress) {
  ConvertRequest r;
  r.src = src;
  r.dst = dst;
  r.from = format_arg(args, "from_format");
  r.to = format_arg(args, "to_format");
  r.layout.tp = args["tp"].cast<int>();
  r.layout.pp = args["pp"].cast<int>();
  r.layout.vpp = args["vpp"].cast<int>();
  r.layout.ep = args["ep"].cast<int>();
  r.layout.first_stage_layers = args["first_stage_layers"].cast<std::int64_t>();
  r.layout.last_stage_layers = args["last_stage_layers"].cast<std::int64_t>();
  r.layout.make_vocab_size_divisible_by = args["make_vocab_size_divisible_by"].cast<std::int64_t>();
  for (int size : {r.layout.tp, r.layout.pp, r.layout.vpp, r.layout.ep})
    if (size < 1) throw py::value_error("tp, pp, vpp and ep must be at least 1");
  if (const Status s =
          check_vocab_size_divisible_by(r.layout.make_vocab_size_divisible_by, "make_vocab_size_divisible_by");
      !s.ok())
    throw py::value_error(s.message());
  const auto norms = args["norms"].cast<std::string>();
  if (norms != "te" && norms != "local") throw py::value_error("norms '" + norms + "' is not one of te, local");
  r.norms = norms == "local" ? NormNaming::kLocal : NormNaming::kTransformerEngine;
  auto dtype = parse_conversion_dtype(args["dtype"].cast<std::string>());
  if (!dtype.ok()) throw py::value_error(dtype.status().message());
  r.dtype = *dtype;
  const auto codec = codec_of(args["codec"].cast<std::string>());
  if (!codec.ok()) throw py::value_error(codec.status().message());
  r.codec = *codec;
  r.max_shard_bytes = args["max_shard_size"].cast<std::uint64_t>();
  const auto experts = args["hf_expert_layout"].cast<std::string>();
  if (experts != "source") {
    r.experts = expert_layout_from_name(experts);
    if (!r.experts)
      throw py::value_error("hf_expert_layout '" + experts +
                            "' is not one of source, original, fused, fused_transposed");
  }
  r.iteration = optional_arg<std::int64_t>(args, "iteration");
  if (auto config = optional_arg<std::string>(args, "hf_config")) r.source.hf_config = *config;
  r.model_only = args["model_only"].cast<bool>();
  r.dp_reshardable = dist_optimizer_arg(args, true);
  r.base = optional_arg<std::string>(args, "base");
  r.merge_lora = args["merge_lora"].cast<bool>();
  r.dry_run = args["dry_run"].cast<bool>();
  const Status checked = check_convert_request(r);
  if (!checked.ok()) throw py::value_error(checked.message());
  return run_with_progress(progress, r.progress, [&] { return run_convert_request(r); });
}

// trestle.reshard's keywords as the CLI's request.
std::string reshard(const std::string& src, const std::string& dst, const py::dict& args, const py::object& progress) {
  ReshardRequest r;
  r.in = src;
  r.out = dst;
  r.change.tp = optional_arg<int>(args, "tp");
  r.change.pp = optional_arg<int>(args, "pp");
  r.change.vpp = optional_arg<int>(args, "vpp");
  r.change.ep = optional_arg<int>(args, "ep");
  r.change.dp = optional_arg<int>(args, "dp");
  for (const auto& size : {r.change.tp, r.change.pp, r.change.vpp, r.change.ep, r.change.dp})
    if (size && *size < 1) throw py::value_error("tp, pp, vpp, ep and dp must be at least 1");
  r.change.first_stage_layers = optional_arg<std::int64_t>(args, "first_stage_layers");
  r.change.last_stage_layers = optional_arg<std::int64_t>(args, "last_stage_layers");
  if (!args["to_format"].is_none()) r.to = format_arg(args, "to_format");
  r.source.iteration = optional_arg<std::int64_t>(args, "iteration");
  if (auto config = optional_arg<std::string>(args, "hf_config")) r.source.hf_config = *config;
  r.source.model_only = args["model_only"].cast<bool>();
  r.dp_reshardable = dist_optimizer_arg(args, false);
  const auto codec = codec_of(args["codec"].cast<std::string>());
  if (!codec.ok()) throw py::value_error(codec.status().message());
  r.codec = *codec;
  r.dry_run = args["dry_run"].cast<bool>();
  return run_with_progress(progress, r.progress, [&] { return run_reshard_request(r); });
}

}  // namespace
}  // namespace trestle::python

PYBIND11_MODULE(_trestle, m) {
  using namespace trestle::python;
  m.doc() = "Trestle's checkpoint engine (C++): save, load and inspect Trestle checkpoints; DCP item files";
  py::class_<Saver>(m, "Saver")
      .def(py::init<>())
      .def("save_async", &Saver::save_async, py::arg("pieces"), py::arg("path"), py::arg("iteration"), py::arg("codec"),
           py::arg("overwrite"), py::arg("training"), py::arg("rank") = 0, py::arg("size") = 1,
           py::arg("all_gather") = py::none())
      .def("wait", &Saver::wait)
      .def_property_readonly("in_flight", &Saver::in_flight);
  m.def("check_pieces", &check_pieces, py::arg("pieces"));
  m.def("load", &load, py::arg("path"), py::arg("pieces"), py::arg("iteration") = py::none());
  m.def("manifest", &manifest, py::arg("path"), py::arg("iteration") = py::none());
  m.def("convert", &convert, py::arg("src"), py::arg("dst"), py::arg("args"), py::arg("progress"));
  m.def("reshard", &reshard, py::arg("src"), py::arg("dst"), py::arg("args"), py::arg("progress"));
  m.def("write_dcp_file", &write_dcp_file, py::arg("dir"), py::arg("rank"), py::arg("items"));
  py::class_<DcpReader>(m, "DcpReader")
      .def(py::init<const std::string&, const std::string&>(), py::arg("dir"), py::arg("metadata") = ".metadata")
      .def("read", &DcpReader::read, py::arg("requests"), py::arg("threads") = 4)
      .def("read_bytes", &DcpReader::read_bytes, py::arg("fqn"));
}
