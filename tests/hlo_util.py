"""Counting collectives and custom calls in compiled (optimized) HLO text.

A test helper: the tests check with it that compiled programs run their tensor-parallel matmuls
through the expected collectives or through the fused kernels' custom calls.
"""
from __future__ import annotations

import collections
import re

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def count_collectives(hlo: str, ops=COLLECTIVES) -> dict:
  """Instruction counts per op name, zeros left out.

  Counts instructions (` = type op(`), including the async `-start` forms but not their `-done`
  halves, so an async collective counts once.
  """
  counts = {name: len(re.findall(rf"\s{re.escape(name)}(?:-start)?\(", hlo)) for name in ops}
  return {k: v for k, v in counts.items() if v}


def custom_call_targets(hlo: str) -> dict:
  """Custom-call instruction counts per `custom_call_target` name."""
  return dict(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo)))
