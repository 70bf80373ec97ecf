# Copies build requirements' files into the build folder so that compile commands name stable paths.
#
# pip builds in an isolated environment under a new temporary path on every install. Compiling
# against headers and sources there puts that path into every compile command (nanobind's own
# sources, the XLA FFI and CUTLASS include directories), so Ninja would rebuild everything on each
# reinstall, CUDA kernels included. The copy rewrites a file only when its content changed, so an
# unchanged requirement leaves every object up to date and a changed header rebuilds what uses it.

# Mirrors the files under <src> into <dst>: a file is copied when missing or different, files no
# longer in <src> are removed; __pycache__ is skipped.
function(jaxflux_stage src dst)
  if(NOT IS_DIRECTORY "${src}")
    message(FATAL_ERROR "jaxflux: cannot copy '${src}' into the build folder: not a directory")
  endif()
  file(GLOB_RECURSE _want RELATIVE "${src}" "${src}/*")
  list(FILTER _want EXCLUDE REGEX "(^|/)__pycache__/")
  set(_have "")
  if(IS_DIRECTORY "${dst}")
    file(GLOB_RECURSE _have RELATIVE "${dst}" "${dst}/*")
  endif()
  set(_stale ${_have})
  if(_want)
    list(REMOVE_ITEM _stale ${_want})
  endif()
  foreach(_f IN LISTS _stale)
    file(REMOVE "${dst}/${_f}")
  endforeach()
  foreach(_f IN LISTS _want)
    get_filename_component(_d "${dst}/${_f}" DIRECTORY)
    file(MAKE_DIRECTORY "${_d}")
    file(COPY_FILE "${src}/${_f}" "${dst}/${_f}" ONLY_IF_DIFFERENT)
  endforeach()
endfunction()
