# Sets JAXFLUX_WITH_CUDA from JAXFLUX_CUDA and prints one line saying what was decided and why.
# The rule (OFF never, ON always, AUTO only with nvcc and a Hopper GPU) lives in cuda_choice.py,
# which the build backend also follows to ask for the kernels' build requirements; CMake adds its
# compiler check. Needs Python_EXECUTABLE.

execute_process(
  COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_LIST_DIR}/cuda_choice.py" "${JAXFLUX_CUDA}"
  RESULT_VARIABLE _rc OUTPUT_VARIABLE _choice ERROR_VARIABLE _error
  OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_STRIP_TRAILING_WHITESPACE)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "${_error}")
endif()

set(JAXFLUX_WITH_CUDA OFF)
if(_choice STREQUAL "ON")
  string(TOUPPER "${JAXFLUX_CUDA}" _value)
  if(_value STREQUAL "")
    set(_value "AUTO")
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(JAXFLUX_WITH_CUDA ON)
    message(STATUS "jaxflux: building the CUDA kernels (JAXFLUX_CUDA=${_value}, "
                   "${CMAKE_CUDA_COMPILER}): a full compile takes about 20 minutes on 2 cores; "
                   "`pip install -v` shows each file as it compiles")
  elseif(_value STREQUAL "ON")
    message(FATAL_ERROR
      "jaxflux: JAXFLUX_CUDA=ON but no CUDA compiler was found. Install the CUDA toolkit (12.8 "
      "or newer, with nvcc on PATH or CUDACXX set), or build the pure-JAX package with "
      "JAXFLUX_CUDA=OFF.")
  else()
    message(STATUS "jaxflux: not building the CUDA kernels (JAXFLUX_CUDA=AUTO): CMake's CUDA "
                   "compiler check failed (CMakeFiles/CMakeConfigureLog.yaml says why)")
  endif()
else()
  string(REGEX REPLACE "^OFF " "jaxflux: " _line "${_choice}")
  message(STATUS "${_line}")
endif()
