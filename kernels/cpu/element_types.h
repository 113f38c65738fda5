// The element types the CPU kernels and the reference take, by their Dtype: with_element_type(type, f) calls f with a
// null pointer of that C++ type (c10::BFloat16, c10::Half, float), for f to name it.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "kernels/cpu/cpu_kernels.h"

namespace trestle::kernels::cpu {

template <typename F>
void with_element_type(Dtype type, F f) {
  switch (type) {
    case Dtype::kFloat:
      return f(static_cast<float*>(nullptr));
    case Dtype::kBFloat16:
      return f(static_cast<c10::BFloat16*>(nullptr));
    case Dtype::kHalf:
      return f(static_cast<c10::Half*>(nullptr));
  }
}

}  // namespace trestle::kernels::cpu
