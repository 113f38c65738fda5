// Test support: an expected failure together with words its message must hold, so that a test expecting one error
// cannot pass on another. EXPECT_TRUE(fails_with(parse_split("0,0,0"), "the weights sum to 0")).
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <string_view>

#include "ckpt/status.h"

// In namespace trestle itself: a nested trestle::testing would hide gtest's ::testing from the tests that say
// testing::Test.
namespace trestle {

inline ::testing::AssertionResult fails_with(const Status& status, std::string_view text) {
  if (status.ok()) return ::testing::AssertionFailure() << "succeeded; expected an error saying \"" << text << "\"";
  if (status.message().find(text) == std::string::npos)
    return ::testing::AssertionFailure() << "failed with \"" << status.message() << "\", not saying \"" << text << "\"";
  return ::testing::AssertionSuccess();
}

template <class T>
::testing::AssertionResult fails_with(const Result<T>& result, std::string_view text) {
  return fails_with(result.status(), text);
}

}  // namespace trestle
