#include "base/utf8.h"

#include <string>

#include "gtest/gtest.h"

namespace offload {
namespace {

TEST(Utf8Test, AcceptsValidText) {
  EXPECT_EQ(FirstInvalidUtf8(""), std::nullopt);
  EXPECT_EQ(FirstInvalidUtf8("rank0/layers.3.attn"), std::nullopt);
  EXPECT_EQ(FirstInvalidUtf8("r\xc3\xa9seau \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80"),
            std::nullopt);                                        // é, 日本, an emoji
  EXPECT_EQ(FirstInvalidUtf8("\xf4\x8f\xbf\xbf"), std::nullopt);  // U+10FFFF
}

TEST(Utf8Test, NamesTheFirstBadByte) {
  EXPECT_EQ(FirstInvalidUtf8("ab\xff"), 2u);
  EXPECT_EQ(FirstInvalidUtf8("\x80"), 0u);              // a lone continuation byte
  EXPECT_EQ(FirstInvalidUtf8("a\xc3"), 1u);             // truncated
  EXPECT_EQ(FirstInvalidUtf8("a\xc3(b"), 2u);           // not continued
  EXPECT_EQ(FirstInvalidUtf8("\xc0\xaf"), 0u);          // overlong '/'
  EXPECT_EQ(FirstInvalidUtf8("\xe0\x80\xaf"), 0u);      // overlong, 3 bytes
  EXPECT_EQ(FirstInvalidUtf8("x\xed\xa0\x80"), 1u);     // a surrogate, U+D800
  EXPECT_EQ(FirstInvalidUtf8("\xf4\x90\x80\x80"), 0u);  // above U+10FFFF
  EXPECT_EQ(FirstInvalidUtf8(std::string("ok\0\xfe", 4)), 3u);
}

TEST(Utf8Test, FindsC1ControlsAndBidirectionalOverrides) {
  EXPECT_FALSE(FirstUnsafeCodePoint("r\xc3\xa9seau \xe6\x97\xa5\xe6\x9c\xac").has_value());
  EXPECT_FALSE(FirstUnsafeCodePoint("\xc2\xa0").has_value());  // U+00A0, just past C1
  auto c1 = FirstUnsafeCodePoint("ab\xc2\x85");                // U+0085, next line
  ASSERT_TRUE(c1.has_value());
  EXPECT_EQ(c1->offset, 2u);
  EXPECT_EQ(c1->code_point, 0x85u);
  auto rlo = FirstUnsafeCodePoint("x\xe2\x80\xae.txt");  // U+202E, right-to-left override
  ASSERT_TRUE(rlo.has_value());
  EXPECT_EQ(rlo->offset, 1u);
  EXPECT_EQ(rlo->code_point, 0x202eu);
  auto isolate = FirstUnsafeCodePoint("\xe2\x81\xa9");  // U+2069, pop directional isolate
  ASSERT_TRUE(isolate.has_value());
  EXPECT_EQ(isolate->code_point, 0x2069u);
  EXPECT_FALSE(FirstUnsafeCodePoint("\xe2\x80\xaf").has_value());  // U+202F, a space
}

}  // namespace
}  // namespace offload
