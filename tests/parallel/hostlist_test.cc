// Slurm's compressed host lists: the first host (task 0's, which serves the job's store) and clear errors for a list
// that is not one.
#include "parallel/hostlist.h"

#include <gtest/gtest.h>

#include "tests/support/status_matchers.h"

namespace {

using trestle::fails_with;
using trestle::parallel::first_host_of_hostlist;

std::string first(std::string_view list) {
  auto host = first_host_of_hostlist(list);
  EXPECT_TRUE(host.ok()) << host.status().message();
  return host.ok() ? *host : "";
}

TEST(Hostlist, PlainNames) {
  EXPECT_EQ(first("localhost"), "localhost");
  EXPECT_EQ(first("cpu1,gpu2"), "cpu1");
  EXPECT_EQ(first("node-1.cluster.example"), "node-1.cluster.example");
  EXPECT_EQ(first("127.0.0.1"), "127.0.0.1");
}

TEST(Hostlist, BracketsGiveTheirFirstNumberWithItsPadding) {
  EXPECT_EQ(first("gpu[03-05,9],cpu1"), "gpu03");
  EXPECT_EQ(first("gpu[9,03-05]"), "gpu9");
  EXPECT_EQ(first("node[0001-0128]"), "node0001");
  EXPECT_EQ(first("node[7]"), "node7");
  EXPECT_EQ(first("cpu1,gpu[03-05]"), "cpu1");
  // Several brackets in one name (Slurm's multi-dimensional lists) and text after a bracket.
  EXPECT_EQ(first("rack[2-3]-n[07-08]"), "rack2-n07");
  EXPECT_EQ(first("n[1-2]a,b"), "n1a");
  EXPECT_EQ(first("127.0.0.[1-2]"), "127.0.0.1");
}

TEST(Hostlist, RangesCompareByValue) {
  EXPECT_EQ(first("n[9-10]"), "n9");
  EXPECT_EQ(first("n[007-7]"), "n007");
  EXPECT_TRUE(fails_with(first_host_of_hostlist("n[10-9]"), "the range '10-9' runs backwards"));
}

TEST(Hostlist, MalformedListsAreNamedWithWhatIsWrong) {
  EXPECT_TRUE(fails_with(first_host_of_hostlist(""), "Slurm host list '': it is empty"));
  EXPECT_TRUE(fails_with(first_host_of_hostlist("a,,b"), "'a,,b': an empty host name at offset 2"));
  EXPECT_TRUE(fails_with(first_host_of_hostlist(",a"), "an empty host name at offset 0"));
  EXPECT_TRUE(fails_with(first_host_of_hostlist("a,"), "an empty host name at offset 2"));
  EXPECT_TRUE(fails_with(first_host_of_hostlist("gpu[1-2"), "the '[' at offset 3 has no matching ']'"));
  EXPECT_TRUE(fails_with(first_host_of_hostlist("gpu[1-[2]]"), "the '[' at offset 3 has no matching ']'"));
  EXPECT_TRUE(fails_with(first_host_of_hostlist("gpu1]"), "the ']' at offset 4 has no matching '['"));
  EXPECT_TRUE(fails_with(first_host_of_hostlist("gpu[]"), "'[]' is not a number or a range of numbers"));
  EXPECT_TRUE(fails_with(first_host_of_hostlist("gpu[a-b]"), "'[a-b]' is not a number or a range of numbers"));
  EXPECT_TRUE(fails_with(first_host_of_hostlist("gpu[1-]"), "'[1-]' is not a number"));
  EXPECT_TRUE(fails_with(first_host_of_hostlist("gpu[1,]"), "'[]' is not a number"));
  EXPECT_TRUE(fails_with(first_host_of_hostlist("gpu[1-2-3]"), "'[1-2-3]' is not a number"));
  EXPECT_TRUE(fails_with(first_host_of_hostlist("gpu1 gpu2"), "a blank or unprintable character at offset 4"));
  // A later host that is malformed fails the list too: no half-read answer.
  EXPECT_TRUE(fails_with(first_host_of_hostlist("gpu1,gpu[2-"), "the '[' at offset 8 has no matching ']'"));
}

}  // namespace
