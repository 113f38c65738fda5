# Decides whether the CUDA kernels are built: TRESTLE_CUDA=AUTO builds them when nvcc is found.
set(TRESTLE_HAVE_CUDA OFF)
if(NOT TRESTLE_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80-real 90-real 100-real 100-virtual)  # A100, H100/H200, B200, PTX for later GPUs
    endif()
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)  # CMake 3.25 knows no C++20 flag for nvcc
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    set(TRESTLE_HAVE_CUDA ON)
  elseif(TRESTLE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "TRESTLE_CUDA=ON but no CUDA compiler (nvcc) was found")
  endif()
endif()
message(STATUS "CUDA kernels: ${TRESTLE_HAVE_CUDA}")
