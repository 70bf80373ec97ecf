"""The GPU test tiers of benchmarks/gpu_check.sh select what they promise: the full tier's chunks
split every GPU test between them, each test in one chunk (a test in none would never run on a
GPU, one in two would cost a device call twice), the quick-tier-only tests apart; and every
shared-GPU test run at tp=4 also runs at tp=2.

Runs the script's own `tier` function in bash and pytest's own collection (in one subprocess, so
the selections are pytest's, -k and -m included), on this machine without a GPU: collection
needs neither."""
from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
FULL = ("kernels", "fp8_ag", "fp8_rest", "ops", "matrix", "matrix_pingpong", "tp4", "tp8",
        "fuzz_tp4", "rest")

# Collects each selection given as JSON on stdin; prints {name: [node ids]}.
COLLECT = """
import json, sys, pytest
class Ids:
  @pytest.hookimpl(trylast=True)  # after -m and -k have deselected
  def pytest_collection_modifyitems(self, items):
    self.ids = [item.nodeid for item in items]
out = {}
for name, args in json.load(sys.stdin).items():
  ids = Ids()
  code = pytest.main(["-p", "no:cacheprovider", "--collect-only", "-qq", *args], plugins=[ids])
  assert code in (0, 5), (name, code)  # 5: nothing selected
  out[name] = ids.ids
print("IDS " + json.dumps(out))
"""


def _tier_args(tier: str) -> list[str]:
  """gpu_check.sh's pytest arguments for `tier`, from its own `tier` function."""
  function = re.search(r"^tier\(\) \{.*?^\}$", SCRIPT.read_text(), re.M | re.S).group(0)
  out = subprocess.run(["bash", "-c", f'{function}\ntier "$1" && printf "%s\\0" '
                        '"${TIER_ARGS[@]}"', "bash", tier],
                       capture_output=True, text=True, check=True).stdout
  return out.split("\0")[:-1]


@pytest.fixture(scope="module")
def selections() -> dict[str, set[str]]:
  if shutil.which("bash") is None:
    pytest.skip("needs bash")
  args = {tier: _tier_args(tier) for tier in ("quick",) + FULL}
  args["every GPU test"] = ["-m", "gpu", "tests"]
  done = subprocess.run([sys.executable, "-c", COLLECT], input=json.dumps(args), cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  line = next((l for l in done.stdout.splitlines() if l.startswith("IDS ")), None)
  assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
  return {name: set(ids) for name, ids in json.loads(line[4:]).items()}


@pytest.mark.slow  # eleven collections of the test tree: about 10 s on 2 cores
def test_full_tier_chunks_split_every_gpu_test_once(selections):
  every = selections["every GPU test"]
  assert len(every) > 300 and selections["quick"] <= every
  chunks = {tier: selections[tier] for tier in FULL}
  for tier, ids in chunks.items():
    assert ids and ids <= every, tier
  seen: dict[str, str] = {}
  for tier, ids in chunks.items():
    for node in ids:
      assert node not in seen, f"{node} in two chunks: {seen[node]} and {tier}"
      seen[node] = tier
  missing = every - set(seen)
  # Only the quick tier's one-launch tests stay out of the full tier (its chunks run each case
  # in full instead).
  assert missing <= selections["quick"], sorted(missing - selections["quick"])
  assert all("_once_" in node for node in missing), sorted(missing)


@pytest.mark.slow
def test_every_shared_gpu_test_at_tp4_also_runs_at_tp2(selections):
  every = selections["every GPU test"]
  at_tp2 = {n.replace("[tp4", "[tp2") for n in every if "[tp4" in n}
  assert len(at_tp2) >= 8 and at_tp2 <= every, sorted(at_tp2 - every)
