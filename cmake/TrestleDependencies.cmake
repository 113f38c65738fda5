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

# LibTorch comes from the torch wheel in the project's venv. Only its CPU libraries are linked here, so a
# CPU-only build needs no CUDA toolkit; targets that include <torch/...> link Trestle::torch.
if(NOT TRESTLE_PYTHON)
  find_program(TRESTLE_PYTHON_FOUND NAMES python3 python)
  set(TRESTLE_PYTHON ${TRESTLE_PYTHON_FOUND} CACHE FILEPATH "" FORCE)
endif()
execute_process(
  COMMAND ${TRESTLE_PYTHON} -c "import os, torch; print(os.path.dirname(torch.__file__))"
  OUTPUT_VARIABLE TRESTLE_TORCH_DIR OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE torch_rc)
if(NOT torch_rc EQUAL 0 OR NOT EXISTS "${TRESTLE_TORCH_DIR}/lib/libtorch_cpu.so")
  message(FATAL_ERROR "LibTorch not found through ${TRESTLE_PYTHON}: run scripts/setup, or pass "
                      "-DTRESTLE_PYTHON=<venv>/bin/python of an environment with torch installed")
endif()
message(STATUS "LibTorch: ${TRESTLE_TORCH_DIR}")
add_library(trestle_torch INTERFACE)
target_include_directories(trestle_torch SYSTEM INTERFACE
  ${TRESTLE_TORCH_DIR}/include ${TRESTLE_TORCH_DIR}/include/torch/csrc/api/include)
target_link_libraries(trestle_torch INTERFACE
  ${TRESTLE_TORCH_DIR}/lib/libtorch_cpu.so ${TRESTLE_TORCH_DIR}/lib/libc10.so)
target_link_options(trestle_torch INTERFACE "LINKER:-rpath,${TRESTLE_TORCH_DIR}/lib")
add_library(Trestle::torch ALIAS trestle_torch)
