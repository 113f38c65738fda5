// MD5 digest as lowercase hex: Megatron names its cached dataset indices by the MD5 of their description.
#pragma once

#include <string>
#include <string_view>

namespace trestle::data {

std::string md5_hex(std::string_view data);

}  // namespace trestle::data
