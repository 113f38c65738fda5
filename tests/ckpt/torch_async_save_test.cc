// Asynchronous save of at::Tensors: what is loaded is what the tensors held when save_tensors_async returned, in two
// thread ranks with a TP split; strided views are packed in row-major order and cast to a stored dtype, by ATen or by
// a packer handed in; tensors that cannot be staged are refused by name; with LibTorch's CUDA libraries
// (TRESTLE_HAVE_TORCH_CUDA), CUDA tensors are staged device-to-host (that test needs a GPU).
#include "ckpt/torch_async_save.h"

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <span>
#include <thread>
#include <vector>

#include "ckpt/load.h"
#include "ckpt/torch_tensor.h"
#include "tests/support/temp_dir.h"

namespace trestle {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

at::Tensor load_whole(const CheckpointReader& reader, const std::string& name, const at::Tensor& like) {
  at::Tensor out = at::empty_like(like);
  const LoadRequest request{name, Piece{whole_box(Shape(like.sizes().begin(), like.sizes().end())), std::nullopt},
                            static_cast<std::byte*>(out.data_ptr())};
  const Status s = reader.load({&request, 1});
  EXPECT_TRUE(s.ok()) << s.message();
  return out;
}

TEST(TorchAsyncSave, LoadsWhatTheTensorsHeldWhenSaveReturned) {
  TempDir dir;
  at::manual_seed(3);
  const at::Tensor weight = at::randn({64, 48}).to(at::kBFloat16);  // split dim 0 over two ranks
  const at::Tensor norm = at::randn({48});                          // replicated
  const at::Tensor step = at::scalar_tensor(7, at::kLong);
  ThreadGroup group(2);
  std::vector<Status> results(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      auto c = group.member(r);
      std::vector<TorchSaveItem> items = {
          {"weight", {64, 48}, Piece{Box{{32 * r, 0}, {32, 48}}, std::nullopt}, weight.narrow(0, 32 * r, 32).clone()},
          {"norm", {48}, Piece{whole_box({48}), std::nullopt}, norm.clone()},
          {"step", {}, Piece{whole_box({}), std::nullopt}, step.clone()}};
      AsyncSaver saver(2, torch_pool_allocator());
      CheckpointInfo info;
      info.iteration = 11;
      const Status started = save_tensors_async(saver, *c, dir.path().string(), info, items);
      for (auto& item : items) item.tensor.fill_(0);  // training goes on
      results[static_cast<std::size_t>(r)] = started.ok() ? saver.finalize() : started;
    });
  for (auto& t : ranks) t.join();
  for (const auto& s : results) ASSERT_TRUE(s.ok()) << s.message();

  auto reader = CheckpointReader::open(dir.path().string());
  ASSERT_TRUE(reader.ok()) << reader.status().message();
  EXPECT_EQ(reader->manifest().iteration, 11);
  EXPECT_EQ(reader->manifest().tensors.at("weight").dtype, DType::kBF16);
  EXPECT_TRUE(at::equal(load_whole(*reader, "weight", weight), weight));
  EXPECT_TRUE(at::equal(load_whole(*reader, "norm", norm), norm));
  EXPECT_TRUE(at::equal(load_whole(*reader, "step", step), step));
  EXPECT_EQ(reader->manifest().tensors.at("norm").chunks.size(), 1u);  // the replica is written once
}

TEST(TorchAsyncSave, RefusesTensorsItCannotStageByName) {
  TempDir dir;
  SoloCollective solo;
  AsyncSaver saver;
  const at::Tensor t = at::randn({8, 6});
  const std::vector<TorchSaveItem> integer_cast = {
      {"i", {8}, Piece{whole_box({8}), std::nullopt}, at::arange(8, at::kLong), at::kBFloat16}};
  Status s = save_tensors_async(saver, solo, dir.path().string(), {}, integer_cast);
  EXPECT_NE(s.message().find("tensor 'i': a Long tensor cannot be stored as BFloat16"), std::string::npos)
      << s.message();
  const std::vector<TorchSaveItem> short_piece = {{"w", {16, 6}, Piece{whole_box({16, 6}), std::nullopt}, t}};
  s = save_tensors_async(saver, solo, dir.path().string(), {}, short_piece);
  EXPECT_NE(s.message().find("tensor 'w': tensor has 48 elements"), std::string::npos) << s.message();
  const std::vector<TorchSaveItem> complex = {
      {"z", {2}, Piece{whole_box({2}), std::nullopt}, at::zeros({2}, at::kComplexFloat)}};
  s = save_tensors_async(saver, solo, dir.path().string(), {}, complex);
  EXPECT_NE(s.message().find("tensor 'z': torch dtype ComplexFloat"), std::string::npos) << s.message();
  EXPECT_FALSE(saver.in_flight());
}

// A transposed fp32 tensor stored as bf16 reads back as ATen's cast of it (NaN and infinities too), a stepped slice of
// int64 as its elements: by ATen's copy_ without a packer, and through a packer that is handed every tensor.
TEST(TorchAsyncSave, PacksStridedTensorsAndCastsToTheStoredDtype) {
  at::manual_seed(9);
  at::Tensor master = at::randn({33, 70}) * 1000;
  master[0][0] = NAN;
  master[1][2] = INFINITY;
  master[5][1] = 1e-40;  // an fp32 subnormal
  const at::Tensor steps = at::arange(60, at::kLong).reshape({6, 10});
  const std::vector<TorchSaveItem> items = {
      {"w", {70, 33}, Piece{whole_box({70, 33}), std::nullopt}, master.t(), at::kBFloat16},
      {"steps", {6, 5}, Piece{whole_box({6, 5}), std::nullopt}, steps.slice(1, 1, 10, 2)}};
  std::vector<std::size_t> packed;  // tensors per packer call
  unsigned packer_threads = 0;
  const TensorPacker by_copy = [&](std::span<const at::Tensor> sources, std::span<const at::Tensor> destinations,
                                   unsigned threads) {
    packed.push_back(sources.size());
    packer_threads = threads;
    for (std::size_t i = 0; i < sources.size(); ++i) destinations[i].copy_(sources[i]);
  };
  for (const bool with_packer : {false, true}) {
    TempDir dir;
    SoloCollective solo;
    AsyncSaver saver(3);
    const Status started =
        save_tensors_async(saver, solo, dir.path().string(), {}, items, {}, with_packer ? by_copy : TensorPacker{});
    ASSERT_TRUE(started.ok()) << started.message();
    const Status finished = saver.finalize();
    ASSERT_TRUE(finished.ok()) << finished.message();
    auto reader = CheckpointReader::open(dir.path().string());
    ASSERT_TRUE(reader.ok()) << reader.status().message();
    EXPECT_EQ(reader->manifest().tensors.at("w").dtype, DType::kBF16);
    EXPECT_EQ(reader->manifest().tensors.at("steps").dtype, DType::kI64);
    const at::Tensor expected = master.t().contiguous().to(at::kBFloat16);
    const at::Tensor w = load_whole(*reader, "w", expected);
    EXPECT_TRUE(at::equal(at::isnan(w), at::isnan(expected))) << (with_packer ? "packer" : "copy_");
    EXPECT_TRUE(at::equal(w.nan_to_num(0, INFINITY, -INFINITY), expected.nan_to_num(0, INFINITY, -INFINITY)))
        << (with_packer ? "packer" : "copy_");
    EXPECT_TRUE(at::equal(load_whole(*reader, "steps", at::empty({6, 5}, at::kLong)), steps.slice(1, 1, 10, 2)));
  }
  EXPECT_EQ(packed, std::vector<std::size_t>{2});  // once, for the CPU tensors
  EXPECT_EQ(packer_threads, 3u);                   // the saver's copy threads
}

#ifdef TRESTLE_HAVE_TORCH_CUDA
// ATen's CUDA hooks are libtorch_cuda's once it is linked; asking them the runtime version needs no GPU.
TEST(TorchAsyncSave, LinksLibTorchCuda) { EXPECT_GT(at::detail::getCUDAHooks().versionCUDART(), 0); }

TEST(TorchAsyncSave, StagesCudaTensorsDeviceToHost) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a CUDA GPU, and LibTorch sees none";
  TempDir dir;
  SoloCollective solo;
  AsyncSaver saver(2, torch_pool_allocator());
  at::manual_seed(5);
  const at::Tensor host = at::randn({128, 32});
  std::vector<TorchSaveItem> items = {
      {"w", {128, 32}, Piece{whole_box({128, 32}), std::nullopt}, host.to(at::Device(at::kCUDA))}};
  const Status started = save_tensors_async(saver, solo, dir.path().string(), {}, items);
  ASSERT_TRUE(started.ok()) << started.message();
  items[0].tensor.fill_(0);  // queued on the device's current stream after the staging copy
  const Status finished = saver.finalize();
  ASSERT_TRUE(finished.ok()) << finished.message();
  auto reader = CheckpointReader::open(dir.path().string());
  ASSERT_TRUE(reader.ok()) << reader.status().message();
  EXPECT_TRUE(at::equal(load_whole(*reader, "w", host), host));
}
#endif

}  // namespace
}  // namespace trestle
