# CUDA part of jaxflux: runtime (symmetric workspace, signals), kernels and FFI handlers, built
# into one static library that the nanobind module links. nvcc never sees nanobind.
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

# CUTLASS/CuTe headers come from the pinned nvidia-cutlass wheel (a build requirement). Locate
# them without importing the package (its __init__ pulls in cuda-python).
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import importlib.util, os; s = importlib.util.find_spec('cutlass_library'); print(os.path.join(list(s.submodule_search_locations)[0], 'source', 'include') if s else '')"
  OUTPUT_STRIP_TRAILING_WHITESPACE OUTPUT_VARIABLE CUTLASS_INCLUDE_DIR)
if(NOT EXISTS "${CUTLASS_INCLUDE_DIR}/cutlass/cutlass.h")
  message(FATAL_ERROR "jaxflux: CUTLASS headers not found. Install the pinned wheel: "
                      "pip install nvidia-cutlass==4.2.0.0")
endif()

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
