// What the CUDA kernels' per-thread arithmetic (rope_slot.h, glu_pack.h, rms_norm_share.h, softcap_pack.h) needs to
// compile for the host as well, so that the CPU tests run it: the host-and-device qualifier, a pack of elements read or
// written as one access, and loops fully unrolled on the device (TRESTLE_UNROLL).
#pragma once

#include "kernels/cpu/host_device_qualifier.h"

namespace trestle::kernels::cuda {

// V consecutive elements, one load or store (16 bytes in the vectorised kernels; V = 1: one element).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

}  // namespace trestle::kernels::cuda
