// trestle diff A B: compares two checkpoints in canonical (layout-free) space, tensor by tensor.
#include <cmath>
#include <cstdio>
#include <cxxopts.hpp>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "convert/checkpoint_diff.h"
#include "convert/sources/canonical_source.h"
#include "tools/command.h"

namespace trestle::cli {
namespace {

nlohmann::json number(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(std::to_string(v)); }

void print_json(const CheckpointDiff& diff, bool matches) {
  nlohmann::json tensors = nlohmann::json::array();
  for (const auto& t : diff.tensors)
    tensors.push_back({{"name", t.name},
                       {"result", diff_kind_name(t.kind)},
                       {"detail", t.detail},
                       {"bit_equal", t.bit_equal()},
                       {"elements", t.elements},
                       {"differing", t.differing},
                       {"bits_differing", t.bits_differing},
                       {"non_finite", t.non_finite},
                       {"max_abs", number(t.max_abs)},
                       {"max_rel", number(t.max_rel)}});
  std::cout << nlohmann::json{{"identical", diff.identical()},
                              {"bit_identical", diff.bit_identical()},
                              {"match", matches},
                              {"tensors", tensors}}
                   .dump(2)
            << "\n";
}

// The tolerances given (--atol, --rtol), under which a differing tensor may still be accepted.
struct Tolerance {
  double atol = 0, rtol = 0;
};

void print_table(const CheckpointDiff& diff, bool all, const std::optional<Tolerance>& tolerance) {
  std::size_t bit_equal = 0, value_equal = 0, tolerated = 0;
  for (const auto& t : diff.tensors) {
    const auto name = t.name.c_str();
    const auto elements = static_cast<long long>(t.elements);
    if (t.bit_equal()) {
      ++bit_equal;
      if (all) std::printf("%-72s bit-equal (%lld elements)\n", name, elements);
    } else if (t.kind == TensorDiff::Kind::kEqual) {
      ++value_equal;
      std::printf("%-72s equal in value, %lld of %lld elements differ in bits (+0 / -0, NaN payloads)\n", name,
                  static_cast<long long>(t.bits_differing), elements);
    } else if (t.kind == TensorDiff::Kind::kDifferent) {
      const bool accepted = tolerance && t.within(tolerance->atol, tolerance->rtol);
      tolerated += accepted;
      std::printf("%-72s %s: %lld of %lld elements, max abs %g, max rel %g", name,
                  accepted ? "different, within the tolerance" : "DIFFERENT", static_cast<long long>(t.differing),
                  elements, t.max_abs, t.max_rel);
      if (t.non_finite)
        std::printf(" (%lld NaN or infinite against another value)", static_cast<long long>(t.non_finite));
      std::printf("\n");
    } else {
      std::printf("%-72s %s%s%s\n", name, std::string(diff_kind_name(t.kind)).c_str(), t.detail.empty() ? "" : ": ",
                  t.detail.c_str());
    }
  }
  std::printf("%zu tensors: %zu bit-equal, ", diff.tensors.size(), bit_equal);
  if (value_equal) std::printf("%zu equal in value with bits differing, ", value_equal);
  if (tolerance) std::printf("%zu different within the tolerance, ", tolerated);
  std::printf("%zu not\n", diff.tensors.size() - bit_equal - value_equal - tolerated);
}

void declare_diff(cxxopts::Options& spec) {
  spec.add_options()("iteration-a", "iteration of A (default: its latest)", cxxopts::value<std::int64_t>())(
      "iteration-b", "iteration of B (default: its latest)", cxxopts::value<std::int64_t>())(
      "atol", "accept tensors whose largest absolute difference is at most this", cxxopts::value<double>())(
      "rtol", "accept tensors whose largest relative difference is at most this", cxxopts::value<double>())(
      "hf-config", "config.json describing a Megatron checkpoint's model (when it keeps none and has no args)",
      cxxopts::value<std::string>())("all", "list bit-equal tensors too")("json", "print the comparison as JSON")(
      "q,quiet", "no progress output")("a", "first checkpoint", cxxopts::value<std::string>())(
      "b", "second checkpoint", cxxopts::value<std::string>());
  spec.parse_positional({"a", "b"});
  spec.positional_help("A B");
}

Outcome run_diff(const cxxopts::ParseResult& args) {
  if (!args.count("a") || !args.count("b")) return usage_error("A and B are required");
  if (Outcome usage = check_paths_not_empty(args, {{"a", "A"}, {"b", "B"}, {"hf-config", "--hf-config"}});
      usage.code != kExitOk)
    return usage;
  for (const char* tolerance : {"atol", "rtol"})
    if (args.count(tolerance) && !(args[tolerance].as<double>() >= 0))
      return usage_error(std::string("--") + tolerance + " must be 0 or more");
  auto open = [&](const char* which, const char* iteration) -> Result<std::unique_ptr<CanonicalSource>> {
    const std::string path = args[which].as<std::string>();
    SourceOptions options;
    if (args.count(iteration)) options.iteration = args[iteration].as<std::int64_t>();
    if (args.count("hf-config")) options.hf_config = args["hf-config"].as<std::string>();
    TRESTLE_ASSIGN_OR_RETURN(const CheckpointFormat format, detect_format(path, options.iteration));
    return open_canonical_source(format, path, options);
  };
  auto a = open("a", "iteration-a");
  if (!a.ok()) return failure(a.status());
  auto b = open("b", "iteration-b");
  if (!b.ok()) return failure(b.status());
  auto diff = diff_checkpoints(**a, **b, !args.count("quiet") && !args.count("json"));
  if (!diff.ok()) return failure(diff.status());
  std::optional<Tolerance> tolerance;
  if (args.count("atol") || args.count("rtol"))
    tolerance = Tolerance{args.count("atol") ? args["atol"].as<double>() : 0,
                          args.count("rtol") ? args["rtol"].as<double>() : 0};
  const bool matches = tolerance ? diff->within(tolerance->atol, tolerance->rtol) : diff->identical();
  if (args.count("json")) {
    print_json(*diff, matches);
  } else {
    print_table(*diff, args.count("all") > 0, tolerance);
  }
  return finished(matches ? kExitOk : kExitFailure);
}

}  // namespace

const CommandSpec kDiffCommand = {
    .name = "diff",
    .summary = "compare two checkpoints tensor by tensor in canonical (layout-free) space",
    .description =
        "Compare two checkpoints tensor by tensor in canonical (layout-free) space, whatever parallel layouts and\n"
        "formats wrote them (Trestle, torch_dist, legacy mp_rank; detected): model weights and optimizer state\n"
        "alike (Megatron formats hold weights only). Values are compared: NaN equals NaN of any payload and\n"
        "+0 equals -0. Each tensor is bit-equal, equal in value with some elements differing in bits (+0 / -0,\n"
        "NaN payloads; listed with their count), or gets its number of differing elements and largest absolute\n"
        "and relative differences. A NaN or infinity against another value is never within a tolerance.\n"
        "Exit 0 when every tensor is equal in value (or within --atol/--rtol), 1 when not or when a checkpoint\n"
        "cannot be read, 2 on a usage error.",
    .declare = declare_diff,
    .run = run_diff,
};

}  // namespace trestle::cli
