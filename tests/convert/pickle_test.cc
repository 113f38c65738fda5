// The pickle subset: CPython's bytes (captured from Python 3.11's pickle.dumps) parse to the expected values and are
// written back byte for byte; malformed input fails with a message and never crashes.
#include <gtest/gtest.h>

#include <string>

#include "convert/formats/torch/pickle_reader.h"
#include "convert/formats/torch/pickle_writer.h"
#include "tests/support/status_matchers.h"

namespace trestle {
namespace {

std::string unhex(const std::string& hex) {
  std::string out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2)
    out += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

// pickle.dumps({"a": 1, "b": [1, 2.5, "x", None, True, False], "c": (1, 2), "d": (1, 2, 3, 4), "neg": -5,
//               "big": 2**40, "nbig": -2**40, "i16": 300, "i32": 70000, "n32": -70000}, protocol=2)
const char* kP2Mixed =
    "80027d71002858010000006171014b0158010000006271025d7103284b0147400400000000000058010000007871044e888965580100000063"
    "71"
    "054b014b028671065801000000647107284b014b024b034b0474710858030000006e656771094afbffffff5803000000626967710a8a060000"
    "0000"
    "000158040000006e626967710b8a060000000000ff5803000000693136710c4d2c015803000000693332710d4a7011010058030000006e3332"
    "710e"
    "4a90eefeff752e";
// pickle.dumps({"a": 1, "b": [...], "c": (1, 2), "d": (1, 2, 3, 4), "e": b"\x00\xff", "s": {3}, "big": 2**63-1}, 4)
const char* kP4Mixed =
    "80049561000000000000007d94288c0161944b018c0162945d94284b014740040000000000008c0178944e8889658c0163944b014b0286948c"
    "0164"
    "94284b014b024b034b0474948c016594430200ff948c0173948f94284b03908c03626967948a08ffffffffffffff7f752e";
// pickle.dumps([b"\x00\xffab", b""], protocol=2)
const char* kP2Bytes =
    "80025d710028635f636f646563730a656e636f64650a7101580500000000c3bf6162710258060000006c6174696e317103867104527105635f"
    "5f"
    "6275696c74696e5f5f0a62797465730a710629527107652e";
// pickle.dumps(collections.OrderedDict([("w", 1), ("v", 2)]), protocol=2)
const char* kP2OrderedDict =
    "800263636f6c6c656374696f6e730a4f726465726564446963740a7100295271012858010000007771024b0158010000007671034b02752e";
// s = "abc"; pickle.dumps([s, s, (s,)], protocol=2)
const char* kP2Shared = "80025d7100285803000000616263710168016801857102652e";

void expect_roundtrip(const char* hex, int protocol) {
  const std::string bytes = unhex(hex);
  auto doc = parse_pickle(bytes);
  ASSERT_TRUE(doc.ok()) << doc.status().message();
  auto written = write_pickle(doc->root(), protocol);
  ASSERT_TRUE(written.ok()) << written.status().message();
  EXPECT_EQ(*written, bytes) << "protocol " << protocol;
}

TEST(PickleTest, Protocol2ValuesParse) {
  auto doc = parse_pickle(unhex(kP2Mixed));
  ASSERT_TRUE(doc.ok()) << doc.status().message();
  const PickleValue* root = doc->root();
  ASSERT_TRUE(root->is(PickleKind::kDict));
  EXPECT_EQ(root->get("a")->integer, 1);
  EXPECT_EQ(root->get("neg")->integer, -5);
  EXPECT_EQ(root->get("big")->integer, std::int64_t{1} << 40);
  EXPECT_EQ(root->get("nbig")->integer, -(std::int64_t{1} << 40));
  EXPECT_EQ(root->get("i16")->integer, 300);
  EXPECT_EQ(root->get("i32")->integer, 70000);
  EXPECT_EQ(root->get("n32")->integer, -70000);
  const PickleValue* b = root->get("b");
  ASSERT_EQ(b->items.size(), 6u);
  EXPECT_DOUBLE_EQ(b->items[1]->real, 2.5);
  EXPECT_EQ(b->items[2]->text, "x");
  EXPECT_TRUE(b->items[3]->is(PickleKind::kNone));
  EXPECT_TRUE(b->items[4]->boolean);
  EXPECT_FALSE(b->items[5]->boolean);
  EXPECT_EQ(*pickle_int_tuple(root->get("d"), "d"), (std::vector<std::int64_t>{1, 2, 3, 4}));
}

TEST(PickleTest, Protocol4FramesBytesSetsAndLongs) {
  auto doc = parse_pickle(unhex(kP4Mixed));
  ASSERT_TRUE(doc.ok()) << doc.status().message();
  EXPECT_EQ(doc->root()->get("e")->text, std::string("\x00\xff", 2));
  EXPECT_TRUE(doc->root()->get("s")->is(PickleKind::kSet));
  EXPECT_EQ(doc->root()->get("big")->integer, INT64_MAX);
}

TEST(PickleTest, Protocol2BytesAndOrderedDictBecomeData) {
  auto doc = parse_pickle(unhex(kP2Bytes));
  ASSERT_TRUE(doc.ok()) << doc.status().message();
  EXPECT_EQ(doc->root()->items[0]->text, std::string("\x00\xff"
                                                     "ab",
                                                     4));
  EXPECT_TRUE(doc->root()->items[1]->is(PickleKind::kBytes));
  auto od = parse_pickle(unhex(kP2OrderedDict));
  ASSERT_TRUE(od.ok());
  EXPECT_EQ(od->root()->class_name(), "collections.OrderedDict");
  EXPECT_EQ(od->root()->get("v")->integer, 2);
}

TEST(PickleTest, WriterMatchesCPythonByteForByte) {
  expect_roundtrip(kP2Mixed, 2);
  expect_roundtrip(kP4Mixed, 4);
  expect_roundtrip(kP2Bytes, 2);
  expect_roundtrip(kP2OrderedDict, 2);
  expect_roundtrip(kP2Shared, 2);
}

TEST(PickleTest, UnknownClassesStayGenericObjects) {
  // GLOBAL argparse Namespace, EMPTY_TUPLE, NEWOBJ, {'num_layers': 2}, BUILD, STOP
  const std::string bytes = unhex(
      "80026361726770617273650a4e616d6573706163650a29817d580a0000006e756d5f6c61796572734b027362"
      "2e");
  auto doc = parse_pickle(bytes);
  ASSERT_TRUE(doc.ok()) << doc.status().message();
  EXPECT_EQ(doc->root()->class_name(), "argparse.Namespace");
  EXPECT_EQ(doc->root()->attr("num_layers")->integer, 2);
}

TEST(PickleTest, PersistentIdsAreKept) {
  // ('storage', 'x') BINPERSID
  auto doc =
      parse_pickle(unhex("80025807000000"
                         "73746f72616765"
                         "5801000000"
                         "78"
                         "86"
                         "51"
                         "2e"));
  ASSERT_TRUE(doc.ok()) << doc.status().message();
  ASSERT_TRUE(doc->root()->is(PickleKind::kPersistentId));
  EXPECT_EQ(doc->root()->pid->items[0]->text, "storage");
}

void expect_error(const std::string& bytes, const std::string& fragment) {
  auto doc = parse_pickle(bytes);
  ASSERT_FALSE(doc.ok());
  EXPECT_NE(doc.status().message().find(fragment), std::string::npos) << doc.status().message();
}

TEST(PickleMalformedTest, FailsWithAMessage) {
  expect_error("", "before the STOP");
  expect_error(unhex(kP2Mixed).substr(0, 40), "");                // truncated
  expect_error(unhex("8002580000ffff"), "past the end");          // BINUNICODE length past the end
  expect_error(unhex("80028e0000000000000010"), "past the end");  // BINBYTES8 with a 2^60 length
  expect_error(unhex("8002680500"), "memo index 5");              // BINGET of a never-stored index
  expect_error(unhex("8002ff"), "opcode 0xff");                   // unknown opcode
  expect_error(unhex("80022e"), "STOP with 0 values");            // empty stack at STOP
  expect_error(unhex("8002827f2e"), "extension");                 // EXT1
  expect_error(unhex("80024b014b022e"), "STOP with 2 values");
  expect_error(unhex("8002742e"), "no MARK");
  expect_error(unhex("8002297d522e"), "not a tuple");  // REDUCE with a dict as arguments
  expect_error(unhex("8006"), "protocol 6");
}

TEST(PickleMalformedTest, NestingBombIsRefused) {
  std::string bomb = unhex("8002") + std::string(100000, '(') + std::string(100000, 'l') + ".";
  expect_error(bomb, "nesting deeper");
  // Deep nesting without MARKs (EMPTY_LIST then APPEND into itself repeatedly) parses, and walkers stay bounded.
  std::string deep = unhex("8002");
  for (int i = 0; i < 5000; ++i) deep += "]";
  for (int i = 0; i < 4999; ++i) deep += "a";
  deep += ".";
  auto doc = parse_pickle(deep);
  ASSERT_TRUE(doc.ok()) << doc.status().message();
  EXPECT_FALSE(pickle_repr(doc->root(), 100000).empty());
  EXPECT_TRUE(fails_with(write_pickle(doc->root(), 2), "values nested deeper than 512"));
  // A list containing itself: BINPUT 0, BINGET 0, APPEND.
  auto cyclic = parse_pickle(unhex("80025d71006800612e"));
  ASSERT_TRUE(cyclic.ok());
  EXPECT_FALSE(pickle_repr(cyclic->root()).empty());
}

// A pickle of many small values (batched APPENDS of one-byte integers: 2 bytes a value, some hundred bytes each
// parsed) stops at the document's value limit, named, instead of taking the machine's memory.
TEST(PickleMalformedTest, ValueBombIsRefusedAtTheLimit) {
  std::string bomb = unhex("80025d");
  for (int batch = 0; batch < 4; ++batch) {
    bomb += "(";
    for (int i = 0; i < 50000; ++i) bomb += std::string("K\x01", 2);
    bomb += "e";
  }
  bomb += ".";
  PickleLimits limits;
  ASSERT_GT(limits.max_values, 1'000'000u) << "the default is sized from this machine's memory";
  auto whole = parse_pickle(bomb);
  ASSERT_TRUE(whole.ok()) << whole.status().message();
  EXPECT_EQ(whole->root()->items.size(), 200000u);
  limits.max_values = 100000;
  EXPECT_TRUE(fails_with(parse_pickle(bomb, limits), "more than 100000 values"));
}

TEST(PickleMalformedTest, MutatedInputNeverCrashes) {
  const std::string base = unhex(kP4Mixed);
  for (std::size_t i = 0; i < base.size(); ++i)
    for (int delta : {1, 0x40, 0x80, 0xff}) {
      std::string mutated = base;
      mutated[i] = static_cast<char>(static_cast<unsigned char>(mutated[i]) + delta);
      auto doc = parse_pickle(mutated);
      if (doc.ok()) (void)pickle_repr(doc->root());
    }
}

}  // namespace
}  // namespace trestle
