"""The build's choice of the CUDA kernels: by default (JAXFLUX_CUDA=AUTO) a machine without a
Hopper GPU gets the pure-JAX build and one line saying why and how to force the kernels; ON forces
them, OFF never builds them; and the build backend asks for the kernels' heavy build requirements
(jaxlib, CUTLASS) exactly when it builds them. Compiling the kernels takes about 20 minutes on 2
cores, so building them where they cannot run is the expensive mistake this guards against.

Runs CMake's configure step only, on a small project that includes cmake/cuda_choice.cmake (the
file CMakeLists.txt decides with), so it needs cmake but neither the build requirements nor a
kernel compile. nvidia-smi is replaced by a script on PATH that answers as a machine without a
driver, or with GPUs of given compute capabilities, would."""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CMAKE = shutil.which("cmake")
NVCC = shutil.which("nvcc")

needs_cmake = pytest.mark.skipif(CMAKE is None, reason="cmake is not on PATH")

CMAKE_DIR = ROOT / "cmake"
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", 9)


def _machine_env(tmp_path: pathlib.Path, nvidia_smi: tuple[str, int] | None,
                 **env: str) -> dict[str, str]:
  """This process's environment with a fake nvidia-smi first on PATH that prints
  `nvidia_smi[0]` and exits with `nvidia_smi[1]` (None: no fake), CUDACXX and JAXFLUX_CUDA
  unset (CI exports JAXFLUX_CUDA), then `env`."""
  path = os.environ.get("PATH", "")
  if nvidia_smi is not None:
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir(exist_ok=True)
    text, status = nvidia_smi
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' '{text}'\nexit {status}\n")
    fake.chmod(0o755)
    path = f"{fake.parent}{os.pathsep}{path}"
  run_env = {k: v for k, v in os.environ.items() if k not in ("CUDACXX", "JAXFLUX_CUDA")}
  run_env.update(PATH=path, **env)
  return run_env


def _configure(tmp_path: pathlib.Path, value: str, nvidia_smi: tuple[str, int] | None,
               **env: str) -> subprocess.CompletedProcess:
  """Configures the probe project with JAXFLUX_CUDA=`value` on the machine `_machine_env`
  describes."""
  project = tmp_path / "project"
  project.mkdir(exist_ok=True)
  (project / "CMakeLists.txt").write_text(
      "cmake_minimum_required(VERSION 3.26)\n"
      "project(cuda_choice_probe LANGUAGES NONE)\n"
      f'include("{(CMAKE_DIR / "cuda_choice.cmake").as_posix()}")\n'
      'message(STATUS "probe: JAXFLUX_WITH_CUDA=${JAXFLUX_WITH_CUDA}")\n')
  return subprocess.run(
      [CMAKE, "-S", str(project), "-B", str(tmp_path / "build"), f"-DJAXFLUX_CUDA={value}",
       f"-DPython_EXECUTABLE={sys.executable}"],
      capture_output=True, text=True, env=_machine_env(tmp_path, nvidia_smi, **env), timeout=180,
      check=False)


def _with_cuda(proc: subprocess.CompletedProcess) -> bool:
  assert proc.returncode == 0, proc.stdout + proc.stderr
  found = re.findall(r"probe: JAXFLUX_WITH_CUDA=(\w+)", proc.stdout)
  assert len(found) == 1, proc.stdout
  return found[0] == "ON"


def _jaxflux_lines(proc: subprocess.CompletedProcess) -> list[str]:
  return [line for line in proc.stdout.splitlines() if "jaxflux:" in line]


@needs_cmake
@pytest.mark.parametrize("nvidia_smi, reason", [
    (NO_DRIVER, "nvidia-smi lists no GPU"),
    (("8.0\n8.6\n8.0", 0), "compute capability 8.0, 8.6"),
    (("No devices were found", 6), "nvidia-smi lists no GPU"),
])
def test_auto_without_a_hopper_gpu_skips_the_kernels_in_one_line(tmp_path, nvidia_smi, reason):
  proc = _configure(tmp_path, "AUTO", nvidia_smi)
  assert not _with_cuda(proc)
  lines = _jaxflux_lines(proc)
  assert len(lines) == 1, proc.stdout
  assert "not building the CUDA kernels (JAXFLUX_CUDA=AUTO)" in lines[0]
  assert reason in lines[0] and "Set JAXFLUX_CUDA=ON to build them anyway" in lines[0]
  # The GPU check comes first, so no CUDA compiler was probed (that costs a test compile).
  assert "CMAKE_CUDA_COMPILER" not in (tmp_path / "build" / "CMakeCache.txt").read_text()


@needs_cmake
@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_auto_without_nvidia_smi_skips_the_kernels(tmp_path):
  proc = _configure(tmp_path, "AUTO", None)
  assert not _with_cuda(proc)
  assert "nvidia-smi is not on PATH" in _jaxflux_lines(proc)[0]


@needs_cmake
def test_off_never_builds_the_kernels(tmp_path):
  proc = _configure(tmp_path, "OFF", ("9.0", 0))
  assert not _with_cuda(proc)
  assert _jaxflux_lines(proc) == [
      "-- jaxflux: not building the CUDA kernels (JAXFLUX_CUDA=OFF): pure-JAX path only"]


@pytest.mark.slow
@needs_cmake
@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_on_builds_the_kernels_without_a_gpu_and_auto_with_one(tmp_path):
  # One build folder, reconfigured the way a user changing JAXFLUX_CUDA would: CMake's CUDA
  # compiler check (a test compile, the slow part) runs once and is cached.
  proc = _configure(tmp_path, "ON", NO_DRIVER)
  assert _with_cuda(proc)
  lines = _jaxflux_lines(proc)
  assert len(lines) == 1 and "building the CUDA kernels (JAXFLUX_CUDA=ON" in lines[0], lines
  proc = _configure(tmp_path, "AUTO", ("8.0\n9.0", 0))
  assert _with_cuda(proc)
  assert "building the CUDA kernels (JAXFLUX_CUDA=AUTO" in _jaxflux_lines(proc)[0]
  proc = _configure(tmp_path, "AUTO", NO_DRIVER)
  assert not _with_cuda(proc)
  assert "nvidia-smi lists no GPU" in _jaxflux_lines(proc)[0]


@needs_cmake
def test_on_without_a_cuda_compiler_fails_naming_the_fix(tmp_path):
  proc = _configure(tmp_path, "ON", ("9.0", 0), CUDACXX=str(tmp_path / "no-such-nvcc"))
  assert proc.returncode != 0
  assert "JAXFLUX_CUDA=ON but no CUDA compiler was found" in proc.stderr
  assert "JAXFLUX_CUDA=OFF" in proc.stderr


@needs_cmake
def test_an_unknown_value_fails_naming_the_choices(tmp_path):
  proc = _configure(tmp_path, "maybe", NO_DRIVER)
  assert proc.returncode != 0
  assert "JAXFLUX_CUDA='maybe' is not one of AUTO, ON, OFF" in proc.stderr


def test_the_build_decides_with_this_file_before_adding_cuda():
  text = (ROOT / "CMakeLists.txt").read_text()
  assert text.index("include(cmake/cuda_choice.cmake)") < text.index(
      "if(JAXFLUX_WITH_CUDA)\n  include(cmake/cuda.cmake)")
  assert "enable_language(CUDA)" not in text and "check_language" not in text


@pytest.fixture
def backend(monkeypatch, tmp_path):
  """cmake/jaxflux_build_backend.py over a stand-in for scikit-build-core (not installed where the
  tests run): its requirement hooks answer ["scikit-build-core-extra"], its build hooks return
  "stub.whl", and it lives in tmp_path/isolated-env-2, version 1.1.2."""
  stub = types.ModuleType("scikit_build_core.build")
  stub.__all__ = ["get_requires_for_build_wheel", "get_requires_for_build_editable", "build_wheel",
                  "build_editable", "build_sdist"]
  stub.get_requires_for_build_wheel = lambda config_settings=None: ["scikit-build-core-extra"]
  stub.get_requires_for_build_editable = stub.get_requires_for_build_wheel
  stub.build_wheel = stub.build_editable = lambda *a, **k: "stub.whl"
  stub.build_sdist = lambda *a, **k: "stub.tar.gz"
  package = types.ModuleType("scikit_build_core")
  package.__file__ = str(tmp_path / "isolated-env-2" / "scikit_build_core" / "__init__.py")
  package.__version__ = "1.1.2"
  package.build = stub
  monkeypatch.setitem(sys.modules, "scikit_build_core", package)
  monkeypatch.setitem(sys.modules, "scikit_build_core.build", stub)
  monkeypatch.syspath_prepend(str(CMAKE_DIR))
  monkeypatch.setattr(sys, "dont_write_bytecode", True)  # no __pycache__ in the source tree
  for name in ("jaxflux_build_backend", "cuda_choice"):
    monkeypatch.delitem(sys.modules, name, raising=False)
  import jaxflux_build_backend  # noqa: PLC0415 - imported over the stand-in above
  return jaxflux_build_backend


CUDA_REQUIRES = ["jaxlib>=0.10.2", "nvidia-cutlass==4.2.0.0"]


def _use_machine(monkeypatch, tmp_path: pathlib.Path, nvidia_smi: tuple[str, int] | None,
                 **env: str) -> None:
  """Makes this process's environment the one `_machine_env` describes (for the backend, which
  runs in the installing process)."""
  want = _machine_env(tmp_path, nvidia_smi, **env)
  for name in ("PATH", "CUDACXX", "JAXFLUX_CUDA"):
    if name in want:
      monkeypatch.setenv(name, want[name])
    else:
      monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("value, nvidia_smi, want_cuda", [
    (None, NO_DRIVER, False),           # the default, AUTO, on this kind of machine
    ("AUTO", ("8.0", 0), False),
    ("AUTO", ("9.0", 0), True),
    ("on", NO_DRIVER, True),
    ("OFF", ("9.0", 0), False),
])
def test_the_backend_asks_for_cuda_requirements_only_for_a_cuda_build(
    backend, tmp_path, monkeypatch, value, nvidia_smi, want_cuda):
  value_env = {} if value is None else {"JAXFLUX_CUDA": value}
  _use_machine(monkeypatch, tmp_path, nvidia_smi, CUDACXX="/opt/cuda/bin/nvcc", **value_env)
  for hook in (backend.get_requires_for_build_editable, backend.get_requires_for_build_wheel):
    want = ["scikit-build-core-extra", *(CUDA_REQUIRES if want_cuda else [])]
    assert hook(None) == want
  assert backend.build_sdist("dist") == "stub.tar.gz"  # the other hooks are scikit-build-core's


def test_the_backend_reads_jaxflux_cuda_from_config_settings(backend, tmp_path, monkeypatch):
  _use_machine(monkeypatch, tmp_path, NO_DRIVER, JAXFLUX_CUDA="OFF")
  settings = {"cmake.define.JAXFLUX_CUDA": "ON"}
  assert backend.get_requires_for_build_editable(settings)[1:] == CUDA_REQUIRES


def test_auto_without_nvcc_asks_for_no_cuda_requirements(backend, tmp_path, monkeypatch):
  _use_machine(monkeypatch, tmp_path, ("9.0", 0), JAXFLUX_CUDA="AUTO")
  monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # the fake nvidia-smi only: no nvcc
  assert backend.get_requires_for_build_wheel(None) == ["scikit-build-core-extra"]


@pytest.mark.parametrize("recorded, adopted", [
    ({}, True),                                # the previous install's isolated environment
    ({"source_dir": "/elsewhere"}, False),     # another checkout's build folder
    ({"skbuild_version": "1.0.0"}, False),     # another scikit-build-core: let it start over
])
def test_a_reinstall_keeps_the_build_folder(backend, tmp_path, monkeypatch, recorded, adopted):
  # scikit-build-core clears CMake's cache and every object file when the environment recorded
  # here is not the one it runs from; pip's isolated environment is new on every install.
  source = tmp_path / "checkout"
  record = source / "build" / "cp311-cp311-linux_x86_64" / ".skbuild-info.json"
  record.parent.mkdir(parents=True)
  before = str(tmp_path / "isolated-env-1" / "scikit_build_core")
  info = {"source_dir": str(source.resolve()), "skbuild_path": before,
          "skbuild_version": "1.1.2", "python_executable": "/venv/bin/python3", **recorded}
  record.write_text(json.dumps(info))
  monkeypatch.chdir(source)
  for hook in (backend.build_editable, backend.build_wheel):
    assert hook(str(tmp_path / "wheels")) == "stub.whl"
    after = json.loads(record.read_text())
    here = str((tmp_path / "isolated-env-2" / "scikit_build_core").resolve())
    assert after == ({**info, "skbuild_path": here} if adopted else info)
