// trestle bench reshard: a generated Llama-shaped bf16 model, converted once to a Trestle checkpoint in one layout,
// resharded to another by `trestle reshard` in child processes (wall time, peak RSS, cold source), beside the disk
// floor measured with fio in the same run; the result is checked bit-equal in canonical space with `trestle diff`.
#include <cxxopts.hpp>
#include <iostream>
#include <numeric>

#include "ckpt/byte_size.h"
#include "tools/bench/bench.h"
#include "tools/bench/bench_files.h"
#include "tools/bench/bench_fio.h"
#include "tools/bench/bench_main.h"
#include "tools/bench/bench_model.h"
#include "tools/bench/bench_options.h"
#include "tools/bench/bench_process.h"
#include "tools/bench/bench_report.h"
#include "tools/table.h"

namespace trestle::cli {
namespace {

constexpr BenchOptionSet kOptionSet{.size = "2GB", .size_help = "model size", .repeat = 2, .python_peer = false};

struct Options : BenchOptions {
  int from_tp = 2, from_pp = 2, tp = 4, pp = 1;
};

std::string layout_name(int tp, int pp) { return "tp" + std::to_string(tp) + "/pp" + std::to_string(pp); }

Status run_bench(const Options& o) {
  TRESTLE_ASSIGN_OR_RETURN(ScratchDir scratch, ScratchDir::create(o.dir));
  TRESTLE_ASSIGN_OR_RETURN(const LlamaShape shape,
                           llama_shape_for_layout(o.size, std::lcm(o.from_tp, o.tp), std::lcm(o.from_pp, o.pp)));
  TRESTLE_ASSIGN_OR_RETURN(const std::string trestle_cli, trestle_exe());
  std::string fio_name;
  if (o.fio) {
    TRESTLE_ASSIGN_OR_RETURN(fio_name, fio_version());
  }
  const std::string hf = scratch.fresh("hf"), source = scratch.fresh("source");
  progress("generating a Llama-shaped bf16 model (hidden " + std::to_string(shape.hidden) + ", " +
           std::to_string(shape.layers) + " layers) and converting it to " + layout_name(o.from_tp, o.from_pp));
  TRESTLE_RETURN_IF_ERROR(write_llama_hf_model(hf, shape));
  TRESTLE_RETURN_IF_ERROR(run_child_ok({trestle_cli, "convert", "--from", "hf", hf, "--to", "trestle", source, "--tp",
                                        std::to_string(o.from_tp), "--pp", std::to_string(o.from_pp), "--quiet"})
                              .status());
  TRESTLE_RETURN_IF_ERROR(remove_tree(hf));
  const std::uint64_t source_bytes = bytes_on_disk(source);
  TRESTLE_ASSIGN_OR_RETURN(const std::uint64_t available, free_bytes(scratch.path()));
  if (available < 3 * source_bytes)
    return Status::Error(scratch.path() + ": " + format_bytes(available) + " free, the benchmark needs about " +
                         format_bytes(3 * source_bytes) + "; use --dir on a larger disk or a smaller --size");
  FioCeiling ceiling;
  if (o.fio) {
    progress("fio ceiling (" + fio_name + ") on " + format_bytes(source_bytes));
    TRESTLE_ASSIGN_OR_RETURN(ceiling, measure_fio_ceiling(scratch.fresh("fio.dat"), source_bytes));
  }

  Samples rates;
  std::uint64_t peak_rss = 0, written = 0;
  const std::string to = layout_name(o.tp, o.pp);
  for (unsigned round = 0; round < o.repeat; ++round) {
    const std::string target = scratch.fresh("target");
    TRESTLE_RETURN_IF_ERROR(evict_from_page_cache(source));
    progress("round " + std::to_string(round + 1) + ": reshard " + layout_name(o.from_tp, o.from_pp) + " -> " + to);
    TRESTLE_ASSIGN_OR_RETURN(auto run, run_child_ok({trestle_cli, "reshard", source, target, "--tp",
                                                     std::to_string(o.tp), "--pp", std::to_string(o.pp), "--quiet"}));
    written = bytes_on_disk(target);
    rates.add(run.seconds, written);
    peak_rss = std::max(peak_rss, run.peak_rss);
    if (round == 0) {
      progress("checking the result bit-equal to the source with trestle diff");
      TRESTLE_RETURN_IF_ERROR(run_child_ok({trestle_cli, "diff", source, target, "--quiet"}).status());
    }
    TRESTLE_RETURN_IF_ERROR(remove_tree(target));
  }

  const double seconds = static_cast<double>(written) / 1e9 / rates.best();
  const double floor = o.fio ? static_cast<double>(source_bytes) / ceiling.read_bytes_per_s +
                                   static_cast<double>(written) / ceiling.write_bytes_per_s
                             : 0.0;
  std::printf("\nmodel: %s bf16 Llama (hidden %lld, %lld layers), %s -> %s; best of %u round(s); source cold\n",
              format_bytes(source_bytes).c_str(), static_cast<long long>(shape.hidden),
              static_cast<long long>(shape.layers), layout_name(o.from_tp, o.from_pp).c_str(), to.c_str(), o.repeat);
  if (o.fio)
    std::printf("disk (fio): write %.2f GB/s, read %.2f GB/s\n", ceiling.write_bytes_per_s / 1e9,
                ceiling.read_bytes_per_s / 1e9);
  Table table({"reshard", "seconds", "GB/s written", "peak RSS", "floor s", "x floor"});
  table.add({layout_name(o.from_tp, o.from_pp) + " -> " + to, std::to_string(seconds).substr(0, 6),
             format_rate(rates, false), format_bytes(peak_rss), o.fio ? std::to_string(floor).substr(0, 6) : "-",
             o.fio ? format_ratio(seconds, floor) : "-"});
  table.print(stdout, {false, true, true, true, true, true});
  std::printf("result bit-equal to the source in canonical space (trestle diff): yes\n");
  if (o.fio)
    std::printf(
        "floor = bytes read / fio read rate + bytes written / fio write rate (reads and writes overlap, so\n"
        "a reshard can beat it; its hard floor is the larger term)\n");
  if (!o.json_out.empty()) {
    nlohmann::json report = {{"benchmark", "reshard"},
                             {"source_bytes", source_bytes},
                             {"written_bytes", written},
                             {"from", {{"tp", o.from_tp}, {"pp", o.from_pp}}},
                             {"to", {{"tp", o.tp}, {"pp", o.pp}}},
                             {"machine", machine_facts()},
                             {"trestle", {{"reshard", rates.to_json()}, {"peak_rss", peak_rss}}}};
    if (o.fio)
      report["fio"] = {{"version", fio_name},
                       {"write_gb_per_s", ceiling.write_bytes_per_s / 1e9},
                       {"read_gb_per_s", ceiling.read_bytes_per_s / 1e9},
                       {"floor_seconds", floor}};
    TRESTLE_RETURN_IF_ERROR(write_json_file(o.json_out, report));
  }
  return OkStatus();
}

Result<Options> parse_options(const cxxopts::ParseResult& args) {
  Options o;
  TRESTLE_ASSIGN_OR_RETURN(static_cast<BenchOptions&>(o), parse_bench_options(args, kOptionSet));
  o.from_tp = args["from-tp"].as<int>();
  o.from_pp = args["from-pp"].as<int>();
  o.tp = args["tp"].as<int>();
  o.pp = args["pp"].as<int>();
  if (std::min({o.from_tp, o.from_pp, o.tp, o.pp}) < 1) return Status::Error("sizes must be at least 1");
  return o;
}

}  // namespace

int bench_reshard_main(int argc, char** argv) {
  cxxopts::Options spec("trestle bench reshard",
                        "Reshard a generated Llama-shaped bf16 Trestle checkpoint from one TP/PP layout to another\n"
                        "with `trestle reshard` (a child process per round: wall time, peak RSS; source evicted from\n"
                        "the page cache) beside the disk floor measured with fio in the same run.");
  spec.add_options()("from-tp", "source tensor parallel size", cxxopts::value<int>()->default_value("2"))(
      "from-pp", "source pipeline parallel size", cxxopts::value<int>()->default_value("2"))(
      "tp", "target tensor parallel size", cxxopts::value<int>()->default_value("4"))(
      "pp", "target pipeline parallel size", cxxopts::value<int>()->default_value("1"));
  add_bench_options(spec, kOptionSet);
  return run_bench_main<Options>("trestle bench reshard", spec, parse_options, run_bench, argc, argv);
}

}  // namespace trestle::cli
