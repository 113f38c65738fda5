// Error messages reach users as valid UTF-8: bytes quoted from a damaged file that are not UTF-8 text, and control
// characters other than newline and tab, read \xNN; valid text (any script) is kept as it is.
#include "ckpt/printable_text.h"

#include <gtest/gtest.h>

namespace trestle {
namespace {

TEST(PrintableText, ValidTextIsKept) {
  EXPECT_EQ(printable_text("file.pt: bad\n\tnext"), "file.pt: bad\n\tnext");
  EXPECT_EQ(printable_text("caf\xc3\xa9 \xe6\x97\xa5 \xf0\x9f\x98\x80"), "caf\xc3\xa9 \xe6\x97\xa5 \xf0\x9f\x98\x80");
}

TEST(PrintableText, OtherBytesAreEscaped) {
  EXPECT_EQ(printable_text(std::string("q\x08K\x06X\x15\x00", 7)), "q\\x08K\\x06X\\x15\\x00");
  EXPECT_EQ(printable_text("a\x88z\xff"), "a\\x88z\\xff");
  EXPECT_EQ(printable_text("\xc3"), "\\xc3");                             // a cut sequence
  EXPECT_EQ(printable_text("\xc0\xaf"), "\\xc0\\xaf");                    // overlong
  EXPECT_EQ(printable_text("\xed\xa0\x80"), "\\xed\\xa0\\x80");           // a surrogate
  EXPECT_EQ(printable_text("\xf4\x90\x80\x80"), "\\xf4\\x90\\x80\\x80");  // beyond U+10FFFF
  EXPECT_EQ(printable_text("\r\x7f"), "\\x0d\\x7f");
}

}  // namespace
}  // namespace trestle
