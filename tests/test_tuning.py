"""The tuning table (jaxflux.tuning), on CPU: it covers every shape class its classifiers can
produce, every entry names a result file that exists, the default choices equal the kernels'
measured rules (a reference written out below), and overrides are checked when given."""
import itertools
import json
import math
import pathlib
import re
import threading

import pytest

from jaxflux import tuning
from jaxflux.ops import _attributes

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
AG, RS, AR = "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"
DTYPES = {"bfloat16": 2, "float16": 2}
TPS = range(2, 9)


# --- the reference: the kernels' rules, as the handlers applied them -------------------------

def reference_all_gather_matmul(batch, tp, m, n, sms):
  """(tile index, swizzle, local_read) of the sm90 defaults: cooperative 128x256 (ping-pong
  128x128 won few-wave rows on one device only); swizzle 8 when each shard is whole 2048-row
  bands and N whole groups of 8 256-column tiles (at 4 or more waves), else 4; own rows read
  from x when a shard is whole 128-row tiles."""
  tiles = math.ceil(batch * tp * m / 128) * math.ceil(n / 256)
  few_waves = sms > 0 and tiles < 4 * sms
  wide = not few_waves and m % 2048 == 0 and math.ceil(n / 256) % 8 == 0
  return 0, 8 if wide else 4, int(m % 128 == 0)


def even_chunks(m):
  """How many chunks PlanEvenChunks (xla_ffi/ffi/push_plan.h) cuts m rows into."""
  rows = min(((m + 3) // 4 + 127) // 128 * 128, m)
  return (m + rows - 1) // rows


def reference_matmul_reduce_scatter(tp, batch, m, k, n, itemsize):
  """(epilogue, chunks, pingpong, own-rows swizzle, peer-rows swizzle) of the sm90 defaults
  (cooperative own rows everywhere); pingpong and the own-rows swizzle are None where the
  own-rows GEMM is a plain one (the pass)."""
  partial = batch * m * n * itemsize
  push_in_chunks = batch == 1
  epilogue = tp == 2 and (push_in_chunks or partial <= 6144 * k)
  if not push_in_chunks or not epilogue or partial <= 6144 * k:
    chunks = 1
  else:
    chunks = even_chunks(m)
  if not epilogue:
    return False, chunks, None, None, 1
  return True, chunks, False, 4 if m >= 2 * 4 * 256 else 1, 1


def kernel_view(attrs, m):
  """The reference's tuple from the handler attributes the op passes for these rows."""
  epilogue = bool(attrs["reduce"])
  chunks = even_chunks(m) if attrs["push_chunks"] else 1
  if not epilogue:
    return False, chunks, None, None, attrs["peer_rows_swizzle"]
  return (True, chunks, attrs["own_rows_schedule"] == 1, attrs["own_rows_swizzle"],
          attrs["peer_rows_swizzle"])


# --- grids ------------------------------------------------------------------------------------

def benchmark_grid():
  """Per-device shapes of benchmarks/shapes.json at tp=2, M from 256 to 16384, batch 1 and 2."""
  shapes = json.loads((ROOT / "benchmarks" / "shapes.json").read_text())
  ms = sorted(set(shapes["M"]) | {256, 512, 1024, 2048, 3072, 4096, 8192, 16384})
  for op, key in ((AG, "ag_gemm"), (RS, "gemm_rs")):
    for shape, M, batch, dtype in itertools.product(shapes[key], ms, (1, 2), DTYPES):
      yield op, shape["K"], shape["N"], M, batch, dtype


def classifier_grid():
  """A dense sweep of the classifiers' inputs, past every threshold they test."""
  ms = (1, 8, 100, 128, 129, 200, 512, 1000, 2047, 2048, 4096, 8192, 32768)
  ks = (8, 64, 1024, 4096, 16384, 16392, 24576)
  ns = (8, 136, 256, 1024, 8192, 49152)
  return itertools.product(TPS, (1, 2, 3), ms, ks, ns)


def produced_classes(op, tp):
  found = set()
  for t, batch, m, k, n in classifier_grid():
    if t != tp:
      continue
    if op == AG:
      for sms in (0, 1, 132):
        found.add(tuning.all_gather_matmul_class(batch * tp * m, n, sms, m))
    elif op == AR:
      found.add(tuning.matmul_all_reduce_class(batch * m))
    else:
      found.add(tuning.matmul_reduce_scatter_class(tp, batch, m, k, n, 2))
  return found


# --- the table --------------------------------------------------------------------------------

@pytest.mark.parametrize("op", [AG, RS, AR])
def test_the_sweep_reaches_every_class_the_classifier_names(op):
  found = set().union(*(produced_classes(op, tp) for tp in TPS))
  assert found == set(tuning.shape_classes(op))


@pytest.mark.parametrize("op", [AG, RS, AR])
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_table_covers_every_class_on_sm90(op, tp, dtype):
  for shape_class in sorted(produced_classes(op, tp)):
    entry = tuning.lookup(op, dtype, tp, shape_class, "sm90")
    assert entry.op == op and entry.shape_class == shape_class
    fields = {f for f in tuning.FIELDS[op] if f != "grid_sms"}
    assert set(entry.choice) == fields, entry  # every field but grid_sms, nothing else
    tuning.check_fields(op, entry.choice)


def test_every_record_names_a_result_file_that_exists_and_says_why():
  for record in tuning.ENTRIES + tuning.AUTO_RULES:
    assert isinstance(record.evidence, tuple) and record.evidence, record
    for name in record.evidence:
      assert (RESULTS / name).is_file(), f"missing benchmarks/results/{name}"
    assert record.why.strip().endswith(".") and len(record.why) > 40, record
    assert not re.search(r"\brun \d|\bs\d+\b|\bissue\b", record.why, re.I), record.why
    assert "grid_sms" not in getattr(record, "choice", {}), record


def test_exact_keys_come_before_wildcards(monkeypatch):
  wild = tuning.Entry(RS, "sm90", "*", "*", "x", {}, "e", "w")
  exact = tuning.Entry(RS, "sm90", "float16", 2, "x", {}, "e", "w")
  monkeypatch.setattr(tuning.chooser, "ENTRIES", (wild, exact))  # the module lookup reads
  assert tuning.lookup(RS, "float16", 2, "x") is exact
  assert tuning.lookup(RS, "bfloat16", 2, "x") is wild


def test_no_match_is_an_error_naming_the_keys():
  with pytest.raises(LookupError, match=r"no table entry for matmul_reduce_scatter on sm100, "
                                        r"dtype bfloat16, tp=2, shape class 'batched'"):
    tuning.lookup(RS, "bfloat16", 2, "batched", "sm100")
  with pytest.raises(LookupError, match=r"shape class 'huge'.*jaxflux/tuning/table.py"):
    tuning.lookup(AG, "bfloat16", 2, "huge")


# --- defaults equal the reference ---------------------------------------------------------------

def _check_default(op, tp, batch, m, k, n, dtype, sms=132):
  if op == AG:
    tuned = tuning.choose_all_gather_matmul(dtype=dtype, tp=tp, rows=batch * tp * m, k=k, n=n,
                                            sms=sms, shard_rows=m, device=None)
    attrs = _attributes.all_gather_matmul(tuned.choice, m)
    got = (attrs["tile"], attrs["swizzle"], attrs["local_read"])
    assert got == reference_all_gather_matmul(batch, tp, m, n, sms), (tp, batch, m, n, sms)
    assert attrs["grid_sms"] == 0
  else:
    tuned = tuning.choose_matmul_reduce_scatter(dtype=dtype, tp=tp, batch=batch, m=m, k=k, n=n,
                                                itemsize=DTYPES[dtype], device=None)
    attrs = _attributes.matmul_reduce_scatter(tuned.choice)
    want = reference_matmul_reduce_scatter(tp, batch, m, k, n, DTYPES[dtype])
    assert kernel_view(attrs, m) == want, (tp, batch, m, k, n, tuned)
    assert attrs["grid_sms"] == 0


def test_defaults_equal_the_reference_on_the_benchmark_shapes():
  tp = 2
  for op, K, N, M, batch, dtype in benchmark_grid():
    if op == AG:  # x rows sharded, w columns sharded
      _check_default(op, tp, batch, M // tp, K, N // tp, dtype)
    else:         # K sharded; M scattered
      _check_default(op, tp, batch, M // tp, K // tp, N, dtype)


def test_defaults_equal_the_reference_on_the_classifier_sweep():
  for (tp, batch, m, k, n), dtype in itertools.product(classifier_grid(), DTYPES):
    for sms in (0, 132):
      _check_default(AG, tp, batch, m, k, n, dtype, sms)
    _check_default(RS, tp, batch, m, k, n, dtype)


@pytest.mark.parametrize("op,tp,rows,k,fused", [
    (AG, 2, 2048, 8192, True), (AG, 2, 2047, 8192, False), (AG, 4, 8192, 8192, False),
    (AG, 2, 16384, 49152, True),
    (RS, 2, 2048, 64, True), (RS, 2, 1024, 64, False), (RS, 2, 8192, 14336, True),
    (RS, 2, 16384, 14336, False), (RS, 2, 16384, 24576, False), (RS, 2, 2**27 // 8192, 8192,
                                                                  True),
    (RS, 4, 8192, 64, False), (RS, 8, 8192, 64, False),
])
def test_auto_rules_are_the_measured_region(op, tp, rows, k, fused):
  assert tuning.auto_prefers_fused(op, tp, rows, k) == fused


# --- overrides ----------------------------------------------------------------------------------

@pytest.mark.parametrize("op,fields,match", [
    (AG, {"tile": "coop_128x256_cluster1x2"}, r"tile='coop_128x256_cluster1x2' is not valid; "
                                              r"tile takes 'cooperative_128x256_cluster2x1' or"),
    (AG, {"swizzle": 3}, r"swizzle=3 is not valid; swizzle takes 1, 2, 4 or 8"),
    (AG, {"swizzle": True}, r"swizzle=True is not valid"),
    (AG, {"local_read": "direct-ish"}, r"local_read='direct-ish' is not valid; local_read takes "
                                       r"'direct' or 'copy'"),
    (AG, {"grid_sms": -1}, r"grid_sms=-1 is not valid; grid_sms takes an int >= 0"),
    (AG, {"grid_sms": "100"}, r"grid_sms='100' is not valid"),
    (AG, {"reduce": "pass"}, r"unknown field 'reduce'; the fields are \('tile'"),
    (RS, {"reduce": "epilog"}, r"reduce='epilog' is not valid; reduce takes 'epilogue' or "
                               r"'pass'"),
    (RS, {"push": "split"}, r"push='split' is not valid; push takes 'chunked' or 'whole'"),
    (RS, {"own_rows_schedule": "ping-pong"}, r"own_rows_schedule='ping-pong' is not valid"),
    (RS, {"own_rows_swizzle": 16}, r"own_rows_swizzle=16 is not valid"),
    (RS, {"peer_rows_swizzle": [4]}, r"peer_rows_swizzle=\[4\] is not valid"),
    (RS, {"schedule": "pingpong"}, r"unknown field 'schedule'"),
])
def test_a_bad_override_raises_at_once_naming_the_field(op, fields, match):
  with pytest.raises(ValueError, match=rf"jaxflux.tuning.override\('{op}'\): {match}"):
    with tuning.override(op, **fields):
      pytest.fail("the block ran")
  assert tuning.overrides(op) == {}


def test_an_unknown_op_is_rejected():
  with pytest.raises(ValueError, match=r"op='gemm' is not one of"):
    with tuning.override("gemm", swizzle=4):
      pass


def test_overrides_compose_inner_first_and_end_with_their_block():
  with tuning.override(RS, reduce="pass", grid_sms=100):
    with tuning.override(RS, grid_sms=50, own_rows_swizzle=8), tuning.override(AG, swizzle=1):
      assert tuning.overrides(RS) == {"reduce": "pass", "grid_sms": 50, "own_rows_swizzle": 8}
      assert tuning.overrides(AG) == {"swizzle": 1}
    assert tuning.overrides(RS) == {"reduce": "pass", "grid_sms": 100}
    assert tuning.overrides(AG) == {}
    choice = tuning.choose_matmul_reduce_scatter(dtype="bfloat16", tp=2, batch=1, m=4096,
                                                 k=4096, n=8192, itemsize=2).choice
    assert (choice.reduce, choice.push, choice.grid_sms) == ("pass", "whole", 100)
  assert tuning.overrides(RS) == {}


def test_overrides_are_per_thread():
  seen = []
  with tuning.override(AG, grid_sms=7):
    thread = threading.Thread(target=lambda: seen.append(tuning.overrides(AG)))
    thread.start()
    thread.join()
  assert seen == [{}]


def test_an_override_reaches_the_choice_and_keeps_the_class():
  with tuning.override(AG, tile="cooperative_128x256_cluster2x1", local_read="copy"):
    tuned = tuning.choose_all_gather_matmul(dtype="float16", tp=2, rows=2048, k=1024, n=512,
                                            sms=132, device=None)
  assert tuned.shape_class == "few_waves"
  assert tuned.choice == tuning.AllGatherMatmulChoice("cooperative_128x256_cluster2x1", 4,
                                                      "copy", 0)


# --- normalization ------------------------------------------------------------------------------

CHUNKED = {"dtype": "bfloat16", "tp": 2, "batch": 1, "m": 4096, "k": 4096, "n": 8192,
           "itemsize": 2}


def test_the_pass_takes_the_whole_push_unless_chunks_were_asked_for():
  assert tuning.choose_matmul_reduce_scatter(**CHUNKED).choice.push == "chunked"
  with tuning.override(RS, reduce="pass"):
    assert tuning.choose_matmul_reduce_scatter(**CHUNKED).choice.push == "whole"
  with tuning.override(RS, reduce="pass", push="chunked"):
    with pytest.raises(ValueError, match=r"matmul_reduce_scatter: push='chunked' needs "
                                         r"reduce='epilogue'.*got reduce='pass'.*Override "
                                         r"reduce='epilogue' too"):
      tuning.choose_matmul_reduce_scatter(**CHUNKED)


def test_a_chunked_push_needs_unbatched_x():
  with tuning.override(RS, reduce="epilogue", push="chunked"):
    with pytest.raises(ValueError, match=r"push='chunked' needs an unbatched x.*here x has 2 "
                                         r"batch entries. Override push='whole'"):
      tuning.choose_matmul_reduce_scatter(**{**CHUNKED, "batch": 2})


@pytest.mark.parametrize("tp", [4, 8])
def test_the_epilogue_reduction_needs_tp_2(tp):
  with tuning.override(RS, reduce="epilogue"):
    with pytest.raises(ValueError, match=rf"reduce='epilogue' needs tp=2 \(here tp={tp}\).*"
                                         r"Override reduce='pass'"):
      tuning.choose_matmul_reduce_scatter(**{**CHUNKED, "tp": tp})


# --- GEMM+AllReduce -----------------------------------------------------------------------------

def reference_matmul_all_reduce(batch, m):
  """(tile index, push_chunks, swizzle): the swap-AB decode GEMM pushed whole with swizzle 1 up
  to 128 rows (batch * m), else the stock 128x256 tile, swizzle 1 below 2048 rows and 4 from there,
  pushed in chunks unless x is batched."""
  rows = batch * m
  if rows <= 128:
    return 2, 0, 1
  return 0, int(batch == 1), 4 if rows >= 2048 else 1


def reference_all_reduce_class(rows):
  if rows <= 128:
    return "decode"
  return "prefill.rows_ge_2048" if rows >= 2048 else "prefill.rows_lt_2048"


def test_all_reduce_defaults_equal_the_reference():
  shapes = json.loads((ROOT / "benchmarks" / "shapes.json").read_text())["gemm_rs"]
  ms = (1, 16, 128, 129, 256, 512, 1024, 2047, 2048, 8192, 16384)
  for (s, m, batch, dtype, tp) in itertools.product(shapes, ms, (1, 2, 3), DTYPES, TPS):
    tuned = tuning.choose_matmul_all_reduce(dtype=dtype, tp=tp, batch=batch, m=m,
                                            k=s["K"] // tp, n=s["N"], itemsize=DTYPES[dtype])
    attrs = _attributes.matmul_all_reduce(tuned.choice)
    assert tuned.shape_class == reference_all_reduce_class(batch * m)
    got = (attrs["tile"], attrs["push_chunks"], attrs["swizzle"])
    assert got == reference_matmul_all_reduce(batch, m), (s, m, batch, tp, tuned)
    assert attrs["grid_sms"] == 0


@pytest.mark.parametrize("rows,shape_class", [
    (1, "decode"), (128, "decode"), (129, "prefill.rows_lt_2048"),
    (2047, "prefill.rows_lt_2048"), (2048, "prefill.rows_ge_2048"),
    (16384, "prefill.rows_ge_2048")])
def test_all_reduce_classes_split_at_128_and_2048_rows(rows, shape_class):
  assert tuning.matmul_all_reduce_class(rows) == shape_class


@pytest.mark.parametrize("fields,match", [
    ({"tile": "streamk"}, r"tile='streamk' is not valid; tile takes "
                          r"'cooperative_128x256_cluster2x1' or 'cooperative_128x128_streamk' or "
                          r"'swap_ab_streamk'"),
    ({"push": "split"}, r"push='split' is not valid; push takes 'chunked' or 'whole'"),
    ({"swizzle": 3}, r"swizzle=3 is not valid; swizzle takes 1, 2, 4 or 8"),
    ({"grid_sms": -1}, r"grid_sms=-1 is not valid"),
    ({"reduce": "pass"}, r"unknown field 'reduce'; the fields are \('tile', 'push', 'swizzle', "
                         r"'grid_sms'\)"),
])
def test_a_bad_all_reduce_override_raises_at_once(fields, match):
  with pytest.raises(ValueError, match=rf"jaxflux.tuning.override\('{AR}'\): {match}"):
    with tuning.override(AR, **fields):
      pytest.fail("the block ran")
  assert tuning.overrides(AR) == {}


DECODE = {"dtype": "bfloat16", "tp": 2, "batch": 1, "m": 16, "k": 4096, "n": 8192,
          "itemsize": 2}


def test_an_all_reduce_override_reaches_the_choice_and_keeps_the_class():
  with tuning.override(AR, tile="cooperative_128x256_cluster2x1", grid_sms=100):
    with tuning.override(AR, swizzle=8):
      tuned = tuning.choose_matmul_all_reduce(**DECODE)
  assert tuned.shape_class == "decode"
  assert tuned.choice == tuning.MatmulAllReduceChoice("cooperative_128x256_cluster2x1", "whole",
                                                      8, 100)
  assert tuning.choose_matmul_all_reduce(**DECODE).choice.tile == "swap_ab_streamk"


def test_a_chunked_all_reduce_push_needs_unbatched_x():
  prefill = {**DECODE, "m": 1024}
  assert tuning.choose_matmul_all_reduce(**prefill).choice.push == "chunked"
  # The table's chunked push turns whole for a batched x ...
  assert tuning.choose_matmul_all_reduce(**{**prefill, "batch": 2}).choice.push == "whole"
  # ... an asked-for one is an error; on an unbatched x, even a decode one, it stands.
  with tuning.override(AR, push="chunked"):
    assert tuning.choose_matmul_all_reduce(**DECODE).choice.push == "chunked"
    with pytest.raises(ValueError, match=r"matmul_all_reduce: push='chunked' needs an unbatched "
                                         r"x.*here x has 3 batch entries. Override "
                                         r"push='whole'"):
      tuning.choose_matmul_all_reduce(**{**DECODE, "batch": 3})


def test_a_grouped_tile_override_is_checked_and_scoped():
  """grouped_matmul reads the override where it is called (test_fused_tracing checks the tile
  reaches its kernel calls); the tuned choice itself does not change."""
  default = tuning.choose_grouped_matmul(group_rows=128, n=1536)
  other = next(t for t in tuning.GROUPED_TILES if t != default)
  with tuning.override("grouped_matmul", tile=other):
    assert tuning.overrides("grouped_matmul") == {"tile": other}
  assert tuning.overrides("grouped_matmul") == {}
  with pytest.raises(ValueError, match=r"tile='tiny' is not valid; tile takes "
                                       r"'cooperative_128x256' or 'pingpong_128x128'"):
    with tuning.override("grouped_matmul", tile="tiny"):
      pass
  with pytest.raises(ValueError, match=r"unknown field 'swizzle'"):
    with tuning.override("grouped_matmul", swizzle=2):
      pass


def test_grouped_tile_choice_is_the_evidence_winner():
  """The grouped GEMM's one tile is the faster of the two over the evidence's rows (geometric
  mean of the time ratios), and the evidence times both tiles on every row."""
  from jaxflux.tuning import grouped
  rows = json.loads((RESULTS / grouped.EVIDENCE).read_text())["rows"]
  assert len(rows) >= 8
  chosen = tuning.choose_grouped_matmul(group_rows=128, n=1536)
  assert chosen in tuning.GROUPED_TILES
  for other in tuning.GROUPED_TILES:
    ratios = [row["ms"][f"fused_{other}"] / row["ms"][f"fused_{chosen}"] for row in rows]
    assert math.exp(sum(map(math.log, ratios)) / len(ratios)) >= 1.0, other


def test_the_kernels_enum_attributes_are_named_by_the_native_module():
  """The choices' names are the module's (xla_ffi/ffi/attribute_names.h), and a choice is
  encoded by its index there: a kernel added on one side only fails here, not on a GPU."""
  from jaxflux import _runtime
  assert _runtime.attribute_names() == {
      "ag_tile": tuning.AG_TILES, "gemm_tile": tuning.AR_TILES,
      "own_rows_schedule": tuning.OWN_ROWS_SCHEDULES, "grouped_tile": tuning.GROUPED_TILES}
  for attribute, names in _runtime.attribute_names().items():
    assert [_attributes.encode(attribute, name) for name in names] == list(range(len(names)))
  with pytest.raises(ValueError, match=r"no ag_tile 'pingpong_64x64'.*one of \('cooperative"):
    _attributes.encode("ag_tile", "pingpong_64x64")
  with pytest.raises(RuntimeError, match=r"names no 'swizzle' attribute"):
    _attributes.encode("swizzle", "2")
