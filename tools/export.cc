// trestle export --to hdf5 CKPT OUT.h5 and trestle import --from hdf5 IN.h5 ROOT: HDF5 interchange.
#include <cstdio>
#include <cxxopts.hpp>
#include <iostream>

#include "ckpt/byte_size.h"
#include "ckpt/hdf5_export.h"
#include "tools/command.h"

namespace trestle::cli {
namespace {

// Parses `trestle <verb> --<flag> FORMAT A B`; returns the exit code of a failed parse, or -1 to continue.
int parse(cxxopts::Options& spec, const char* flag, int argc, char** argv, cxxopts::ParseResult& out,
          std::vector<std::string>& paths) {
  spec.add_options()(flag, "format (hdf5)", cxxopts::value<std::string>()->default_value("hdf5"))(
      "iteration", "iteration (default: the tracker's latest; on import, the file's)", cxxopts::value<std::int64_t>())(
      "h,help", "show this help")("paths", "", cxxopts::value<std::vector<std::string>>());
  spec.parse_positional({"paths"});
  out = spec.parse(argc, argv);
  if (out.count("help")) {
    std::cout << spec.help() << "\n";
    return 0;
  }
  if (out.count("paths")) paths = out["paths"].as<std::vector<std::string>>();
  if (paths.size() != 2) {
    std::cerr << spec.help() << "\n" << spec.program() << ": expected two paths\n";
    return 2;
  }
  if (out[flag].as<std::string>() != "hdf5") {
    std::cerr << spec.program() << ": only hdf5 is supported, not '" << out[flag].as<std::string>() << "'\n";
    return 2;
  }
  return -1;
}

std::optional<std::int64_t> iteration_of(const cxxopts::ParseResult& args) {
  if (!args.count("iteration")) return std::nullopt;
  return args["iteration"].as<std::int64_t>();
}

}  // namespace

int export_main(int argc, char** argv) {
  cxxopts::Options spec("trestle export", "Write a Trestle checkpoint as HDF5: one dataset per tensor with a 'dtype'\n"
                                          "attribute (bf16 and fp8 kept as raw bits), readable with h5py.\n\n"
                                          "  trestle export --to hdf5 CKPT_ROOT OUT.h5");
  try {
    cxxopts::ParseResult args;
    std::vector<std::string> paths;
    if (const int rc = parse(spec, "to", argc, argv, args, paths); rc >= 0) return rc;
    auto reader = CheckpointReader::open(paths[0], iteration_of(args));
    auto report = reader.ok() ? export_hdf5(*reader, paths[1]) : Result<Hdf5Report>(reader.status());
    if (!report.ok()) {
      std::fprintf(stderr, "trestle export: %s\n", report.status().message().c_str());
      return 1;
    }
    std::printf("wrote %s: %zu tensors, %s\n", paths[1].c_str(), report->tensors, format_bytes(report->bytes).c_str());
    return 0;
  } catch (const cxxopts::exceptions::exception& e) {
    std::cerr << "trestle export: " << e.what() << "\n";
    return 2;
  }
}

int import_main(int argc, char** argv) {
  cxxopts::Options spec("trestle import", "Read an HDF5 file written by `trestle export` back into a Trestle checkpoint.\n\n"
                                          "  trestle import --from hdf5 IN.h5 CKPT_ROOT");
  try {
    cxxopts::ParseResult args;
    std::vector<std::string> paths;
    if (const int rc = parse(spec, "from", argc, argv, args, paths); rc >= 0) return rc;
    auto report = import_hdf5(paths[0], paths[1], iteration_of(args));
    if (!report.ok()) {
      std::fprintf(stderr, "trestle import: %s\n", report.status().message().c_str());
      return 1;
    }
    std::printf("imported %s into %s: %zu tensors, %s\n", paths[0].c_str(), paths[1].c_str(), report->tensors,
                format_bytes(report->bytes).c_str());
    return 0;
  } catch (const cxxopts::exceptions::exception& e) {
    std::cerr << "trestle import: " << e.what() << "\n";
    return 2;
  }
}

}  // namespace trestle::cli
