# Finds the chosen dependencies (DESIGN.md) and exposes them as targets.
find_package(PkgConfig REQUIRED)
find_package(Threads REQUIRED)
find_package(zstd REQUIRED CONFIG)
find_package(nlohmann_json 3.10 REQUIRED CONFIG)
find_package(cxxopts REQUIRED CONFIG)
find_package(HDF5 REQUIRED COMPONENTS C)
pkg_check_modules(URING REQUIRED IMPORTED_TARGET liburing)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
if(TRESTLE_BUILD_TESTS)
  find_package(GTest REQUIRED CONFIG)
endif()
if(TARGET zstd::libzstd_shared)
  add_library(trestle_zstd ALIAS zstd::libzstd_shared)
else()
  add_library(trestle_zstd ALIAS zstd::libzstd_static)
endif()

# LibTorch comes from the torch wheel in the project's venv, through the wheel's own CMake config (find_package(Torch)),
# as one target, Trestle::torch. A CUDA wheel's config needs a CUDA toolkit: with TRESTLE_HAVE_CUDA (TrestleCuda.cmake,
# included before this file) Trestle::torch carries LibTorch's CUDA and NCCL libraries and defines
# TRESTLE_HAVE_TORCH_CUDA and USE_C10D_NCCL; otherwise only its CPU libraries, so a CPU-only build needs no toolkit.
if(TRESTLE_PYTHON AND NOT EXISTS "${TRESTLE_PYTHON}")  # cached by an earlier build from a Python since removed
  unset(TRESTLE_PYTHON CACHE)
  unset(TRESTLE_PYTHON)
endif()
if(NOT TRESTLE_PYTHON AND Python3_EXECUTABLE)  # pip's build (scikit-build-core): the Python that runs pip
  set(TRESTLE_PYTHON ${Python3_EXECUTABLE} CACHE FILEPATH "" FORCE)
elseif(NOT TRESTLE_PYTHON)
  find_program(TRESTLE_PYTHON_FOUND NAMES python3 python)
  set(TRESTLE_PYTHON ${TRESTLE_PYTHON_FOUND} CACHE FILEPATH "" FORCE)
endif()
execute_process(
  COMMAND ${TRESTLE_PYTHON} -c "import torch, torch.utils; print(torch.utils.cmake_prefix_path); print(torch.version.cuda or '')"
  OUTPUT_VARIABLE torch_query ERROR_VARIABLE torch_query_error OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE torch_rc)
if(NOT torch_rc EQUAL 0)
  message(FATAL_ERROR "LibTorch not found through ${TRESTLE_PYTHON}: run scripts/setup, or pass "
                      "-DTRESTLE_PYTHON=<venv>/bin/python of an environment with torch installed\n${torch_query_error}")
endif()
string(REPLACE "\n" ";" torch_query "${torch_query}")
list(GET torch_query 0 TRESTLE_TORCH_PREFIX_PATH)
list(LENGTH torch_query torch_query_length)
set(TRESTLE_TORCH_WHEEL_CUDA "")
if(torch_query_length GREATER 1)
  list(GET torch_query 1 TRESTLE_TORCH_WHEEL_CUDA)
endif()
list(PREPEND CMAKE_PREFIX_PATH ${TRESTLE_TORCH_PREFIX_PATH})

set(TRESTLE_HAVE_TORCH_CUDA OFF)
if(TRESTLE_TORCH_WHEEL_CUDA AND NOT TRESTLE_HAVE_CUDA)
  # The CUDA wheel's config probes for a CUDA toolkit (its public/cuda.cmake) unless torch::cudart already exists; a
  # build without CUDA declares that target empty so the probe is skipped, and links none of LibTorch's CUDA targets.
  add_library(torch::cudart INTERFACE IMPORTED)
endif()
# The wheel's CUDA config replaces CMAKE_CUDA_ARCHITECTURES with its own TORCH_CUDA_ARCH_LIST; the kernels keep ours.
set(trestle_cuda_architectures "${CMAKE_CUDA_ARCHITECTURES}")
if(TRESTLE_HAVE_CUDA AND NOT DEFINED TORCH_CUDA_ARCH_LIST)
  set(TORCH_CUDA_ARCH_LIST "")
  foreach(arch ${CMAKE_CUDA_ARCHITECTURES})
    if(arch MATCHES "-virtual$")  # PTX: only the kernels' own concern
      continue()
    endif()
    string(REGEX REPLACE "^([0-9]+)([0-9])(-real)?$" "\\1.\\2" arch "${arch}")
    list(APPEND TORCH_CUDA_ARCH_LIST "${arch}")
  endforeach()
  unset(CMAKE_CUDA_ARCHITECTURES)
endif()
find_package(Torch REQUIRED CONFIG)
if(TRESTLE_HAVE_CUDA)
  set(CMAKE_CUDA_ARCHITECTURES "${trestle_cuda_architectures}")
endif()
add_library(trestle_torch INTERFACE)
# libstdc++ named ahead of LibTorch, so that it precedes libtorch in every binary's DT_NEEDED order: the torch 2.11
# cu130 wheel's libtorch.so exports its own unversioned copy of std::filesystem (statically linked by the wheel's
# toolchain), which the dynamic linker binds a binary's std::filesystem references to when libtorch comes first. Seen on
# an H100 machine (Ubuntu 24.04, GCC 13): that copy's remove_all(path, error_code&) jumped to address 0 on a non-empty
# directory tree (tests' TempDir after a checkpoint save). The implicit -lstdc++ of the compiler driver comes last.
if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  target_link_libraries(trestle_torch INTERFACE stdc++)
endif()
if(TRESTLE_TORCH_WHEEL_CUDA AND TRESTLE_HAVE_CUDA)
  set(TRESTLE_HAVE_TORCH_CUDA ON)
  # torch_library pulls in libtorch_cuda (its USE_C10D_NCCL definition with it), c10_cuda and the CUDA runtime; NCCL
  # itself is loaded by libtorch_cuda from the wheel's nvidia/nccl package.
  target_link_libraries(trestle_torch INTERFACE torch_library c10_cuda c10)
  target_compile_definitions(trestle_torch INTERFACE TRESTLE_HAVE_TORCH_CUDA USE_C10D_NCCL)
  # libtorch_cuda needs the wheel's own NCCL, cuDNN, cuBLAS... (site-packages/nvidia/*/lib, found through its RUNPATH
  # at run time); the linker must resolve them there too, not in an older system copy (e.g. the toolkit's libnccl).
  file(GLOB torch_nvidia_lib_dirs LIST_DIRECTORIES true "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib")
  foreach(dir ${torch_nvidia_lib_dirs})
    target_link_options(trestle_torch INTERFACE "LINKER:-rpath-link,${dir}")
  endforeach()
  # ProcessGroupNCCL::Options, which the trainer allocates, holds NCCL's ncclConfig_t by value: the nccl.h compiled
  # against must be the NCCL the wheel pins (torch 2.11's 2.28 against 2.30's larger struct shifted the fields after
  # it and corrupted the heap on a GPU machine). The header the compiler finds first: the wheel's, else the toolkit's.
  execute_process(
    COMMAND ${TRESTLE_PYTHON} -c "import importlib.metadata as m, torch
pins = [r.split(';')[0].split('==')[1].strip() for r in (m.requires('torch') or []) if r.startswith('nvidia-nccl') and '==' in r]
print(pins[0] if pins else '.'.join(map(str, torch.cuda.nccl.version())))"
    OUTPUT_VARIABLE torch_nccl OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE torch_nccl_rc ERROR_QUIET)
  set(nccl_header "")
  foreach(dir "${TORCH_INSTALL_PREFIX}/../nvidia/nccl/include" ${CUDAToolkit_INCLUDE_DIRS})
    if(NOT nccl_header AND EXISTS "${dir}/nccl.h")
      get_filename_component(nccl_header "${dir}/nccl.h" ABSOLUTE)
    endif()
  endforeach()
  if(torch_nccl_rc EQUAL 0 AND nccl_header)
    file(STRINGS "${nccl_header}" nccl_defines REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
    string(REGEX REPLACE ".*NCCL_MAJOR ([0-9]+).*NCCL_MINOR ([0-9]+).*NCCL_PATCH ([0-9]+).*" "\\1.\\2.\\3" header_nccl
                         "${nccl_defines}")
    string(REGEX MATCH "^[0-9]+\\.[0-9]+\\.[0-9]+" torch_nccl_version "${torch_nccl}")
    if(NOT header_nccl VERSION_EQUAL torch_nccl_version)
      message(FATAL_ERROR "NCCL: ${nccl_header} is NCCL ${header_nccl}, but LibTorch (${TRESTLE_PYTHON}) is built for "
                          "NCCL ${torch_nccl}: install nvidia-nccl-cu13==${torch_nccl} beside torch (its header must "
                          "match, ProcessGroupNCCL's options hold NCCL's config struct)")
    endif()
    message(STATUS "NCCL: header ${header_nccl} (${nccl_header}) matches LibTorch's")
  endif()
  if(NOT CUDAToolkit_VERSION VERSION_EQUAL TRESTLE_TORCH_WHEEL_CUDA)
    message(STATUS "LibTorch: the wheel is built for CUDA ${TRESTLE_TORCH_WHEEL_CUDA}, the toolkit here is "
                   "${CUDAToolkit_VERSION}; the wheel's own CUDA runtime libraries are used at run time")
  endif()
else()
  target_link_libraries(trestle_torch INTERFACE torch_cpu_library c10)
endif()
# torch_cpu_library's include directories lack the C++ API's (torch/csrc/api/include: torch/types.h, which c10d's
# headers include); TorchConfig's TORCH_INCLUDE_DIRS has both. Without it a build without CUDA fails in parallel/.
target_include_directories(trestle_torch SYSTEM INTERFACE ${TORCH_INCLUDE_DIRS})
# The libraries' directory goes into RUNPATH so binaries run without LD_LIBRARY_PATH.
target_link_options(trestle_torch INTERFACE "LINKER:-rpath,${TORCH_INSTALL_PREFIX}/lib")
if(TORCH_CXX_FLAGS)
  target_compile_options(trestle_torch INTERFACE $<$<COMPILE_LANGUAGE:CXX>:${TORCH_CXX_FLAGS}>)
endif()
message(STATUS "LibTorch: ${TRESTLE_TORCH_PREFIX_PATH} (wheel CUDA: ${TRESTLE_TORCH_WHEEL_CUDA}; "
               "Trestle::torch with CUDA: ${TRESTLE_HAVE_TORCH_CUDA})")
add_library(Trestle::torch ALIAS trestle_torch)
