// Test-only entry points for tests/interop/test_torch_dist_interop.py, exchanging tensors through safetensors files:
//   read-dcp DIR OUT.safetensors [PARTS]   every tensor of a torch_dist checkpoint, assembled; with PARTS > 1 each
//                                          tensor is read as PARTS boxes along dim 0 (exercising reshard on read)
//   write-dcp IN.safetensors DIR RANKS     a torch_dist checkpoint where each tensor is split along dim 0 into RANKS
//                                          pieces, rank r writing __r_0.distcp; plus metadata.json and a bytes item
//                                          "trestle_note" (torch.save of {'writer': 'trestle', 'ranks': RANKS})
//   read-legacy FILE OUT.safetensors       every tensor of one model_optim_rng.pt, gathered contiguous
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "convert/formats/safetensors/safetensors_file.h"
#include "convert/formats/safetensors/safetensors_writer.h"
#include "convert/formats/torch/dcp_checkpoint.h"
#include "convert/formats/torch/megatron_legacy.h"

namespace trestle {
namespace {

int fail(const Status& s) {
  std::fprintf(stderr, "torch_dist_tool: %s\n", s.message().c_str());
  return 1;
}

Status write_safetensors(const std::string& out, const std::vector<TensorSpec>& specs,
                         const std::map<std::string, std::vector<std::byte>>& data) {
  TRESTLE_ASSIGN_OR_RETURN(auto writer, SafetensorsWriter::create(out, specs, {}));
  for (const auto& s : specs) TRESTLE_RETURN_IF_ERROR(writer->write(s.name, data.at(s.name)));
  return writer->commit();
}

int read_dcp(const std::string& dir, const std::string& out, std::int64_t parts) {
  auto ckpt = DcpCheckpoint::open(dir);
  if (!ckpt.ok()) return fail(ckpt.status());
  std::vector<TensorSpec> specs;
  std::map<std::string, std::vector<std::byte>> data;
  for (const auto& t : ckpt->metadata().tensors) {
    const std::size_t es = dtype_size(t.dtype);
    auto& buf = data[t.name];
    buf.resize(static_cast<std::size_t>(numel(t.shape)) * es);
    if (t.shape.empty() || parts <= 1 || t.shape[0] < parts) {
      if (Status s = ckpt->read_box(t.name, whole_box(t.shape), buf.data()); !s.ok()) return fail(s);
    } else {
      const std::int64_t row = numel(t.shape) / t.shape[0];
      for (std::int64_t p = 0; p < parts; ++p) {
        Box box = whole_box(t.shape);
        box.offset[0] = t.shape[0] * p / parts;
        box.shape[0] = t.shape[0] * (p + 1) / parts - box.offset[0];
        std::byte* dst = buf.data() + static_cast<std::size_t>(box.offset[0] * row) * es;
        if (Status s = ckpt->read_box(t.name, box, dst); !s.ok()) return fail(s);
      }
    }
    specs.push_back({t.name, t.dtype, t.shape});
  }
  if (Status s = write_safetensors(out, specs, data); !s.ok()) return fail(s);
  return 0;
}

int write_dcp(const std::string& in, const std::string& dir, int ranks) {
  auto file = SafetensorsFile::open(in);
  if (!file.ok()) return fail(file.status());
  std::vector<DcpRankItems> items;
  for (int r = 0; r < ranks; ++r) {
    std::vector<DcpTensorPiece> pieces;
    for (const auto& e : file->tensors()) {
      const ConstTensorView view = file->view(e);
      DcpTensorPiece p{e.name, e.dtype, e.shape, whole_box(e.shape), view.bytes()};
      if (!e.shape.empty() && e.shape[0] >= ranks) {
        const std::size_t row = static_cast<std::size_t>(numel(e.shape) / e.shape[0]) * dtype_size(e.dtype);
        p.box.offset[0] = e.shape[0] * r / ranks;
        p.box.shape[0] = e.shape[0] * (r + 1) / ranks - p.box.offset[0];
        p.data = view.bytes().subspan(static_cast<std::size_t>(p.box.offset[0]) * row,
                                      static_cast<std::size_t>(p.box.shape[0]) * row);
      } else if (r != 0) {
        continue;  // small tensors are written once, by rank 0
      }
      pieces.push_back(p);
    }
    std::vector<DcpObjectPiece> objects;
    if (r == 0) {
      PickleDocument d;
      PickleValue* note = d.dict({{d.string("writer"), d.string("trestle")}, {d.string("ranks"), d.integer(ranks)}});
      auto bytes = torch_save_object_bytes(note);
      if (!bytes.ok()) return fail(bytes.status());
      objects.push_back({"trestle_note", std::move(bytes).value()});
    }
    auto written = write_dcp_rank_file(dir, r, pieces, objects);
    if (!written.ok()) return fail(written.status());
    items.push_back(std::move(written).value());
  }
  if (Status s = write_dcp_metadata_file(dir, items); !s.ok()) return fail(s);
  if (Status s = write_megatron_metadata_json(dir); !s.ok()) return fail(s);
  return 0;
}

int read_legacy(const std::string& path, const std::string& out) {
  auto rank = LegacyRankFile::open(path);
  if (!rank.ok()) return fail(rank.status());
  std::vector<TensorSpec> specs;
  std::map<std::string, std::vector<std::byte>> data;
  for (const auto& t : rank->tensors()) {
    auto& buf = data[t.name];
    buf.resize(static_cast<std::size_t>(numel(t.ref.shape)) * dtype_size(t.ref.dtype));
    if (Status s = rank->read(t.name, buf.data()); !s.ok()) return fail(s);
    specs.push_back({t.name, t.ref.dtype, t.ref.shape});
  }
  if (Status s = write_safetensors(out, specs, data); !s.ok()) return fail(s);
  return 0;
}

}  // namespace
}  // namespace trestle

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  if (cmd == "read-dcp" && (argc == 4 || argc == 5))
    return trestle::read_dcp(argv[2], argv[3], argc == 5 ? std::stoll(argv[4]) : 1);
  if (cmd == "write-dcp" && argc == 5) return trestle::write_dcp(argv[2], argv[3], std::stoi(argv[4]));
  if (cmd == "read-legacy" && argc == 4) return trestle::read_legacy(argv[2], argv[3]);
  std::fprintf(stderr,
               "usage: torch_dist_tool read-dcp DIR OUT.safetensors [PARTS] | write-dcp IN.safetensors DIR RANKS |\n"
               "       read-legacy model_optim_rng.pt OUT.safetensors\n");
  return 2;
}
