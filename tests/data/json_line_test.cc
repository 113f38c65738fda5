// parse_json_line against what Python's json.loads (Megatron's preprocess_data.py) reads: its extras parse, each
// noted under its top-level key; what Python refuses stays refused, with the column of the line itself.
#include "train/data/json_line.h"

#include <gtest/gtest.h>

#include "tests/support/status_matchers.h"

namespace trestle::data {
namespace {

TEST(JsonLine, StrictJsonNotesNothing) {
  const auto line = parse_json_line(R"({"text": "a\ud83d\ude00", "n": 1.5e300})");
  ASSERT_TRUE(line.ok()) << line.status().message();
  EXPECT_EQ(line->value["text"], "a\xF0\x9F\x98\x80");
  EXPECT_TRUE(line->inexact_keys.empty());
}

TEST(JsonLine, PythonsExtrasAreNotedUnderTheirTopLevelKey) {
  // Python reads "g" as an int; beyond a double's range, nlohmann refused it.
  const auto line = parse_json_line(R"({"a": NaN, "b": [1, {"c": Infinity}], "d": -Infinity, "e": "x\udfff", )"
                                    R"("f": 1e400, "g": -1)" +
                                    std::string(400, '0') + R"(, "h": "ok", "\udc00": 2})");
  ASSERT_TRUE(line.ok()) << line.status().message();
  EXPECT_EQ(line->inexact_keys.at("a"), "NaN");
  EXPECT_EQ(line->inexact_keys.at("b"), "Infinity");
  EXPECT_EQ(line->inexact_keys.at("d"), "-Infinity");
  EXPECT_EQ(line->inexact_keys.at("e"), "a lone UTF-16 surrogate escape (\\udfff)");
  EXPECT_EQ(line->inexact_keys.at("f"), "a number beyond a double's range (1e400)");
  EXPECT_EQ(line->inexact_keys.at("g"), "a number beyond a double's range (-1" + std::string(38, '0') + "...)");
  EXPECT_FALSE(line->inexact_keys.contains("h"));
  EXPECT_EQ(line->value["h"], "ok");
  EXPECT_EQ(line->value["e"], "x\xEF\xBF\xBD");
  EXPECT_EQ(line->inexact_keys.size(), 6u);  // not the key that is itself a lone surrogate
}

TEST(JsonLine, ARepeatedKeysLastValueCounts) {
  auto line = parse_json_line(R"({"text": NaN, "text": "b"})");
  ASSERT_TRUE(line.ok());
  EXPECT_EQ(line->value["text"], "b");
  EXPECT_FALSE(line->inexact_keys.contains("text"));
  line = parse_json_line(R"({"text": "b", "t\u0065xt": NaN})");
  ASSERT_TRUE(line.ok());
  EXPECT_EQ(line->inexact_keys.at("text"), "NaN");
}

TEST(JsonLine, WhatPythonRefusesStaysRefusedAtItsOwnColumn) {
  // NaN before the error: the column is the trailing comma's in the line as written.
  EXPECT_TRUE(fails_with(parse_json_line(R"({"x": NaN, })"), "column 12"));
  EXPECT_TRUE(fails_with(parse_json_line(R"({"x": 1e400e})"), "parse error"));
  EXPECT_TRUE(fails_with(parse_json_line(R"({"x": -NaN})"), "parse error"));
  EXPECT_TRUE(fails_with(parse_json_line(R"({"x": nan})"), "parse error"));
  EXPECT_TRUE(fails_with(parse_json_line(R"({"x": 01})"), "parse error"));
  EXPECT_TRUE(fails_with(parse_json_line(R"({"x": "\ud800"x})"), "parse error"));
  EXPECT_TRUE(fails_with(parse_json_line("{\"x\": \"a\xff\"}"), "ill-formed UTF-8"));
  EXPECT_TRUE(fails_with(parse_json_line(R"({"x": "\u12"})"), "parse error"));
  EXPECT_TRUE(fails_with(parse_json_line(R"({"x": "unterminated)"), "parse error"));
  // A byte-order mark: json.loads refuses it (nlohmann skipped it).
  EXPECT_TRUE(fails_with(parse_json_line("\xEF\xBB\xBF{\"x\": 1}"), "Unexpected UTF-8 BOM"));
}

}  // namespace
}  // namespace trestle::data
