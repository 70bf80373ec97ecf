"""GEMM+ReduceScatter's push plan (xla_ffi/ffi/push_plan.h), compiled into a small C++ program
with the host compiler: the plan must cover the owner's rows in at most 4 ascending chunks of
equal rows cut at 128-row tiles. Skipped without a C++ compiler."""
import json
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

# Owner rows m: the GEMM+RS benchmark shapes' at tp=2 (M/2), and odd ones.
ROWS = [M // 2 for M in (1024, 2048, 4096, 8192, 16384)] + [1, 8, 127, 128, 129, 200, 513, 1000]

PROGRAM = r"""
#include <cstdio>
#include "xla_ffi/ffi/push_plan.h"
int main() {
  size_t m;
  std::printf("[");
  for (int first = 1; std::scanf("%zu", &m) == 1; first = 0) {
    const jaxflux::PushChunks plan = jaxflux::PlanEvenChunks(m);
    std::printf("%s[", first ? "" : ",");
    for (int c = 0; c < plan.count; ++c) std::printf("%s%zu", c ? "," : "", plan.ends[c]);
    std::printf("]");
  }
  std::printf("]\n");
}
"""


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
  if CXX is None:
    pytest.skip("no C++ compiler on PATH")
  work = tmp_path_factory.mktemp("push_plan")
  (work / "plan.cc").write_text(PROGRAM)
  subprocess.run([CXX, "-std=c++17", "-O1", f"-I{ROOT}", "plan.cc", "-o", "plan"], cwd=work,
                 check=True, capture_output=True)
  out = subprocess.run([str(work / "plan")], input="".join(f"{m}\n" for m in ROWS),
                       capture_output=True, text=True, check=True).stdout
  return dict(zip(ROWS, json.loads(out)))


def test_plans_cover_the_rows_in_at_most_4_tile_aligned_ascending_chunks(plans):
  for m, ends in plans.items():
    assert 1 <= len(ends) <= 4, (m, ends)
    assert ends[-1] == m and ends == sorted(set(ends)), (m, ends)
    assert all(e % 128 == 0 for e in ends[:-1]), (m, ends)


def test_plans_cut_equal_chunks(plans):
  for m, ends in plans.items():
    rows = ends[0]
    assert ends == [min((c + 1) * rows, m) for c in range(len(ends))], (m, ends)
  assert plans[4096] == [1024, 2048, 3072, 4096]  # llama70b-out M=8192: quarters
  assert plans[1000] == [256, 512, 768, 1000]
  assert plans[129] == [128, 129] and plans[127] == [127]  # tiles of 128 rows, the last short
