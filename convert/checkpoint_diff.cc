#include "convert/checkpoint_diff.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>

#include "ckpt/dtype_cast.h"
#include "ckpt/progress.h"
#include "convert/sources/canonical_source.h"

namespace trestle {
namespace {

constexpr std::int64_t kSliceElements = std::int64_t{4} << 20;

template <typename T>
void widen(std::span<const std::byte> in, std::vector<double>& out) {
  const std::size_t n = in.size() / sizeof(T);
  for (std::size_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, in.data() + i * sizeof(T), sizeof(T));
    out[i] = static_cast<double>(v);
  }
}

// The elements as f64; false for dtypes without arithmetic here (fp8).
bool as_f64(DType dtype, std::span<const std::byte> in, std::vector<double>& out) {
  out.resize(in.size() / dtype_size(dtype));
  switch (dtype) {
    case DType::kF64:
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:
      return cast_elements(dtype, in, DType::kF64, std::as_writable_bytes(std::span(out))).ok();
    case DType::kI8:
      widen<std::int8_t>(in, out);
      return true;
    case DType::kI16:
      widen<std::int16_t>(in, out);
      return true;
    case DType::kI32:
      widen<std::int32_t>(in, out);
      return true;
    case DType::kI64:
      widen<std::int64_t>(in, out);
      return true;
    case DType::kU8:
    case DType::kBool:
      widen<std::uint8_t>(in, out);
      return true;
    case DType::kU16:
      widen<std::uint16_t>(in, out);
      return true;
    case DType::kU32:
      widen<std::uint32_t>(in, out);
      return true;
    case DType::kU64:
      widen<std::uint64_t>(in, out);
      return true;
    default:
      return false;
  }
}

void accumulate(const std::vector<double>& a, const std::vector<double>& b, TensorDiff& diff) {
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double x = a[i], y = b[i];
    if (x == y || (std::isnan(x) && std::isnan(y))) continue;
    ++diff.differing;
    // inf - finite is inf but inf / inf is NaN, which std::max drops: such a pair is no distance at all.
    if (!std::isfinite(x) || !std::isfinite(y)) {
      ++diff.non_finite;
      diff.max_abs = diff.max_rel = std::numeric_limits<double>::infinity();
      continue;
    }
    const double abs = std::fabs(x - y);
    diff.max_abs = std::max(diff.max_abs, abs);
    diff.max_rel = std::max(diff.max_rel, abs / std::max(std::fabs(x), std::fabs(y)));
  }
}

// Rows [begin, end) of dim 0 (the whole tensor when 0-d).
Box row_slice(const Shape& shape, std::int64_t begin, std::int64_t end) {
  Box box = whole_box(shape);
  if (!shape.empty()) {
    box.offset[0] = begin;
    box.shape[0] = end - begin;
  }
  return box;
}

Status compare_tensor(const CanonicalSource& first, const CanonicalSource& second, const LayoutTensor& entry,
                      const std::string& second_name, TensorDiff& diff, std::vector<std::byte>& a,
                      std::vector<std::byte>& b) {
  const Shape& shape = entry.shape;
  const std::int64_t rows = shape.empty() ? 1 : shape[0];
  const std::int64_t row_elements = rows == 0 ? 0 : numel(shape) / std::max<std::int64_t>(rows, 1);
  const std::int64_t rows_per_slice =
      std::max<std::int64_t>(1, kSliceElements / std::max<std::int64_t>(row_elements, 1));
  const std::size_t size = dtype_size(entry.dtype);
  std::vector<double> fa, fb;
  bool arithmetic = true;
  for (std::int64_t begin = 0; begin < rows; begin += rows_per_slice) {
    const Box box = row_slice(shape, begin, std::min(rows, begin + rows_per_slice));
    const auto bytes = static_cast<std::size_t>(box.numel()) * size;
    a.resize(bytes);
    b.resize(bytes);
    TRESTLE_RETURN_IF_ERROR(first.read(diff.name, Piece{box, std::nullopt}, a));
    TRESTLE_RETURN_IF_ERROR(second.read(second_name, Piece{box, std::nullopt}, b));
    diff.elements += box.numel();
    if (std::memcmp(a.data(), b.data(), bytes) == 0) continue;
    std::int64_t bits_differing = 0;
    for (std::size_t i = 0; i < bytes; i += size)
      if (std::memcmp(a.data() + i, b.data() + i, size) != 0) ++bits_differing;
    diff.bits_differing += bits_differing;
    if (as_f64(entry.dtype, a, fa) && as_f64(entry.dtype, b, fb)) {
      accumulate(fa, fb, diff);
    } else {
      arithmetic = false;
      diff.differing += bits_differing;
    }
  }
  if (!arithmetic) diff.max_abs = diff.max_rel = std::numeric_limits<double>::quiet_NaN();
  diff.kind = diff.differing ? TensorDiff::Kind::kDifferent : TensorDiff::Kind::kEqual;
  return OkStatus();
}

std::uint64_t bytes_of(const LayoutTensor& entry) {
  return static_cast<std::uint64_t>(numel(entry.shape)) * dtype_size(entry.dtype);
}

std::map<std::string, const LayoutTensor*> by_name(const CanonicalSource& source,
                                                   const std::map<std::string, std::string>& renamed = {}) {
  std::map<std::string, const LayoutTensor*> out;
  for (const auto& t : source.tensors()) {
    const auto it = renamed.find(t.name);
    out[it == renamed.end() ? t.name : it->second] = &t;
  }
  return out;
}

// `second`'s tensor names as `first`'s layer-norm naming has them, where the two differ (a checkpoint converted with
// --norms local against one with Transformer Engine's names, or megatron-dist, which saves TE names whatever the
// spec): the same model's plan under each naming pairs the names, optimizer states ("optimizer.<state>.<name>") too.
Result<std::map<std::string, std::string>> names_as_first_names_norms(const CanonicalSource& first,
                                                                      const CanonicalSource& second) {
  std::map<std::string, std::string> renamed;
  const NormNaming want = first.model().norms, have = second.model().norms;
  if (want == have) return renamed;
  TRESTLE_ASSIGN_OR_RETURN(const BridgePlan theirs,
                           make_bridge_plan(second.model().model, have, ExpertLayout::kOriginal));
  TRESTLE_ASSIGN_OR_RETURN(const BridgePlan ours,
                           make_bridge_plan(second.model().model, want, ExpertLayout::kOriginal));
  if (theirs.tensors.size() != ours.tensors.size()) return renamed;
  std::map<std::string, std::string> pairs;
  for (std::size_t i = 0; i < ours.tensors.size(); ++i)
    if (theirs.tensors[i].name != ours.tensors[i].name) pairs[theirs.tensors[i].name] = ours.tensors[i].name;
  for (const auto& t : second.tensors()) {
    if (const auto it = pairs.find(t.name); it != pairs.end()) {
      renamed[t.name] = it->second;
      continue;
    }
    const std::size_t dot = t.name.starts_with("optimizer.") ? t.name.find('.', 10) : std::string::npos;
    if (dot == std::string::npos) continue;
    if (const auto it = pairs.find(t.name.substr(dot + 1)); it != pairs.end())
      renamed[t.name] = t.name.substr(0, dot + 1) + it->second;
  }
  return renamed;
}

}  // namespace

std::string_view diff_kind_name(TensorDiff::Kind kind) {
  switch (kind) {
    case TensorDiff::Kind::kEqual:
      return "equal";
    case TensorDiff::Kind::kDifferent:
      return "different";
    case TensorDiff::Kind::kOnlyInFirst:
      return "only in first";
    case TensorDiff::Kind::kOnlyInSecond:
      return "only in second";
    case TensorDiff::Kind::kIncompatible:
      return "incompatible";
  }
  return "?";
}

bool CheckpointDiff::identical() const {
  return std::all_of(tensors.begin(), tensors.end(),
                     [](const TensorDiff& t) { return t.kind == TensorDiff::Kind::kEqual; });
}

bool CheckpointDiff::bit_identical() const {
  return std::all_of(tensors.begin(), tensors.end(), [](const TensorDiff& t) { return t.bit_equal(); });
}

bool TensorDiff::within(double atol, double rtol) const {
  if (kind == Kind::kEqual) return true;
  if (kind != Kind::kDifferent || non_finite > 0) return false;
  return max_abs <= atol || max_rel <= rtol;
}

bool CheckpointDiff::within(double atol, double rtol) const {
  return std::all_of(tensors.begin(), tensors.end(), [&](const TensorDiff& t) { return t.within(atol, rtol); });
}

Result<CheckpointDiff> diff_checkpoints(const CanonicalSource& a, const CanonicalSource& b, bool progress) {
  TRESTLE_ASSIGN_OR_RETURN(const auto renamed, names_as_first_names_norms(a, b));
  const auto ta = by_name(a), tb = by_name(b, renamed);
  std::set<std::string> names;
  std::uint64_t total = 0;
  for (const auto& [name, entry] : ta) names.insert(name);
  for (const auto& [name, entry] : tb) names.insert(name);
  for (const auto& [name, entry] : ta) total += bytes_of(*entry);
  Progress bar("diff", total, progress);
  CheckpointDiff out;
  std::vector<std::byte> buffer_a, buffer_b;
  for (const auto& name : names) {
    TensorDiff diff;
    diff.name = name;
    const auto ia = ta.find(name), ib = tb.find(name);
    if (ib == tb.end()) {
      diff.kind = TensorDiff::Kind::kOnlyInFirst;
    } else if (ia == ta.end()) {
      diff.kind = TensorDiff::Kind::kOnlyInSecond;
    } else if (ia->second->dtype != ib->second->dtype || ia->second->shape != ib->second->shape) {
      diff.kind = TensorDiff::Kind::kIncompatible;
      diff.detail = std::string(dtype_name(ia->second->dtype)) + " " + to_string(ia->second->shape) + " vs " +
                    std::string(dtype_name(ib->second->dtype)) + " " + to_string(ib->second->shape);
    } else {
      TRESTLE_RETURN_IF_ERROR(compare_tensor(a, b, *ia->second, ib->second->name, diff, buffer_a, buffer_b));
    }
    if (ia != ta.end()) TRESTLE_RETURN_IF_ERROR(bar.advance(bytes_of(*ia->second)));
    out.tensors.push_back(std::move(diff));
  }
  bar.finish();
  return out;
}

}  // namespace trestle
