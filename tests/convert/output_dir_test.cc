// StagedOutput: a conversion's output is staged beside its destination; what keeps it from being staged is reported
// under the destination's name (the staging path is Trestle's, not the user's).
#include "convert/output_dir.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "tests/support/status_matchers.h"
#include "tests/support/temp_dir.h"

namespace trestle {
namespace {
namespace fs = std::filesystem;

TEST(StagedOutput, AStagingPathTakenByAFileIsReportedUnderTheDestination) {
  testing::TempDir root;
  const std::string dst = (root.path() / "out").string();
  const fs::path taken = root.path() / (".out.partial." + std::to_string(::getpid()));
  std::ofstream(taken) << "not a directory";
  EXPECT_TRUE(fails_with(StagedOutput::begin(dst), dst + ": cannot stage the output beside it: " + taken.string() +
                                                       ": cannot create: File exists"));
  EXPECT_FALSE(fs::exists(dst));
  EXPECT_TRUE(fs::is_regular_file(taken));  // a stranger's file is not removed
}

}  // namespace
}  // namespace trestle
