// trestle export --to hdf5 CKPT OUT.h5 and trestle import --from hdf5 IN.h5 ROOT: HDF5 interchange.
#include <cstdio>
#include <cstring>
#include <cxxopts.hpp>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/atomic_file.h"
#include "ckpt/byte_size.h"
#include "ckpt/checkpoint_dir.h"
#include "ckpt/checkpoint_path.h"
#include "ckpt/hdf5_export.h"
#include "ckpt/removed_on_signal.h"
#include "convert/bridge/bridge_model_json.h"
#include "convert/output_dir.h"
#include "convert/reshard.h"
#include "tools/command.h"
#include "tools/isolated_run.h"

namespace trestle::cli {
namespace {

// Both take --to/--from FORMAT (only hdf5), --iteration and two paths.
void declare_transfer(cxxopts::Options& spec, const char* flag) {
  spec.add_options()(flag, "format (hdf5)", cxxopts::value<std::string>()->default_value("hdf5"))(
      "iteration", "iteration (default: the tracker's latest; on import, the file's)", cxxopts::value<std::int64_t>())(
      "in", "", cxxopts::value<std::string>())("out", "", cxxopts::value<std::string>());
  spec.parse_positional({"in", "out"});  // (not a list option, which would split a path at its commas)
  spec.positional_help("IN OUT");
}

// The two paths, or a usage error.
Result<std::vector<std::string>> transfer_paths(const cxxopts::ParseResult& args, const char* flag) {
  if (!args.count("in") || !args.count("out"))
    return Status::Error("expected two paths, got " + std::to_string(args.count("in") + args.count("out")));
  const std::vector<std::string> paths = {args["in"].as<std::string>(), args["out"].as<std::string>()};
  if (paths[0].empty() || paths[1].empty()) return Status::Error("an empty path");
  if (args[flag].as<std::string>() != "hdf5")
    return Status::Error("only hdf5 is supported, not '" + args[flag].as<std::string>() + "'");
  return paths;
}

std::optional<std::int64_t> iteration_of(const cxxopts::ParseResult& args) {
  if (!args.count("iteration")) return std::nullopt;
  return args["iteration"].as<std::int64_t>();
}

Outcome run_export(const cxxopts::ParseResult& args) {
  auto paths = transfer_paths(args, "to");
  if (!paths.ok()) return usage_error(paths.status());
  const std::string& in = (*paths)[0];
  const std::string& out = (*paths)[1];
  auto reader = open_checkpoint_path(in, iteration_of(args));  // a root or one of its iteration directories
  if (!reader.ok()) return failure(reader.status());
  // Never into the checkpoint it reads (its iteration directory, or the checkpoint directory holding it).
  if (Status outside = check_output_outside_source(out, reader->directory()); !outside.ok()) return failure(outside);
  auto report = export_hdf5(*reader, out);
  if (!report.ok()) return failure(report.status());
  std::printf("wrote %s: %zu tensors, %s\n", out.c_str(), report->tensors, format_bytes(report->bytes).c_str());
  return finished();
}

// An imported Megatron model must hold exactly the tensors its model description plans, as reshard requires.
Status check_model_tensors(const Manifest& header, const std::vector<LayoutTensor>& tensors, const std::string& in) {
  if (!header.model.contains("parallel")) return OkStatus();  // not a Megatron model: no plan to check against
  TRESTLE_ASSIGN_OR_RETURN(const BridgedModel bridged,
                           bridged_model_from_json(header.model, in + " (trestle_manifest)"));
  return check_checkpoint_tensors(bridged, tensors, in);
}

// Import never replaces an iteration (the save it makes has no overwrite): one already in the root is refused before
// any tensor is read or anything written, saying what import can do instead.
// Nor does it move the root's tracker back: an iteration older than the tracked one is refused too (a --load of the
// root would resume from it instead of the newer one).
Status check_iteration_is_new(const std::string& root, std::int64_t iteration) {
  const std::string dir = root + "/" + iteration_dir_name(iteration);
  std::error_code ec;
  if (std::filesystem::exists(dir, ec))
    return Status::Error(dir + ": iteration " + std::to_string(iteration) +
                         " already exists; import under another iteration (--iteration N) or into another root");
  if (!std::filesystem::exists(root, ec)) return OkStatus();
  TRESTLE_ASSIGN_OR_RETURN(const auto latest, read_latest_iteration(root));
  if (latest && *latest > iteration)
    return Status::Error(root + ": its tracker names iteration " + std::to_string(*latest) + ", newer than " +
                         std::to_string(iteration) + ", and import would move it back (a --load would then resume " +
                         "from the older one); import under a later iteration (--iteration N) or into another root");
  return OkStatus();
}

// A root this import created that holds nothing but the save's lock: removed, as if the import had never run.
void remove_empty_fresh_root(const std::string& out) {
  std::error_code ec;
  if (!std::filesystem::is_directory(out, ec)) return;
  bool only_lock = true;
  for (const auto& entry : std::filesystem::directory_iterator(out, ec))
    only_lock = only_lock && entry.path().filename() == kSaveLockFile;
  if (only_lock && !ec) std::filesystem::remove_all(out, ec);
}

// A root this import created holds nothing of it after a failure; an existing root loses only what the dead import
// began (its .tmp.iter_ directory).
void remove_failed_import(const std::string& out, bool fresh_root) {
  std::error_code ec;
  if (!std::filesystem::is_directory(out, ec)) return;
  (void)remove_abandoned_dirs(out, ".tmp.iter_");
  if (fresh_root) remove_empty_fresh_root(out);
}

Outcome import_into(const std::string& in, const std::string& out, std::optional<std::int64_t> iteration,
                    bool fresh_root) {
  // The root's save lock, as a trainer saving there holds it for its whole run: an import beside a live trainer would
  // move its tracker (and the trainer would later save over the imported iteration).
  auto root_lock = lock_save_root(out);
  if (!root_lock.ok()) return failure(root_lock.status());  // (the root, even one made meanwhile, is its holder's)
  const RemovedOnSignal lock_removed_on_signal(out + "/" + kSaveLockFile);  // (as the staging beside it is)
  std::optional<FileLock> untracked;  // held until the import has replaced that iteration
  auto report = import_hdf5(in, out, iteration, [&](const Manifest& header, const auto& tensors) -> Result<bool> {
    const std::int64_t it = iteration.value_or(header.iteration);
    TRESTLE_RETURN_IF_ERROR(check_model_tensors(header, tensors, in));
    if (std::filesystem::is_directory(out)) {
      TRESTLE_ASSIGN_OR_RETURN(untracked, take_untracked_commit(out, it));
    }
    if (untracked) {
      std::printf(
          "%s/%s was committed by an earlier run that was killed before it moved the tracker there: "
          "importing it again, in its place\n",
          out.c_str(), iteration_dir_name(it).c_str());
      std::fflush(stdout);
      return true;
    }
    if (std::filesystem::is_directory(out)) {  // what dead writers left, as the save would remove it
      TRESTLE_RETURN_IF_ERROR(remove_abandoned_dirs(out, ".tmp.iter_").status());
      remove_dead_temporaries(out + "/" + kTrackerFile);
    }
    TRESTLE_RETURN_IF_ERROR(check_iteration_is_new(out, it));
    return false;
  });
  if (!report.ok()) {
    if (fresh_root) remove_failed_import(out, fresh_root);
    return failure(report.status());
  }
  std::printf("imported %s into %s: %zu tensors, %s\n", in.c_str(), out.c_str(), report->tensors,
              format_bytes(report->bytes).c_str());
  return finished();
}

Outcome run_import(const cxxopts::ParseResult& args) {
  auto paths = transfer_paths(args, "from");
  if (!paths.ok()) return usage_error(paths.status());
  const std::string& in = (*paths)[0];
  const std::string& out = (*paths)[1];
  const auto iteration = iteration_of(args);
  std::error_code ec;
  const bool fresh_root = !std::filesystem::exists(std::filesystem::symlink_status(out, ec));
  // HDF5 (1.10, Debian 12's) crashes on some damaged object headers (a flipped byte in an attribute message faults in
  // H5Aexists): the file is read in a child process, whose death by a fault names the file. An import ended from
  // outside leaves nothing of itself, as an interrupted conversion.
  return run_isolated(
      [&] { return import_into(in, out, iteration, fresh_root); },
      [&](int signal) {
        remove_failed_import(out, fresh_root);
        return failure(Status::Error(in + ": the HDF5 library crashed reading it (" + std::string(strsignal(signal)) +
                                     "): the file is damaged; nothing was imported"));
      },
      // Ended from outside: the child's handlers removed what it began (SIGTERM, SIGINT, SIGHUP passed on to it), or
      // the next run into the root does (SIGKILL: a commit it left untracked is then imported again in its place).
      [&](int) {
        if (fresh_root) remove_empty_fresh_root(out);
      });
}

}  // namespace

const CommandSpec kExportCommand = {
    .name = "export",
    .summary = "write a Trestle checkpoint as HDF5 (one dataset per tensor)",
    .description =
        "Write a Trestle checkpoint as HDF5: one dataset per tensor with a 'dtype'\n"
        "attribute (bf16 and fp8 kept as raw bits), readable with h5py. The files the checkpoint\n"
        "carries (hf_files/...) travel in the group 'trestle_files'.\n\n"
        "  trestle export --to hdf5 CKPT_ROOT OUT.h5   (CKPT_ROOT or one of its iter_N directories)",
    .declare = [](cxxopts::Options& spec) { declare_transfer(spec, "to"); },
    .run = run_export,
};

const CommandSpec kImportCommand = {
    .name = "import",
    .summary = "read an exported HDF5 file back into a Trestle checkpoint",
    .description =
        "Read an HDF5 file written by `trestle export` back into a Trestle checkpoint. Every tensor\n"
        "the file lists (and, for a Megatron model, its model description plans) must be there with\n"
        "its dtype and shape and with data written; nothing else may be. The checkpoint is saved as the\n"
        "file's iteration (or --iteration's); an iteration the root already holds is refused, never replaced.\n\n"
        "  trestle import --from hdf5 IN.h5 CKPT_ROOT",
    .declare = [](cxxopts::Options& spec) { declare_transfer(spec, "from"); },
    .run = run_import,
};

}  // namespace trestle::cli
