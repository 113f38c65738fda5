// Cast-and-pack (kernels/cpu/pack_source.h, kernels/cast_pack.h): the plain reference and every CPU build this machine
// runs against ATen's src.contiguous().to(dtype), for every pair of float, bfloat16 and half and for plain copies of
// other dtypes; at 0, 1, 7 and 1000003 elements; from transposed, stepped, expanded (stride 0) and permuted sources;
// with NaN, infinities, subnormals and rounding ties; many tensors in one call, over several threads. Then the tensor
// dispatch against copy_ (fallbacks included), and a checkpoint save packed by it.
#include "kernels/cast_pack.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "ckpt/load.h"
#include "ckpt/torch_async_save.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu_table.h"
#include "kernels/reference.h"
#include "tests/support/temp_dir.h"

namespace trestle::kernels {
namespace {

// The reference, then every CPU build this CPU runs.
std::vector<const cpu::Table*> runnable_tables() {
  std::vector<const cpu::Table*> out{&reference_table()};
  for (const cpu::Table* t : runnable_cpu_tables()) out.push_back(t);
  return out;
}

const std::vector<at::ScalarType> kFloatTypes = {at::kFloat, at::kBFloat16, at::kHalf};

cpu::PackType float_type(at::ScalarType t) {
  return t == at::kFloat ? cpu::PackType::kFloat : t == at::kBFloat16 ? cpu::PackType::kBFloat16 : cpu::PackType::kHalf;
}

cpu::PackType bytes_type(std::int64_t bytes) {
  switch (bytes) {
    case 1:
      return cpu::PackType::kBytes1;
    case 2:
      return cpu::PackType::kBytes2;
    case 4:
      return cpu::PackType::kBytes4;
    case 8:
      return cpu::PackType::kBytes8;
    default:
      return cpu::PackType::kBytes16;
  }
}

// The kernels' descriptor of packing `src` into `dst` (a cast between float types, else a copy of the bytes).
cpu::PackSource source_of(const at::Tensor& src, const at::Tensor& dst) {
  cpu::PackSource s;
  s.data = src.const_data_ptr();
  s.destination = dst.data_ptr();
  s.dims = static_cast<std::int32_t>(src.dim());
  for (std::int64_t d = 0; d < src.dim(); ++d) {
    s.sizes[d] = src.size(d);
    s.strides[d] = src.stride(d);
  }
  if (src.scalar_type() == dst.scalar_type()) {
    s.from = s.to = bytes_type(src.element_size());
  } else {
    s.from = float_type(src.scalar_type());
    s.to = float_type(dst.scalar_type());
  }
  return s;
}

// Each source packed as types[i] by one call of `table` into one staging buffer (each at a 64-byte boundary; the
// bytes between and any left unwritten hold 0xA5), returned as flat tensors over that buffer.
std::vector<at::Tensor> pack_all(const cpu::Table& table, const std::vector<at::Tensor>& sources,
                                 const std::vector<at::ScalarType>& types, int threads = 0) {
  std::vector<std::int64_t> offsets;
  std::int64_t total = 0;
  for (std::size_t i = 0; i < sources.size(); ++i) {
    offsets.push_back(total);
    total += (sources[i].numel() * static_cast<std::int64_t>(c10::elementSize(types[i])) + 63) / 64 * 64;
  }
  const at::Tensor staging = at::full({total + 64}, 0xA5, at::kByte);
  std::vector<at::Tensor> packed;
  std::vector<cpu::PackSource> list;
  for (std::size_t i = 0; i < sources.size(); ++i) {
    const std::int64_t bytes = sources[i].numel() * static_cast<std::int64_t>(c10::elementSize(types[i]));
    packed.push_back(staging.narrow(0, offsets[i], bytes).view(types[i]));
    list.push_back(source_of(sources[i], packed.back()));
  }
  table.cast_pack(list.data(), static_cast<std::int64_t>(list.size()), threads);
  return packed;
}

// The same elements: the same bits, except that a NaN need only meet a NaN (its payload is not specified).
::testing::AssertionResult same_elements(const at::Tensor& got, const at::Tensor& expected) {
  if (got.scalar_type() != expected.scalar_type() || got.numel() != expected.numel())
    return ::testing::AssertionFailure() << "got " << got.numel() << " " << got.scalar_type() << ", expected "
                                         << expected.numel() << " " << expected.scalar_type();
  at::Tensor a = got.reshape(-1).clone(), b = expected.reshape(-1).clone();
  if (a.is_floating_point()) {
    const at::Tensor nan_a = at::isnan(a), nan_b = at::isnan(b);
    if (!at::equal(nan_a, nan_b))
      return ::testing::AssertionFailure() << (nan_a != nan_b).sum().item<std::int64_t>() << " NaNs where none belong";
    a.masked_fill_(nan_a, 0);
    b.masked_fill_(nan_b, 0);
  }
  const std::int64_t n = a.numel();
  if (n == 0) return ::testing::AssertionSuccess();
  const at::Tensor differs = (a.view(at::kByte).view({n, -1}) != b.view(at::kByte).view({n, -1})).any(1);
  const std::int64_t count = differs.sum().item<std::int64_t>();
  if (count == 0) return ::testing::AssertionSuccess();
  const std::int64_t first = differs.nonzero()[0][0].item<std::int64_t>();
  return ::testing::AssertionFailure() << count << " of " << n << " elements differ, the first at " << first << ": got "
                                       << a[first].item() << ", expected " << b[first].item();
}

at::Tensor bits_as_float(std::uint32_t bits) {
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return at::scalar_tensor(v, at::kFloat);
}

// n fp32 values: the special ones first (NaN, infinities, signed zeros, subnormals of fp32 and half, values past half's
// range, ties of bfloat16's and half's rounding), then normal values of every scale.
at::Tensor values(std::int64_t n) {
  std::vector<at::Tensor> special = {
      at::scalar_tensor(NAN),     at::scalar_tensor(INFINITY),      at::scalar_tensor(-INFINITY),
      at::scalar_tensor(-0.0),    at::scalar_tensor(0.0),           at::scalar_tensor(1e-40),
      at::scalar_tensor(-3e-39),  at::scalar_tensor(3e-6),          at::scalar_tensor(-6e-8),
      at::scalar_tensor(70000.0), at::scalar_tensor(65519.0),       at::scalar_tensor(-65520.0),
      at::scalar_tensor(3.3e38),  bits_as_float(0x3F808000u),       bits_as_float(0x3F818000u),
      bits_as_float(0x7F7FFFFFu), at::scalar_tensor(1.00048828125), at::scalar_tensor(1.00146484375),
      bits_as_float(0x7FC00001u), bits_as_float(0xFF812345u)};
  at::Tensor out = at::randn({n}) * at::exp(at::randn({n}) * 6);
  for (std::int64_t i = 0; i < std::min<std::int64_t>(n, static_cast<std::int64_t>(special.size())); ++i)
    out[i] = special[static_cast<std::size_t>(i)].to(at::kFloat);
  return out;
}

TEST(CastPackTest, EveryBuildCastsEveryPairAsATenDoes) {
  at::manual_seed(11);
  for (const std::int64_t n : {0, 1, 7, 1000003}) {
    const at::Tensor base = values(n);
    for (const auto from : kFloatTypes)
      for (const auto to : kFloatTypes) {
        const at::Tensor src = base.to(from);
        const at::Tensor expected = src.to(to);
        for (const cpu::Table* table : runnable_tables())
          EXPECT_TRUE(same_elements(pack_all(*table, {src}, {to})[0], expected))
              << table->name << " " << from << " -> " << to << ", " << n << " elements";
      }
  }
}

// Views of every kind, of base's dtype.
std::vector<at::Tensor> strided_views(at::ScalarType type) {
  auto make = [&](at::IntArrayRef shape) { return values(c10::multiply_integers(shape)).reshape(shape).to(type); };
  return {
      make({301, 1000}).t(),                                             // transposed: rows adjacent, columns far apart
      make({19, 9000}).t(),                                              // transposed, past a band of tiles a thread
      make({7, 64, 33}).transpose(1, 2),                                 // a batch of transposed matrices
      make({1001}).slice(0, 0, 1001, 3),                                 // a step
      make({40, 50}).slice(1, 1, 50, 2),                                 // a step in the inner dim
      make({1000, 301}).t().slice(0, 3, 200, 2),                         // a stepped slice of a transposed view
      make({1, 513}).expand({9, 513}),                                   // broadcast rows (stride 0)
      make({5, 1, 7}).expand({5, 4, 7}),                                 // a broadcast middle dim
      make({}).expand({3, 3}),                                           // one element everywhere
      make({2, 3, 2, 3, 2, 3, 2, 3}).permute({7, 6, 5, 4, 3, 2, 1, 0}),  // 8 dims reversed
      make({}),                                                          // a scalar
      make({6, 0, 4}).transpose(0, 2),                                   // empty
      make({3, 5, 7}).permute({1, 2, 0}).slice(1, 1, 7, 3),              // permuted and stepped
  };
}

TEST(CastPackTest, StridedSourcesArePackedInRowMajorOrder) {
  at::manual_seed(12);
  for (const auto from : kFloatTypes)
    for (const auto to : kFloatTypes) {
      const std::vector<at::Tensor> sources = strided_views(from);
      const std::vector<at::ScalarType> types(sources.size(), to);
      for (const cpu::Table* table : runnable_tables()) {
        const auto packed = pack_all(*table, sources, types);
        for (std::size_t i = 0; i < sources.size(); ++i)
          EXPECT_TRUE(same_elements(packed[i], sources[i].contiguous().to(to)))
              << table->name << " " << from << " -> " << to << ", view " << i << " " << sources[i].sizes()
              << " strides " << sources[i].strides();
      }
    }
}

// A list of 400 tensors over every kind of view, cast or copied (int64, bool, uint8, int16, float64, complex double
// as their bytes), its runs cut by four threads wherever they fall, into one buffer.
TEST(CastPackTest, ManyTensorsOfEveryDtypeInOneCallOverThreads) {
  at::manual_seed(13);
  const int threads_before = at::get_num_threads();
  at::set_num_threads(4);
  const std::vector<std::vector<at::Tensor>> views = {strided_views(at::kFloat), strided_views(at::kBFloat16),
                                                      strided_views(at::kHalf)};
  const std::vector<at::ScalarType> copied = {at::kLong,  at::kBool,   at::kByte,
                                              at::kShort, at::kDouble, at::kComplexDouble};
  std::vector<at::Tensor> sources;
  std::vector<at::ScalarType> types;
  for (std::size_t i = 0; i < 400; ++i) {
    const at::Tensor& view = views[i % 3][(i * 7) % views[0].size()];
    if (i % 4 == 3) {  // a copy of another dtype, in the same layout
      const at::ScalarType type = copied[i % copied.size()];
      const auto storage = static_cast<std::int64_t>(view.storage().nbytes() / view.element_size());
      const at::Tensor whole = (at::randn({storage}) * 1000).to(type);
      sources.push_back(whole.as_strided(view.sizes(), view.strides(), view.storage_offset()));
      types.push_back(type);
    } else {
      sources.push_back(view);
      types.push_back(kFloatTypes[(i / 3) % 3]);
    }
  }
  std::vector<at::Tensor> expected;
  for (std::size_t i = 0; i < sources.size(); ++i) expected.push_back(sources[i].contiguous().to(types[i]));
  for (const cpu::Table* table : runnable_tables())
    for (const int threads : {0, 3, 1}) {
      if (table == &reference_table() && threads != 0) continue;  // one thread whatever it is told
      const auto packed = pack_all(*table, sources, types, threads);
      int wrong = 0;
      for (std::size_t i = 0; i < sources.size() && wrong < 5; ++i) {
        const auto same = same_elements(packed[i], expected[i]);
        EXPECT_TRUE(same) << table->name << " (" << threads << " threads) tensor " << i << " " << sources[i].dtype()
                          << " -> " << types[i] << " " << sources[i].sizes() << " strides " << sources[i].strides();
        wrong += same ? 0 : 1;
      }
    }
  at::set_num_threads(threads_before);
}

// The tensor dispatch is copy_: pairs for the kernels and pairs it hands to copy_ (an integer cast, float64, nine
// dims) alike, into destinations of another shape over one buffer.
TEST(CastPackTest, TensorDispatchDoesWhatCopyDoes) {
  at::manual_seed(14);
  std::vector<at::Tensor> sources = strided_views(at::kFloat);
  sources.push_back((at::randn({40, 30}) * 100).to(at::kLong).t());
  sources.push_back(at::randn({30, 20}, at::kDouble).t());
  sources.push_back(at::randn({2, 2, 2, 2, 2, 2, 2, 2, 3}).transpose(0, 8));
  std::vector<at::ScalarType> types;
  for (std::size_t i = 0; i < sources.size(); ++i) types.push_back(kFloatTypes[i % 3]);
  std::vector<at::Tensor> destinations, expected;
  for (std::size_t i = 0; i < sources.size(); ++i) {
    destinations.push_back(at::full({sources[i].numel()}, 7, types[i]));
    expected.push_back(at::empty(sources[i].sizes(), types[i]).copy_(sources[i]));
  }
  cast_pack(sources, destinations, 2);
  for (std::size_t i = 0; i < sources.size(); ++i)
    EXPECT_TRUE(same_elements(destinations[i], expected[i]))
        << "pair " << i << " " << sources[i].dtype() << " -> " << types[i] << " " << sources[i].sizes();
}

TEST(CastPackTest, TensorDispatchRefusesPairsThatDoNotFitNamingThem) {
  const at::Tensor src = at::randn({4, 5});
  const std::vector<at::Tensor> sources = {src, src};
  auto message = [&](const std::vector<at::Tensor>& destinations) -> std::string {
    try {
      cast_pack(sources, destinations);
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "no error";
  };
  EXPECT_NE(message({at::empty({20}), at::empty({19})}).find("destination 1 has 19 elements, its source 20"),
            std::string::npos);
  EXPECT_NE(message({at::empty({5, 4}).t(), at::empty({20})}).find("destination 0 is not contiguous"),
            std::string::npos);
}

at::Tensor load_whole(const CheckpointReader& reader, const std::string& name, const at::Tensor& like) {
  at::Tensor out = at::empty_like(like);
  const LoadRequest request{name, Piece{whole_box(Shape(like.sizes().begin(), like.sizes().end())), std::nullopt},
                            static_cast<std::byte*>(out.data_ptr())};
  const Status s = reader.load({&request, 1});
  EXPECT_TRUE(s.ok()) << s.message();
  return out;
}

// The trainer's packer in a save: a transposed fp32 tensor stored as bf16 reads back as ATen's cast of it, beside one
// stored as it is.
TEST(CastPackTest, ASaveStoresATransposedFp32TensorAsBf16) {
  ::trestle::testing::TempDir dir;
  SoloCollective solo;
  AsyncSaver saver(2, torch_pool_allocator());
  at::manual_seed(15);
  const at::Tensor master = values(97 * 131).reshape({97, 131});
  const at::Tensor steps = at::arange(12, at::kLong).reshape({3, 4});
  std::vector<TorchSaveItem> items = {
      {"w", {131, 97}, Piece{whole_box({131, 97}), std::nullopt}, master.t(), at::kBFloat16},
      {"steps", {4, 3}, Piece{whole_box({4, 3}), std::nullopt}, steps.t()}};
  const Status started = save_tensors_async(saver, solo, dir.path().string(), {}, items, {}, cast_pack);
  ASSERT_TRUE(started.ok()) << started.message();
  const Status finished = saver.finalize();
  ASSERT_TRUE(finished.ok()) << finished.message();
  auto reader = CheckpointReader::open(dir.path().string());
  ASSERT_TRUE(reader.ok()) << reader.status().message();
  EXPECT_EQ(reader->manifest().tensors.at("w").dtype, DType::kBF16);
  const at::Tensor expected = master.t().contiguous().to(at::kBFloat16);
  EXPECT_TRUE(same_elements(load_whole(*reader, "w", expected), expected));
  EXPECT_TRUE(at::equal(load_whole(*reader, "steps", steps.t().contiguous()), steps.t()));
}

}  // namespace
}  // namespace trestle::kernels
