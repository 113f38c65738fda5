// Links in a Hugging Face model directory: followed inside the directory and into the hub cache's blobs/ beside its
// snapshots/, refused anywhere else (naming the file and its target), and never followed in a Trestle checkpoint.
#include "convert/bridge/hf_side_files.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace trestle {
namespace {

namespace fs = std::filesystem;

class HfSideFileLinksTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "trestle_links_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    root_ = pattern;
    // The hub cache's layout: models--org--name/{blobs/<hash>, refs/main, snapshots/<rev>/<name>}, each snapshot file
    // a relative link ../../blobs/<hash>.
    fs::create_directories(repo() / "blobs");
    fs::create_directories(repo() / "refs");
    fs::create_directories(snapshot());
    write(repo() / "blobs" / "0a1b", "{\"model_max_length\": 64}");
    fs::create_symlink("../../blobs/0a1b", snapshot() / "tokenizer_config.json");
    write(root_ / "secret", "not for the checkpoint");
  }
  void TearDown() override { fs::remove_all(root_); }
  fs::path repo() const { return root_ / "hub" / "models--org--name"; }
  fs::path snapshot() const { return repo() / "snapshots" / "c0ffee"; }
  static void write(const fs::path& path, const std::string& text) { std::ofstream(path) << text; }

  fs::path root_;
};

TEST_F(HfSideFileLinksTest, FollowsALinkIntoTheCacheBlobs) {
  EXPECT_TRUE(check_hf_file_link(snapshot().string(), "tokenizer_config.json").ok());
  EXPECT_TRUE(check_hf_dir_links(snapshot().string()).ok());
  const fs::path out = root_ / "out";
  const Status copied =
      copy_side_files(snapshot().string(), out.string(), {"tokenizer_config.json"}, SideFileLinks::kFollow);
  ASSERT_TRUE(copied.ok()) << copied.message();
  EXPECT_FALSE(fs::is_symlink(out / "tokenizer_config.json"));
  EXPECT_EQ(fs::file_size(out / "tokenizer_config.json"), fs::file_size(repo() / "blobs" / "0a1b"));
}

TEST_F(HfSideFileLinksTest, FollowsALinkInsideTheDirectory) {
  fs::create_directories(root_ / "plain" / "sub");
  write(root_ / "plain" / "sub" / "tokenizer.json", "{}");
  fs::create_symlink("sub/tokenizer.json", root_ / "plain" / "tokenizer.json");
  EXPECT_TRUE(check_hf_dir_links((root_ / "plain").string()).ok());
  // Through a link to the snapshot directory itself, the cache's blobs are still the ones beside it.
  fs::create_directory_symlink(snapshot(), root_ / "model");
  EXPECT_TRUE(check_hf_dir_links((root_ / "model").string()).ok());
}

TEST_F(HfSideFileLinksTest, RefusesALinkOutOfTheTree) {
  for (const char* name : {"tokenizer_config.json", "config.json", "model.safetensors"}) {
    SCOPED_TRACE(name);
    const fs::path link = snapshot() / name;
    fs::remove(link);
    fs::create_symlink(root_ / "secret", link);
    const Status status = check_hf_dir_links(snapshot().string());
    ASSERT_FALSE(status.ok());
    EXPECT_NE(status.message().find(link.string()), std::string::npos) << status.message();
    EXPECT_NE(status.message().find(fs::canonical(root_ / "secret").string()), std::string::npos) << status.message();
    EXPECT_NE(status.message().find("outside the model directory"), std::string::npos) << status.message();
    fs::remove(link);
  }
}

TEST_F(HfSideFileLinksTest, RefusesBlobsThatAreNotBesideTheSnapshots) {
  // A relative link that climbs out of the directory into a blobs/ of another cache repository.
  fs::create_directories(root_ / "hub" / "models--other--repo" / "blobs");
  write(root_ / "hub" / "models--other--repo" / "blobs" / "beef", "{}");
  fs::create_symlink("../../../models--other--repo/blobs/beef", snapshot() / "special_tokens_map.json");
  const Status status = check_hf_file_link(snapshot().string(), "special_tokens_map.json");
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("special_tokens_map.json"), std::string::npos) << status.message();
  // And a blobs/ beside a directory that is not a snapshot is no cache.
  fs::create_directories(root_ / "plain");
  fs::create_symlink("../hub/models--org--name/blobs/0a1b", root_ / "plain" / "tokenizer_config.json");
  EXPECT_FALSE(check_hf_dir_links((root_ / "plain").string()).ok());
}

TEST_F(HfSideFileLinksTest, RefusesABlobsDirectoryThatIsALink) {
  // A cache-shaped directory whose blobs/ is itself a link (blobs -> anywhere) is no cache: its "blobs" are any files.
  fs::create_directories(root_ / "elsewhere");
  write(root_ / "elsewhere" / "passwd", "not for the checkpoint");
  fs::rename(repo() / "blobs", root_ / "real_blobs");
  fs::create_directory_symlink(root_ / "elsewhere", repo() / "blobs");
  for (const char* name : {"tokenizer.json", "model.safetensors"}) {
    SCOPED_TRACE(name);
    fs::create_symlink("../../blobs/passwd", snapshot() / name);
    const Status status = check_hf_file_link(snapshot().string(), name);
    ASSERT_FALSE(status.ok());
    EXPECT_NE(status.message().find(fs::canonical(root_ / "elsewhere" / "passwd").string()), std::string::npos)
        << status.message();
    EXPECT_FALSE(check_hf_dir_links(snapshot().string()).ok());
    fs::remove(snapshot() / name);
  }
}

TEST_F(HfSideFileLinksTest, ASideFileThatCannotBeCopiedIsAnErrorNotLeftOut) {
  const fs::path dir = root_ / "model";
  fs::create_directories(dir / "original");  // a subfolder: no side file
  fs::create_directory(dir / "tokenizer.json");
  fs::create_symlink("nothere.json", dir / "vocab.json");
  fs::create_symlink("b.txt", dir / "merges.txt");
  fs::create_symlink("merges.txt", dir / "b.txt");
  const std::vector<std::string> names = hf_side_files(dir.string());
  EXPECT_EQ(names, (std::vector<std::string>{"b.txt", "merges.txt", "tokenizer.json", "vocab.json"}));
  for (const std::string name : {"tokenizer.json", "vocab.json", "merges.txt"}) {
    SCOPED_TRACE(name);
    const Status copied = copy_side_files(dir.string(), (root_ / "out").string(), {name}, SideFileLinks::kFollow);
    ASSERT_FALSE(copied.ok());
    EXPECT_NE(copied.message().find((dir / name).string()), std::string::npos) << copied.message();
    const auto recorded = side_files_to_record(dir.string(), {name}, SideFileLinks::kFollow);
    ASSERT_FALSE(recorded.ok());
    EXPECT_NE(recorded.status().message().find((dir / name).string()), std::string::npos);
  }
}

// A JSON side file that does not parse (transformers refuses to load a model whose generation_config.json does not) is
// refused naming it, not carried into the checkpoint; other side files are bytes and travel as they are.
TEST_F(HfSideFileLinksTest, AJsonSideFileThatDoesNotParseIsRefused) {
  const fs::path dir = root_ / "model";
  fs::create_directories(dir);
  write(dir / "generation_config.json", "{\"do_sample\": tru");
  write(dir / "merges.txt", "{not json, and need not be");
  const auto recorded = side_files_to_record(dir.string(), {"generation_config.json"}, SideFileLinks::kFollow);
  ASSERT_FALSE(recorded.ok());
  EXPECT_NE(recorded.status().message().find((dir / "generation_config.json").string() + ": not valid JSON"),
            std::string::npos)
      << recorded.status().message();
  EXPECT_FALSE(
      copy_side_files(dir.string(), (root_ / "out").string(), {"generation_config.json"}, SideFileLinks::kFollow).ok());
  EXPECT_TRUE(side_files_to_record(dir.string(), {"merges.txt"}, SideFileLinks::kFollow).ok());
  write(dir / "generation_config.json", "{\"do_sample\": true}");
  EXPECT_TRUE(side_files_to_record(dir.string(), {"generation_config.json"}, SideFileLinks::kFollow).ok());
}

// A JSON side file past the size the readers hold (256 MiB) is checked all the same, read as it streams by.
TEST_F(HfSideFileLinksTest, ALargeJsonSideFileIsCheckedToo) {
  const fs::path dir = root_ / "model";
  fs::create_directories(dir);
  {
    std::ofstream out(dir / "tokenizer.json");
    out << "{\"pad\": \"";
    const std::string block(1 << 20, 'x');
    for (int i = 0; i < 260; ++i) out << block;
    out << "\"";  // no closing brace
  }
  const auto recorded = side_files_to_record(dir.string(), {"tokenizer.json"}, SideFileLinks::kFollow);
  ASSERT_FALSE(recorded.ok());
  EXPECT_NE(recorded.status().message().find("tokenizer.json: not valid JSON"), std::string::npos)
      << recorded.status().message();
  std::ofstream(dir / "tokenizer.json", std::ios::app) << "}";
  EXPECT_TRUE(side_files_to_record(dir.string(), {"tokenizer.json"}, SideFileLinks::kFollow).ok());
}

// A side file travels beside what a converter writes, never in its place: a checkpoint that lists config.json or a
// weights file among its side files is refused, whatever the reader.
TEST_F(HfSideFileLinksTest, ASideFileCannotTakeTheNameOfAWrittenFile) {
  const fs::path dir = root_ / "model";
  fs::create_directories(dir);
  for (const char* name :
       {"config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", ".hidden"}) {
    write(dir / name, "{}");
    for (const auto links : {SideFileLinks::kFollow, SideFileLinks::kRefuse}) {
      const auto recorded = side_files_to_record(dir.string(), {name}, links);
      ASSERT_FALSE(recorded.ok()) << name;
      EXPECT_NE(recorded.status().message().find("cannot be a side file"), std::string::npos)
          << recorded.status().message();
      EXPECT_FALSE(copy_side_files(dir.string(), (root_ / "out").string(), {name}, links).ok()) << name;
    }
    EXPECT_FALSE(fs::exists(root_ / "out" / name)) << name;
  }
}

TEST_F(HfSideFileLinksTest, CopyRefusesALinkOutEvenWhenFollowing) {
  fs::create_symlink(root_ / "secret", snapshot() / "chat_template.jinja");
  const Status copied =
      copy_side_files(snapshot().string(), (root_ / "out").string(), {"chat_template.jinja"}, SideFileLinks::kFollow);
  ASSERT_FALSE(copied.ok());
  EXPECT_NE(copied.message().find("chat_template.jinja"), std::string::npos) << copied.message();
  EXPECT_FALSE(fs::exists(root_ / "out" / "chat_template.jinja"));
}

// transformers saves a tokenizer's named chat templates as additional_chat_templates/<name>.jinja: the one subfolder
// whose files travel, copied into the same place; a link out of the tree is refused there too, as is the folder itself
// as a link in a checkpoint, and no other subfolder's name passes.
TEST_F(HfSideFileLinksTest, NamedChatTemplatesTravelInTheirSubfolder) {
  const fs::path dir = root_ / "model";
  fs::create_directories(dir / kChatTemplatesDir);
  fs::create_directories(dir / "original");
  write(dir / kChatTemplatesDir / "tool_use.jinja", "TOOLS {{ tools }}");
  write(dir / "chat_template.jinja", "{{ messages }}");
  const std::vector<std::string> names = hf_side_files(dir.string());
  EXPECT_EQ(names, (std::vector<std::string>{"additional_chat_templates/tool_use.jinja", "chat_template.jinja"}));
  ASSERT_TRUE(copy_side_files(dir.string(), (root_ / "out").string(), names, SideFileLinks::kFollow).ok());
  EXPECT_TRUE(fs::is_regular_file(root_ / "out" / kChatTemplatesDir / "tool_use.jinja"));
  const auto recorded = side_files_to_record(dir.string(), names, SideFileLinks::kRefuse);
  ASSERT_TRUE(recorded.ok()) << recorded.status().message();
  EXPECT_EQ(recorded->front().name, "hf_files/additional_chat_templates/tool_use.jinja");
  EXPECT_FALSE(is_side_file_name("original/x.jinja"));
  EXPECT_FALSE(is_side_file_name("additional_chat_templates/../x"));
  EXPECT_FALSE(is_side_file_name("additional_chat_templates/a/b"));
  fs::create_symlink(root_ / "secret", dir / kChatTemplatesDir / "leak.jinja");
  EXPECT_FALSE(check_hf_dir_links(dir.string()).ok());
  const fs::path linked = root_ / "linked";
  fs::create_directories(linked);
  fs::create_directory_symlink(dir / kChatTemplatesDir, linked / kChatTemplatesDir);
  EXPECT_FALSE(
      side_files_to_record(linked.string(), {"additional_chat_templates/tool_use.jinja"}, SideFileLinks::kRefuse).ok());
}

TEST_F(HfSideFileLinksTest, ACheckpointsSideFileIsNeverALink) {
  const auto recorded = side_files_to_record(snapshot().string(), {"tokenizer_config.json"}, SideFileLinks::kRefuse);
  ASSERT_FALSE(recorded.ok());
  EXPECT_NE(recorded.status().message().find("symbolic link"), std::string::npos) << recorded.status().message();
}

}  // namespace
}  // namespace trestle
