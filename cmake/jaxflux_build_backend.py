"""jaxflux's build backend: scikit-build-core's, with two changes for the installs a user repeats.

1. The CUDA kernels' own build requirements are asked for only when the kernels will be built
   (cuda_choice.py decides). They are jaxlib (the XLA FFI headers) and the pinned CUTLASS wheel,
   which bring scipy, cuda-python and more: about 700 MB that pip installs into a new temporary
   build environment on every install. A build without the kernels needs neither.
2. The build folder (build/<wheel tag>) survives a reinstall. scikit-build-core clears CMake's
   cache and CMakeFiles/, every object file with it, whenever it runs from another environment
   than last time, because the cache could point into the old one; and pip's isolated
   environments are new on every install. This build's cache points into none (CMakeLists.txt
   finds nanobind and the headers anew on every configure and compiles copies of them:
   cmake/stage.cmake), so for the same source and scikit-build-core version this backend records
   the current environment as the one that configured the folder, and Ninja rebuilds only what
   changed, also after an interrupted build.

pyproject.toml names this module (build-backend, with backend-path = ["cmake"]).
"""
from __future__ import annotations

import json
import os
import pathlib

import scikit_build_core
from scikit_build_core import build as _scikit_build
from scikit_build_core.build import *  # noqa: F403 - every hook not redefined below

import cuda_choice

CUDA_BUILD_REQUIRES = ["jaxlib>=0.10.2", "nvidia-cutlass==4.2.0.0"]

# Where a JAXFLUX_CUDA value can come from besides the environment variable:
# `pip install -C cmake.define.JAXFLUX_CUDA=ON` (scikit-build-core's config settings).
_SETTING_KEYS = ("cmake.define.JAXFLUX_CUDA", "skbuild.cmake.define.JAXFLUX_CUDA")


def _cuda_requires(config_settings: dict | None) -> list[str]:
  settings = config_settings or {}
  value = next((settings[k] for k in _SETTING_KEYS if k in settings),
               os.environ.get("JAXFLUX_CUDA"))
  try:
    build, _ = cuda_choice.choice(value if isinstance(value, str) else None)
  except ValueError:
    return []  # CMake's configure step stops with the same message
  return list(CUDA_BUILD_REQUIRES) if build else []


def get_requires_for_build_wheel(config_settings: dict | None = None) -> list[str]:
  return [*_scikit_build.get_requires_for_build_wheel(config_settings),
          *_cuda_requires(config_settings)]


def get_requires_for_build_editable(config_settings: dict | None = None) -> list[str]:
  return [*_scikit_build.get_requires_for_build_editable(config_settings),
          *_cuda_requires(config_settings)]


# scikit-build-core's record of the environment that configured a build folder, and the folders
# (pyproject.toml: build-dir = "build/{wheel_tag}").
_BUILD_INFO = "build/*/.skbuild-info.json"


def _adopt_build_folders() -> None:
  """Records this scikit-build-core as the one that configured this checkout's build folders
  (point 2 above), so that it keeps their CMake cache and objects."""
  here = str(pathlib.Path(scikit_build_core.__file__).parent.resolve())
  source = str(pathlib.Path.cwd().resolve())
  for info_path in pathlib.Path.cwd().glob(_BUILD_INFO):
    try:
      info = json.loads(info_path.read_text())
    except (OSError, ValueError):
      continue  # scikit-build-core clears an unreadable record itself
    before = info.get("skbuild_path") if isinstance(info, dict) else None
    if (not isinstance(before, str) or before == here or info.get("source_dir") != source
        or info.get("skbuild_version") != scikit_build_core.__version__):
      continue
    info["skbuild_path"] = here
    info_path.write_text(json.dumps(info, indent=2))


def build_wheel(wheel_directory: str, config_settings: dict | None = None,
                metadata_directory: str | None = None) -> str:
  _adopt_build_folders()
  return _scikit_build.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory: str, config_settings: dict | None = None,
                   metadata_directory: str | None = None) -> str:
  _adopt_build_folders()
  return _scikit_build.build_editable(wheel_directory, config_settings, metadata_directory)
