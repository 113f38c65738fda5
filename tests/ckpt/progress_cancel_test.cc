// Cancellation through Progress (ckpt/progress.h): an installed check that says stop makes advance and cancelled() fail
// with the operation's label, cancel() does the same from any thread, and removing the check clears both.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "ckpt/progress.h"

namespace trestle {
namespace {

TEST(ProgressCancel, AdvanceSucceedsWithoutACheckOrWhileTheCheckSaysGoOn) {
  Progress plain("copy", 10, /*enabled=*/false);
  EXPECT_TRUE(plain.advance(5).ok());
  int asked = 0;
  const ScopedCancelCheck check([&] {
    ++asked;
    return false;
  });
  Progress progress("copy", 10, /*enabled=*/false);
  EXPECT_TRUE(progress.advance(5).ok());
  EXPECT_TRUE(cancelled().ok());
  EXPECT_EQ(asked, 1);
  EXPECT_TRUE(progress.advance(5).ok());  // within 100 ms of the first: not asked again
  EXPECT_EQ(asked, 1);
}

TEST(ProgressCancel, ACheckThatSaysStopFailsAdvanceAndEveryLaterCheckUntilItIsRemoved) {
  {
    const ScopedCancelCheck check([] { return true; });
    Progress progress("hf -> trestle out", 10, /*enabled=*/false);
    const Status first = progress.advance(1);
    ASSERT_FALSE(first.ok());
    EXPECT_EQ(first.message(), "hf -> trestle out: cancelled");
    EXPECT_FALSE(cancelled().ok());
    EXPECT_FALSE(progress.advance(1).ok());
  }
  EXPECT_TRUE(cancelled().ok());
  Progress after("next", 10, /*enabled=*/false);
  EXPECT_TRUE(after.advance(1).ok());
}

TEST(ProgressCancel, CancelFromAnotherThreadStopsTheNextAdvance) {
  const ScopedCancelCheck check([] { return false; });
  Progress progress("reshard", 10, /*enabled=*/false);
  EXPECT_TRUE(progress.advance(1).ok());
  std::thread([] { cancel(); }).join();
  EXPECT_FALSE(progress.advance(1).ok());
  EXPECT_FALSE(cancelled().ok());
}

TEST(ProgressCancel, ASinkThatCancelsStopsTheAdvanceThatCalledIt) {
  const ScopedCancelCheck check([] { return false; });
  std::atomic<int> calls{0};
  const ScopedProgressSink sink([&](const std::string&, std::uint64_t, std::uint64_t, bool) {
    ++calls;
    cancel();
  });
  Progress progress("to torch_dist", 10);
  const Status status = progress.advance(3);
  EXPECT_EQ(calls.load(), 1);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.message(), "to torch_dist: cancelled");
}

}  // namespace
}  // namespace trestle
