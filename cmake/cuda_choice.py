"""Whether to build the CUDA kernels, from JAXFLUX_CUDA and this machine. One rule for the two
places that need it: the build backend (cmake/jaxflux_build_backend.py), which asks pip for the
kernels' own build requirements only when they will be built, and CMake
(cmake/cuda_choice.cmake), which builds them.

  OFF   never.
  ON    always, also without a GPU (a build machine); CMake fails when no CUDA compiler is found.
  AUTO  (the default) only where the kernels can run: a CUDA compiler is found (CUDACXX, or nvcc
        on PATH) and nvidia-smi lists a GPU of compute capability 9.0 (Hopper: the kernels' one
        target is sm_90a). Compiling them is most of the install, wasted on a machine that
        cannot run them, which gets the pure-JAX build instead.

As a script, `python cuda_choice.py VALUE` prints "ON", or "OFF" and the line CMake shows, or fails
naming the accepted values.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

TARGET_COMPUTE_CAPABILITY = "9.0"  # cmake/cuda.cmake compiles for sm_90a only
VALUES = ("AUTO", "ON", "OFF")


def gpu_reason() -> str | None:
  """None when nvidia-smi lists a GPU of TARGET_COMPUTE_CAPABILITY, else why not. Asks the driver
  only (a fraction of a second), so the common case, no GPU, costs no compiler check."""
  smi = shutil.which("nvidia-smi")
  if smi is None:
    return "no NVIDIA driver found (nvidia-smi is not on PATH)"
  try:
    out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=60, check=False)
  except (OSError, subprocess.TimeoutExpired) as e:
    return f"nvidia-smi failed ({e})"
  caps = re.findall(r"\d+\.\d+", out.stdout) if out.returncode == 0 else []
  if not caps:
    return "nvidia-smi lists no GPU"
  if TARGET_COMPUTE_CAPABILITY not in caps:
    return f"this machine's GPUs have compute capability {', '.join(dict.fromkeys(caps))}"
  return None


def compiler_reason() -> str | None:
  """None when a CUDA compiler is named (CUDACXX) or nvcc is on PATH, else why not. CMake checks
  that it works; this only keeps a machine without one from asking for the CUDA requirements."""
  if os.environ.get("CUDACXX") or shutil.which("nvcc"):
    return None
  return "nvcc not found (not on PATH, and CUDACXX is not set)"


def normalize(value: str | None) -> str:
  """JAXFLUX_CUDA's value, upper-cased; unset or empty means AUTO."""
  normal = (value or "").strip().upper() or "AUTO"
  if normal not in VALUES:
    raise ValueError(f"JAXFLUX_CUDA={value!r} is not one of AUTO, ON, OFF. Set JAXFLUX_CUDA=AUTO "
                     "(the default), ON or OFF.")
  return normal


def choice(value: str | None) -> tuple[bool, str]:
  """(build the kernels?, why) for JAXFLUX_CUDA=`value`. ON says yes without looking: whether a
  compiler exists is CMake's question, and its error says what to install."""
  value = normalize(value)
  if value != "AUTO":
    return value == "ON", f"JAXFLUX_CUDA={value}"
  reason = gpu_reason() or compiler_reason()
  if reason is not None:
    return False, reason
  return True, f"a GPU of compute capability {TARGET_COMPUTE_CAPABILITY} and a CUDA compiler"


def skip_message(why: str) -> str:
  """The one line a build without the kernels prints: why, and how to get them."""
  if why == "JAXFLUX_CUDA=OFF":
    return "not building the CUDA kernels (JAXFLUX_CUDA=OFF): pure-JAX path only"
  return (f"not building the CUDA kernels (JAXFLUX_CUDA=AUTO): {why}; they run on GPUs of "
          f"compute capability {TARGET_COMPUTE_CAPABILITY} (Hopper). Set JAXFLUX_CUDA=ON to "
          "build them anyway (e.g. on a build machine)")


def main(argv: list[str]) -> int:
  try:
    build, why = choice(argv[1] if len(argv) > 1 else None)
  except ValueError as e:
    print(f"jaxflux: {e}", file=sys.stderr)
    return 2
  print("ON" if build else f"OFF {skip_message(why)}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
