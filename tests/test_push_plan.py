"""GEMM+ReduceScatter's push plans (xla_ffi/ffi/push_plan.h), compiled into a small C++ program
with the host compiler: the plans must cover the owner's rows in at most 4 ascending chunks cut
at 128-row tiles, the even plan must cut equal chunks, and the wave plan must give the cuts its
model implies for the benchmark shapes on an H200 (132 SMs). Skipped without a C++ compiler."""
import json
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

# (name, owner rows m, output columns n, local K): the GEMM+RS benchmark shapes at tp=2.
SHAPES = [(f"{name} M={M}", M // 2, n, k // 2)
          for name, k, n in (("llama70b-out", 8192, 8192), ("llama70b-fc2", 28672, 8192),
                             ("gpt3-out", 12288, 12288), ("gpt3-fc2", 49152, 12288))
          for M in (1024, 2048, 4096, 8192, 16384)]
ODD = [("odd", m, n, k) for m, n, k in ((1, 64, 64), (200, 512, 256), (128, 136, 264),
                                          (8, 2048, 4096), (1000, 4096, 512), (129, 8192, 4096))]

PROGRAM = r"""
#include <cstdio>
#include "xla_ffi/ffi/push_plan.h"
int main() {
  size_t m, n, k;
  std::printf("[");
  for (int first = 1; std::scanf("%zu %zu %zu", &m, &n, &k) == 3; first = 0) {
    const jaxflux::PushChunks plans[2] = {jaxflux::PlanEvenChunks(m),
                                          jaxflux::PlanWaveChunks(m, n, k, 2, 132)};
    std::printf("%s[", first ? "" : ",");
    for (int p = 0; p < 2; ++p) {
      std::printf("%s{\"ends\": [", p ? "," : "");
      for (int c = 0; c < plans[p].count; ++c) std::printf("%s%zu", c ? "," : "", plans[p].ends[c]);
      std::printf("]}");
    }
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
  cases = SHAPES + ODD
  stdin = "".join(f"{m} {n} {k}\n" for _, m, n, k in cases)
  out = subprocess.run([str(work / "plan")], input=stdin, capture_output=True, text=True,
                       check=True).stdout
  return {case: result for case, result in zip(cases, json.loads(out))}


def test_every_plan_covers_the_rows_in_at_most_4_tile_aligned_ascending_chunks(plans):
  for (label, m, _, _), (even, waves) in plans.items():
    for plan in (even, waves):
      ends = plan["ends"]
      assert 1 <= len(ends) <= 4, (label, plan)
      assert ends[-1] == m and ends == sorted(set(ends)), (label, plan)
      assert all(e % 128 == 0 for e in ends[:-1]), (label, plan)


def test_even_plans_cut_equal_tile_aligned_chunks(plans):
  for (label, m, _, _), (even, _) in plans.items():
    rows = even["ends"][0]
    assert even["ends"] == [min((c + 1) * rows, m) for c in range(len(even["ends"]))], label
  by_label = {case[0]: result for case, result in plans.items()}
  assert by_label["llama70b-out M=8192"][0]["ends"] == [1024, 2048, 3072, 4096]


def test_wave_plans_follow_the_model_on_the_benchmark_shapes(plans):
  by_label = {case[0]: result[1]["ends"] for case, result in plans.items() if case[0] != "odd"}
  # llama70b-out M=8192 (K=4096 a device, N=8192): a wave of 132 tiles of 128x256 takes
  # ~47 us and consumes 3 cluster rows (768 rows) first, then ~2 more per wave; the push lands
  # ~22 rows a us. Each cut is where the next chunk still lands before its first row is needed.
  assert by_label["llama70b-out M=8192"] == [768, 1280, 2304, 4096]
  assert by_label["llama70b-out M=16384"] == [1280, 2304, 4352, 8192]
  assert by_label["gpt3-out M=8192"] == [512, 1536, 4096]
  # A GEMM long next to its push (large K) needs one short first chunk, then the rest.
  assert by_label["llama70b-fc2 M=8192"] == [768, 4096]
  # Small partials: the whole push lands within the first wave.
  assert by_label["llama70b-fc2 M=2048"] == [1024]


def test_short_gemms_keep_one_chunk(plans):
  """Where the GEMM ends before any push could land, cutting helps nothing."""
  for (label, m, n, k), (_, waves) in plans.items():
    if label == "odd" and m < 1000:
      assert waves["ends"] == [m], (m, n, k, waves)
