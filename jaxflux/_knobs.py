"""The kernels' environment variables (measurement and diagnosis knobs), checked at trace time.

The C++ side reads each of these once per process and, for a value it does not know, falls back
to its default: a typo such as JAXFLUX_GEMM_RS_REDUCE=epilog would silently measure the default.
So every call that emits a jaxflux kernel first checks the variables that are set here, and a bad
value fails the trace with the variable's name, what it accepts and how to fix it. The values
accepted are the documented ones (docs/design.md, "Environment knobs"), a subset of what the
C++ parsers take. JAXFLUX_RANK_CACHE is read by jaxflux._runtime at import.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Knob:
  name: str
  accepts: str  # for the error message
  valid: Callable[[str], bool]


def _one_of(*values: str) -> Callable[[str], bool]:
  return lambda v: v in values


def _int_in(low: int, high: int | None) -> Callable[[str], bool]:
  def valid(v: str) -> bool:  # plain ASCII digits, as C's atoi reads them in full
    if not re.fullmatch(r"[0-9]+", v):
      return False
    n = int(v)
    return n >= low and (high is None or n <= high)
  return valid


def _comma_list_of(*values: str) -> Callable[[str], bool]:
  # The C++ looks for each word anywhere in the string; "none" (skip nothing) was used in runs.
  return lambda v: v == "none" or all(part.strip() in values for part in v.split(","))


_SWIZZLE = ("1, 2, 4 or 8", _one_of("1", "2", "4", "8"))

KNOBS = {k.name: k for k in (
    Knob("JAXFLUX_RANK_CACHE", "state or site", _one_of("state", "site")),
    Knob("JAXFLUX_AG_GEMM_LOCAL", "direct or copy", _one_of("direct", "copy")),
    Knob("JAXFLUX_AG_GEMM_CONFIG", "0, 1, 2 or 3 (jaxflux.ops.gemm.AG_GEMM_CONFIGS)",
         _int_in(0, 3)),
    Knob("JAXFLUX_GEMM_SWIZZLE", *_SWIZZLE),
    Knob("JAXFLUX_GEMM_RS_SWIZZLE", *_SWIZZLE),
    Knob("JAXFLUX_GEMM_PLAIN_SWIZZLE", *_SWIZZLE),
    Knob("JAXFLUX_GEMM_RS_SCHEDULE", "cooperative or pingpong",
         _one_of("cooperative", "pingpong")),
    Knob("JAXFLUX_GEMM_SMS", "a positive number of SMs", _int_in(1, None)),
    Knob("JAXFLUX_GEMM_RS_PUSH", "split or copy", _one_of("split", "copy")),
    Knob("JAXFLUX_GEMM_RS_REDUCE", "pass or epilogue", _one_of("pass", "epilogue")),
    Knob("JAXFLUX_AG_MAX_CHUNKS", "1, 2, 3 or 4", _int_in(1, 4)),
    Knob("JAXFLUX_AG_ABLATE", "a comma-separated list of push, local, recv",
         _comma_list_of("push", "local", "recv")),
)}


def check_environment(op: str, environ=None) -> None:
  """Raises ValueError, naming `op`, for the first of KNOBS set to a value it does not accept.
  Unset or empty variables take their defaults."""
  environ = os.environ if environ is None else environ
  for knob in KNOBS.values():
    value = environ.get(knob.name, "")
    if value and not knob.valid(value):  # unstripped: the C++ compares the raw string
      raise ValueError(
          f"{op}: environment variable {knob.name}={value!r} is not valid; it takes "
          f"{knob.accepts}. These variables are measurement knobs (docs/design.md, "
          f"'Environment knobs'): unset {knob.name} to get the measured default.")
