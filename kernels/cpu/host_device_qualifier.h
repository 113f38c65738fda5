// The qualifiers that let per-thread arithmetic compile for the host and for CUDA devices alike: host-and-device
// functions (TRESTLE_HOST_DEVICE) and loops fully unrolled on the device (TRESTLE_UNROLL); empty for the host compiler.
#pragma once

#if defined(__CUDACC__)
#define TRESTLE_HOST_DEVICE __host__ __device__
#define TRESTLE_UNROLL _Pragma("unroll")
#else
#define TRESTLE_HOST_DEVICE
#define TRESTLE_UNROLL
#endif
