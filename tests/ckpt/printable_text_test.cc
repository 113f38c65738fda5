// Text from files reaches users as valid UTF-8 on one line: bytes that are not UTF-8 text and control characters read
// \xNN (newline, carriage return and tab \n, \r and \t); printable text (any script) is kept as it is.
#include "ckpt/printable_text.h"

#include <gtest/gtest.h>

namespace trestle {
namespace {

TEST(PrintableText, ValidTextIsKept) {
  EXPECT_EQ(printable_text("file.pt: bad 'x' ~"), "file.pt: bad 'x' ~");
  EXPECT_EQ(printable_text("caf\xc3\xa9 \xe6\x97\xa5 \xf0\x9f\x98\x80"), "caf\xc3\xa9 \xe6\x97\xa5 \xf0\x9f\x98\x80");
}

TEST(PrintableText, OtherBytesAreEscaped) {
  EXPECT_EQ(printable_text(std::string("q\x08K\x06X\x15\x00", 7)), "q\\x08K\\x06X\\x15\\x00");
  EXPECT_EQ(printable_text("a\x88z\xff"), "a\\x88z\\xff");
  EXPECT_EQ(printable_text("\xc3"), "\\xc3");                             // a cut sequence
  EXPECT_EQ(printable_text("\xc0\xaf"), "\\xc0\\xaf");                    // overlong
  EXPECT_EQ(printable_text("\xed\xa0\x80"), "\\xed\\xa0\\x80");           // a surrogate
  EXPECT_EQ(printable_text("\xf4\x90\x80\x80"), "\\xf4\\x90\\x80\\x80");  // beyond U+10FFFF
  EXPECT_EQ(printable_text("\x7f"), "\\x7f");
  EXPECT_EQ(printable_text("a\xc2\x9b"
                           "2Jb\xc2\x85"),
            "a\\xc2\\x9b2Jb\\xc2\\x85");                              // C1 controls (CSI, NEL)
  EXPECT_EQ(printable_text("\xc2\xa0\xc2\xbf"), "\xc2\xa0\xc2\xbf");  // just above them
}

// A tensor name crafted to clear the screen, colour the text, ring the bell and forge a line of a table.
TEST(PrintableText, NamesCannotControlTheTerminalOrForgeLines) {
  EXPECT_EQ(printable_text("evil\x1b[2J\x1b[31mRED\nfake line\x07"), "evil\\x1b[2J\\x1b[31mRED\\nfake line\\x07");
  EXPECT_EQ(printable_text("a\r\nb\tc"), "a\\r\\nb\\tc");
  for (int c = 0; c < 0x20; ++c) {
    const std::string out = printable_text(std::string(1, static_cast<char>(c)));
    EXPECT_EQ(out[0], '\\') << c;
    for (char o : out) EXPECT_GE(static_cast<unsigned char>(o), 0x20) << c;
  }
}

// A name with a right-to-left override shows reversed ("\u202etxt.exe" reads "exe.txt"): bidirectional controls are
// escaped, the characters around them kept.
TEST(PrintableText, BidirectionalControlsAreEscaped) {
  EXPECT_EQ(printable_text("a\xe2\x80\xaetxt.exe"), "a\\xe2\\x80\\xaetxt.exe");               // U+202E
  EXPECT_EQ(printable_text("\xe2\x80\xaa\xe2\x80\x8f"), "\\xe2\\x80\\xaa\\xe2\\x80\\x8f");    // U+202A, U+200F
  EXPECT_EQ(printable_text("\xe2\x81\xa6x\xe2\x81\xa9"), "\\xe2\\x81\\xa6x\\xe2\\x81\\xa9");  // U+2066, U+2069
  EXPECT_EQ(printable_text("\xd8\x9c"), "\\xd8\\x9c");                                        // U+061C
  EXPECT_EQ(printable_text("\xe2\x80\x94 \xe2\x81\xa0 \xd8\xa7"),
            "\xe2\x80\x94 \xe2\x81\xa0 \xd8\xa7");  // a dash, U+2060, alef
}

}  // namespace
}  // namespace trestle
