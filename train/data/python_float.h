// Text read as Python's float() reads it, for flags Megatron parses with float() (--split, --data-path's weights):
// surrounding whitespace, a sign, decimal digits (underscores between them), a fraction, an exponent, inf, infinity and
// nan; no hexadecimal, nothing left over (strtod stops early on "1.2.3" and reads "0x10" as 16; Python refuses both).
// Underflow gives the subnormal or 0 and overflow infinity, as in Python.
#pragma once

#include <optional>
#include <string_view>

namespace trestle::data {

std::optional<double> python_float(std::string_view text);

}  // namespace trestle::data
