# CUDA part of jaxflux: runtime (symmetric workspace, signals), kernels and FFI handlers, built
# into one static library that the nanobind module links. nvcc never sees nanobind.
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

# Its build requirements (cmake/jaxflux_build_backend.py asks pip for them when the kernels are
# built): the XLA FFI headers, which ship inside jaxlib (jax.ffi.include_dir() points at the same
# folder), and the CUTLASS/CuTe headers of the pinned nvidia-cutlass wheel, located without
# importing the package (its __init__ pulls in cuda-python). Both are copied into the build folder
# like nanobind (cmake/stage.cmake).
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import os, jaxlib; print(os.path.join(os.path.dirname(jaxlib.__file__), 'include'))"
  OUTPUT_STRIP_TRAILING_WHITESPACE OUTPUT_VARIABLE _jaxlib_include ERROR_QUIET)
if(NOT EXISTS "${_jaxlib_include}/xla/ffi/api/ffi.h")
  message(FATAL_ERROR "jaxflux: XLA FFI headers not found (looked in '${_jaxlib_include}'). "
                      "Install jaxlib>=0.10.2 in the build environment.")
endif()
set(XLA_FFI_INCLUDE_DIR "${CMAKE_BINARY_DIR}/deps/jaxlib/include")
jaxflux_stage("${_jaxlib_include}" "${XLA_FFI_INCLUDE_DIR}")

execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import importlib.util, os; s = importlib.util.find_spec('cutlass_library'); print(os.path.join(list(s.submodule_search_locations)[0], 'source') if s else '')"
  OUTPUT_STRIP_TRAILING_WHITESPACE OUTPUT_VARIABLE _cutlass_source)
if(NOT EXISTS "${_cutlass_source}/include/cutlass/cutlass.h")
  message(FATAL_ERROR "jaxflux: CUTLASS headers not found. Install the pinned wheel: "
                      "pip install nvidia-cutlass==4.2.0.0")
endif()
set(CUTLASS_INCLUDE_DIR "${CMAKE_BINARY_DIR}/deps/cutlass/include")
jaxflux_stage("${_cutlass_source}/include" "${CUTLASS_INCLUDE_DIR}")
jaxflux_stage("${_cutlass_source}/tools/util/include"
              "${CMAKE_BINARY_DIR}/deps/cutlass/tools/util/include")

# Hopper only for now: sm_90a enables wgmma/TMA. Written as an explicit -gencode (SASS only) so no
# PTX for a generic target is embedded.
set(CMAKE_CUDA_ARCHITECTURES OFF)
set(JAXFLUX_CUDA_FLAGS -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DNDEBUG)

file(GLOB JAXFLUX_CUDA_SOURCES CONFIGURE_DEPENDS
     "${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/runtime/*.cu"
     "${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/runtime/*.cc"
     "${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/kernels/*.cu"
     "${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/kernels/instantiations/*.cu"
     "${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/ffi/*.cu"
     "${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/ffi/*.cc")
add_library(jaxflux_cuda STATIC ${JAXFLUX_CUDA_SOURCES})
set_target_properties(jaxflux_cuda PROPERTIES POSITION_INDEPENDENT_CODE ON
                                              CUDA_SEPARABLE_COMPILATION OFF)
# tools/util/include holds cutlass/util/packed_stride.hpp (stride helpers of the CUTLASS 3 API).
target_include_directories(jaxflux_cuda PUBLIC "${CMAKE_CURRENT_SOURCE_DIR}"
                                               "${XLA_FFI_INCLUDE_DIR}" "${CUTLASS_INCLUDE_DIR}"
                                               "${CUTLASS_INCLUDE_DIR}/../tools/util/include")
target_compile_options(jaxflux_cuda PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${JAXFLUX_CUDA_FLAGS}>)
# Static cudart: the module imports on machines without a CUDA runtime installed; the driver
# (libcuda) is only needed once a GPU path runs.
target_link_libraries(jaxflux_cuda PUBLIC CUDA::cudart_static)
