#include "parallel/layout/pipeline_layout_string.h"

#include <algorithm>
#include <utility>

namespace trestle {
namespace {

constexpr std::size_t kMaxExpanded = std::size_t{1} << 20;

std::string str(std::int64_t v) { return std::to_string(v); }

// The decimal digits at `at` (at least one; a count past kMaxExpanded reads as kMaxExpanded + 1) and where they end;
// none: {0, at}.
std::pair<std::size_t, std::size_t> count_at(const std::string& text, std::size_t at) {
  std::size_t end = at, value = 0;
  while (end < text.size() && text[end] >= '0' && text[end] <= '9') {
    value = std::min(value * 10 + static_cast<std::size_t>(text[end] - '0'), kMaxExpanded + 1);
    ++end;
  }
  return {value, end};
}

// megatron-core's two re.sub passes, left to right and without overlap: first "(X)*n" (X: one or more characters other
// than ')'), then "c*n" (c: any character but a newline), each replaced by n copies. Written out rather than through
// std::regex, whose matcher recurses once per character of a stranger's (a checkpoint's args) long string.
Result<std::string> unroll(const std::string& text, bool groups, const std::string& layout) {
  std::string out;
  std::size_t p = 0, next_close = text.find(')');  // the first ')' after p: found once per ')' (no quadratic scan)
  while (p < text.size()) {
    std::size_t body = p, length = 0, star = std::string::npos;
    if (groups && text[p] == '(') {
      if (next_close != std::string::npos && next_close <= p) next_close = text.find(')', p + 1);
      const std::size_t close = next_close;
      if (close != std::string::npos && close > p + 1) {
        body = p + 1;
        length = close - p - 1;
        star = close + 1;
      }
    } else if (!groups && text[p] != '\n') {
      length = 1;
      star = p + 1;
    }
    if (star != std::string::npos && star + 1 < text.size() && text[star] == '*') {
      const auto [times, end] = count_at(text, star + 1);
      if (end > star + 1) {
        if (times * length + out.size() > kMaxExpanded)
          return Status::Error("--pipeline-model-parallel-layout " + layout + ": expands past " + str(kMaxExpanded) +
                               " characters");  // (`layout`: shown cut, as parse_pipeline_layout passes it)
        for (std::size_t i = 0; i < times; ++i) out.append(text, body, length);
        p = end;
        continue;
      }
    }
    out += text[p++];
  }
  return out;
}

}  // namespace

Result<PipelineLayoutString> parse_pipeline_layout(const std::string& layout, int pp, std::int64_t num_layers,
                                                   std::int64_t mtp_num_layers) {
  // A stranger's string (a checkpoint's args) may be long: errors show its start.
  const std::string shown = layout.size() > 200 ? layout.substr(0, 200) + "..." : layout;
  const std::string where = "--pipeline-model-parallel-layout " + shown + ": ";
  if (pp < 1) return Status::Error("--pipeline-model-parallel-layout: the pipeline-parallel size must be at least 1");
  if (layout.find_first_not_of(" ") == std::string::npos)
    return Status::Error(
        "--pipeline-model-parallel-layout is empty: it lists every virtual stage's layers (e.g. Et|tL)");
  if (layout.size() > kMaxExpanded)
    return Status::Error("--pipeline-model-parallel-layout of " + str(static_cast<std::int64_t>(layout.size())) +
                         " characters: longer than " + str(kMaxExpanded));
  std::string text = layout;
  text.erase(std::remove(text.begin(), text.end(), ','), text.end());  // purely cosmetic commas
  TRESTLE_ASSIGN_OR_RETURN(text, unroll(text, /*groups=*/true, shown));
  TRESTLE_ASSIGN_OR_RETURN(text, unroll(text, /*groups=*/false, shown));
  std::vector<std::string> entries(1);
  for (const char c : text) {
    if (c == '|') {
      entries.emplace_back();
    } else if (c == 'E' || c == 'L' || c == 't' || c == 'm') {
      entries.back() += c;
    } else if (c == '(' || c == ')') {
      return Status::Error(where + "'" + std::string(1, c) + "' is not a layer: parentheses group layers only as " +
                           "(X)*n, repeated n times (e.g. E(tt|)*2L)");
    } else {
      return Status::Error(where + "'" + std::string(1, c) + "' is not a layer: E (embedding), t (decoder layer), " +
                           "m (MTP layer) or L (loss)");
    }
  }
  const auto count = static_cast<std::int64_t>(entries.size());
  if (count % pp != 0)
    return Status::Error(where + str(count) + " virtual stages are not a multiple of the pipeline-parallel size " +
                         str(pp));
  const std::string flat = [&] {
    std::string all;
    for (const auto& e : entries) all += e;
    return all;
  }();
  if (flat.empty() || flat.front() != 'E' || flat.back() != 'L')
    return Status::Error(where + "the first layer must be the embedding (E) and the last the loss (L)");
  if (std::count(flat.begin(), flat.end(), 'E') != 1 || std::count(flat.begin(), flat.end(), 'L') != 1)
    return Status::Error(where + "the embedding (E) and the loss (L) must each appear once");
  const auto decoders = std::count(flat.begin(), flat.end(), 't');
  if (decoders != num_layers)
    return Status::Error(where + "holds " + str(decoders) + " decoder layers (t); the model has " + str(num_layers));
  const auto mtps = std::count(flat.begin(), flat.end(), 'm');
  if (mtps != mtp_num_layers)
    return Status::Error(where + "holds " + str(mtps) + " MTP layers (m); the model trains " + str(mtp_num_layers));
  if (mtps > 0 && flat.find('t', flat.find('m')) != std::string::npos)
    return Status::Error(where + "decoder layers (t) must come before the MTP layers (m)");
  // Trestle embeds in the first chunk of the first stage and computes the MTP layers and the loss in the last chunk
  // of the last stage.
  if (entries.front().find('E') == std::string::npos)
    return Status::Error(where + "the embedding (E) must be in the first virtual stage (here it is in a later one)");
  const std::string& last = entries.back();
  if (last.find('L') == std::string::npos)
    return Status::Error(where + "the loss (L) must be in the last virtual stage");
  if (mtps > 0 && std::count(last.begin(), last.end(), 'm') != mtps)
    return Status::Error(where +
                         "the MTP layers (m) must be in the last virtual stage, with the loss (L): MTP "
                         "layers in a stage of their own are not supported");
  PipelineLayoutString parsed;
  parsed.vpp = static_cast<int>(count / pp);
  for (const auto& e : entries) parsed.chunk_layers.push_back(std::count(e.begin(), e.end(), 't'));
  return parsed;
}

std::string pipeline_layout_string(const std::vector<std::int64_t>& chunk_layers, std::int64_t mtp_layers) {
  std::string out = "E";
  for (std::size_t i = 0; i < chunk_layers.size(); ++i) {
    if (i > 0) out += '|';
    out += "t*" + str(chunk_layers[i]);
  }
  return out + "m*" + str(mtp_layers) + "L";
}

Result<std::vector<std::int64_t>> accounted_chunk_layers(std::int64_t num_layers, int pp, int vpp, bool embedding,
                                                         bool loss) {
  const std::int64_t counted = num_layers + (embedding ? 1 : 0) + (loss ? 1 : 0);
  const std::int64_t chunks = std::int64_t{pp} * vpp;
  const std::string what = "the model's " + str(num_layers) + " layers" + (embedding ? " + the embedding" : "") +
                           (loss ? " + the loss" : "") + " (--account-for-" +
                           (embedding && loss ? "embedding/loss"
                            : embedding       ? "embedding"
                                              : "loss") +
                           "-in-pipeline-split)";
  if (pp < 1 || vpp < 1 || counted % chunks != 0)
    return Status::Error(what + " = " + str(counted) + " are not a multiple of pp x vpp = " + str(chunks));
  std::vector<std::int64_t> layers(static_cast<std::size_t>(chunks), counted / chunks);
  if (embedding) layers.front() -= 1;
  if (loss) layers.back() -= 1;
  if (layers.front() < 0 || layers.back() < 0)
    return Status::Error(what + ": a virtual stage of " + str(counted / chunks) +
                         " cannot give up a layer to both the embedding and the loss");
  return layers;
}

}  // namespace trestle
