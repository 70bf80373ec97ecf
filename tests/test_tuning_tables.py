"""Device tables and `python -m jaxflux.tune`, on CPU: each shipped table is what the tune builds
from its device's recorded sweep; a device reads its own table (an unknown sm90 kind the
defaults); exact shapes before classes, user tables before shipped ones; a class's swizzle fits
the rows; broken or foreign user tables are skipped with a warning; the tune refuses to install
a table for another GPU."""
import json
import logging
import pathlib

import pytest

from jaxflux import tuning
from jaxflux.tune import cli, pick
from jaxflux.tuning import device as device_module
from jaxflux.tuning import tables

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
AG, RS = "all_gather_matmul", "matmul_reduce_scatter"
H100 = tuning.Device("NVIDIA H100 80GB HBM3", "9.0", 132)
H200 = tuning.Device("NVIDIA H200", "9.0", 132)
UNKNOWN = tuning.Device("NVIDIA H800", "9.0", 132)
SWEEPS = {"h100_sxm": "h100_gemm_candidates.json", "h200": "h200_gemm_candidates.json"}


@pytest.fixture(autouse=True)
def tuning_dir(tmp_path, monkeypatch):
  """Every test reads user tables from its own empty folder, and tables afresh."""
  directory = tmp_path / "tuning"
  monkeypatch.setenv(tables.ENV_DIR, str(directory))
  tables.reload()
  yield directory
  tables.reload()


def ag(device, rows=2048, k=8192, n=5120, shard_rows=None):
  return tuning.choose_all_gather_matmul(
      dtype="bfloat16", tp=2, rows=rows, k=k, n=n, sms=132,
      shard_rows=rows // 2 if shard_rows is None else shard_rows, device=device)


def rs(device, m=4096, k=4096, n=8192, batch=1):
  return tuning.choose_matmul_reduce_scatter(dtype="bfloat16", tp=2, batch=batch, m=m, k=k, n=n,
                                             itemsize=2, device=device)


# --- the shipped tables ------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SWEEPS))
def test_each_shipped_table_is_the_tune_of_its_devices_sweep(name, tmp_path):
  shipped = tables.read(tables.shipped_path(name), "shipped")
  assert device_module.SHIPPED_TABLES[shipped.device["kind"]] == name
  assert shipped.measured["sweeps"] == [SWEEPS[name]]
  sweep = json.loads((RESULTS / SWEEPS[name]).read_text())
  assert {run["machine"]["device_kinds"][0] for run in sweep["runs"]} == {shipped.device["kind"]}
  out = tmp_path / "rebuilt.json"
  assert cli.main(["--from", str(RESULTS / SWEEPS[name]), "--out", str(out)]) == 0
  rebuilt = tables.read(out, "user")
  assert (rebuilt.classes, rebuilt.shapes, rebuilt.device) == (
      shipped.classes, shipped.shapes, shipped.device)


def test_every_shipped_kind_has_a_table_file():
  for name in device_module.SHIPPED_TABLES.values():
    assert tables.shipped_path(name).is_file(), name
  assert sorted(p.stem for p in tables.SHIPPED_DIR.glob("*.json")) == sorted(SWEEPS)


def test_each_device_reads_its_own_table():
  # Under 4 waves: ping-pong won on H200 only; the defaults take the tile best on both.
  assert ag(H200).choice.tile == "pingpong_128x128_cluster1x2"
  assert ag(H100).choice.tile == "cooperative_128x256_cluster2x1"
  assert ag(UNKNOWN).choice == ag(None).choice
  assert ag(None).choice.tile == "cooperative_128x256_cluster2x1"
  assert ag(H200).shape_class == ag(H100).shape_class == "few_waves"
  for device in (H100, H200, UNKNOWN, None):  # no ping-pong own rows on any measured device
    assert rs(device).choice.own_rows_schedule == "cooperative"


def test_describe_says_which_tables_and_why(tuning_dir):
  text = tuning.describe(H100)
  assert "NVIDIA H100 80GB HBM3" in text and "shipped table" in text and "h100_sxm.json" in text
  assert f"no user table at {tuning_dir / 'nvidia_h100_80gb_hbm3.json'}" in text
  assert ("impl='auto' also takes matmul_all_reduce at tp=1 with fp8 operands, 1-128 rows, on "
          "this kind only (h100_fp8_gemm_decode.json)") in text
  assert "impl='auto' also" not in tuning.describe(H200)
  text = tuning.describe(UNKNOWN)
  assert "no shipped table for 'NVIDIA H800'" in text and "sm90 defaults" in text
  assert "no GPU" in tuning.describe(None)


def test_an_exact_shape_entry_comes_before_its_class():
  shipped = tables.read(tables.shipped_path("h100_sxm"), "shipped")
  entry = next(e for e in shipped.shapes if e.op == RS)
  m, k, n = entry.problem
  assert rs(H100, m=m, k=k, n=n).choice.own_rows_swizzle == entry.choice["own_rows_swizzle"]
  cls = next(e for e in shipped.classes
             if e.op == RS and e.shape_class == rs(H100, m=m, k=k, n=n).shape_class)
  assert cls.choice["own_rows_swizzle"] != entry.choice["own_rows_swizzle"]
  # A batched x is another problem: its class's entry applies, never the shape's.
  assert rs(H100, m=m, k=k, n=n, batch=2).choice != rs(H100, m=m, k=k, n=n).choice


@pytest.mark.parametrize("rows,cluster,want", [
    (1024, "cooperative", 4), (2048, "cooperative", 8), (3072, "cooperative", 4),
    (1536, "cooperative", 2), (1000, "cooperative", 1), (0, "cooperative", 8),
    (1024, "pingpong", 8), (640, "pingpong", 1)])
def test_a_class_swizzle_is_halved_until_its_band_fits_the_rows(rows, cluster, want):
  fields = {"own_rows_schedule": cluster, "own_rows_swizzle": 8}
  assert tables.fit_swizzle(RS, fields, rows)["own_rows_swizzle"] == want


def test_the_chooser_fits_a_class_swizzle_to_the_own_rows():
  # H100's chunked class takes swizzle 8 (bands of 2048 own rows); 3072 rows get bands of 1024.
  assert rs(H100, m=6144).choice.own_rows_swizzle == 8
  assert rs(H100, m=3072).shape_class == rs(H100, m=6144).shape_class
  assert rs(H100, m=3072).choice.own_rows_swizzle == 4


def test_overrides_still_win_over_device_tables():
  with tuning.override(AG, tile="cooperative_128x256_cluster2x1", swizzle=2):
    assert ag(H200).choice.tile == "cooperative_128x256_cluster2x1"
    assert ag(H200).choice.swizzle == 2


# --- user tables ---------------------------------------------------------------------------------

def write_user_table(directory, device, classes=(), shapes=()):
  directory.mkdir(parents=True, exist_ok=True)
  path = directory / f"{device.slug}.json"
  path.write_text(tables.to_json(device, {"date": "test"}, classes, shapes))
  tables.reload()
  return path


def test_a_user_table_comes_before_the_shipped_one(tuning_dir):
  entry = tables.ClassEntry(AG, "bfloat16", 2, "few_waves",
                            {"tile": "cooperative_128x256_cluster2x1", "swizzle": 2}, 1.0)
  path = write_user_table(tuning_dir, H200, classes=[entry])
  choice = ag(H200).choice
  assert (choice.tile, choice.swizzle) == ("cooperative_128x256_cluster2x1", 2)
  # Classes the user table lacks still come from the shipped table.
  shipped = tables.read(tables.shipped_path("h200"), "shipped")
  chunked = next(e for e in shipped.classes if e.shape_class == rs(H200).shape_class)
  assert rs(H200).choice.own_rows_swizzle == chunked.choice["own_rows_swizzle"] == 8
  assert [t.origin for t in tuning.active_tables(H200).tables] == ["user", "shipped"]
  assert str(path) in tuning.describe(H200)


def test_a_corrupt_user_table_is_skipped_with_a_warning(tuning_dir, caplog):
  tuning_dir.mkdir(parents=True)
  (tuning_dir / f"{H200.slug}.json").write_text("{not json")
  with caplog.at_level(logging.WARNING, logger="jaxflux.tuning"):
    assert ag(H200).choice.tile == "pingpong_128x128_cluster1x2"  # the shipped choice
  assert "can't read the device table" in caplog.text
  assert "skipped" in tuning.describe(H200)


@pytest.mark.parametrize("doc,match", [
    ({"format": "other"}, r"format is 'other'"),
    ({"classes": [{"op": AG, "dtype": "bfloat16", "tp": 2, "shape_class": "few_waves",
                   "choice": {"swizzle": 3}, "ratio": 1.0}]}, r"swizzle=3 is not valid"),
    ({"classes": [{"op": AG, "dtype": "bfloat16", "tp": 2, "shape_class": "tiny",
                   "choice": {"swizzle": 4}, "ratio": 1.0}]}, r"unknown shape class 'tiny'"),
    ({"classes": [{"op": RS, "dtype": "bfloat16", "tp": 2, "shape_class": "batched",
                   "choice": {"reduce": "pass"}, "ratio": 1.0}]}, r"a device table sets"),
    ({"shapes": [{"op": AG, "dtype": "bfloat16", "tp": 2, "problem": [1, 2],
                  "choice": {"swizzle": 4}, "ratio": 1.0}]}, r"is not \(rows, k, n\)"),
])
def test_an_invalid_table_is_an_error_naming_the_file_and_the_fault(tmp_path, doc, match):
  base = json.loads(tables.to_json(H100, {}, (), ()))
  path = tmp_path / "t.json"
  path.write_text(json.dumps({**base, **doc}))
  with pytest.raises(tables.TableError, match=rf"{path}.*{match}"):
    tables.read(path, "user")


def test_a_user_table_of_another_kind_is_skipped(tuning_dir, caplog):
  entry = tables.ClassEntry(AG, "bfloat16", 2, "few_waves",
                            {"tile": "cooperative_128x256_cluster2x1", "swizzle": 2}, 1.0)
  path = write_user_table(tuning_dir, H100, classes=[entry])
  path.rename(tuning_dir / f"{H200.slug}.json")  # an H100 table under the H200's name
  tables.reload()
  with caplog.at_level(logging.WARNING, logger="jaxflux.tuning"):
    assert ag(H200).choice.tile == "pingpong_128x128_cluster1x2"
  assert "measured on 'NVIDIA H100 80GB HBM3'" in caplog.text


def test_choices_are_a_pure_function_of_the_tables_and_the_shape(tuning_dir):
  first = [ag(H100, rows=r).choice for r in (2048, 4096, 8192)] + [rs(H100).choice]
  digest = tuning.active_tables(H100).digest
  tables.reload()
  assert [ag(H100, rows=r).choice for r in (2048, 4096, 8192)] + [rs(H100).choice] == first
  assert tuning.active_tables(H100).digest == digest
  write_user_table(tuning_dir, H100)
  assert tuning.active_tables(H100).digest != digest  # another table set, another digest


# --- python -m jaxflux.tune --------------------------------------------------------------------

def test_the_tune_refuses_to_install_a_table_for_another_gpu(monkeypatch, tuning_dir, capsys):
  sweep = str(RESULTS / SWEEPS["h200"])
  monkeypatch.setattr(device_module, "current", lambda: H100)
  with pytest.raises(SystemExit, match=r"refusing to write a table measured on 'NVIDIA H200' "
                                       r"into the tuning dir of 'NVIDIA H100 80GB HBM3'"):
    cli.main(["--from", sweep])
  monkeypatch.setattr(device_module, "current", lambda: None)
  with pytest.raises(SystemExit, match=r"a machine without a GPU.*--out PATH"):
    cli.main(["--from", sweep])
  assert not tuning_dir.exists()
  with pytest.raises(SystemExit, match=r"measures this machine's GPU, and JAX sees none"):
    cli.main([])


def test_the_tune_installs_a_table_that_the_library_then_uses(monkeypatch, tuning_dir, capsys):
  monkeypatch.setattr(device_module, "current", lambda: H100)
  assert cli.main(["--from", str(RESULTS / SWEEPS["h100_sxm"]), "--min-gain", "0.5"]) == 0
  out = capsys.readouterr().out
  assert "all_gather_matmul: mean before" in out and "wrote" in out
  assert "llama70b-fc2 M=16384" in out
  installed = tuning_dir / f"{H100.slug}.json"
  table = tables.read(installed, "user")
  assert table.shapes == ()  # no shape beats its class by 50%
  assert [t.origin for t in tuning.active_tables().tables] == ["user", "shipped"]
  assert "user table" in tuning.describe()


def test_pick_takes_the_best_class_candidate_and_shapes_past_the_gain():
  def row(label, ratios, problem):
    return pick.SweptRow(label, RS, "bfloat16", 2, problem, "chunked.rows_ge_2048", 4096,
                         {pick.candidate_key({"own_rows_schedule": "cooperative",
                                              "own_rows_swizzle": s}): r
                          for s, r in ratios.items()})
  rows = [row("a", {1: 1.10, 4: 1.00, 8: 1.02}, (4096, 1, 1)),
          row("b", {1: 1.00, 4: 1.005, 8: 1.30}, (4096, 2, 1)),
          row("c", {1: 1.05, 4: 1.03, 8: 1.00}, (4096, 3, 1))]
  classes, shapes = pick.pick(rows, min_gain=0.01)
  assert [e.choice["own_rows_swizzle"] for e in classes] == [4]
  assert [(e.problem, e.choice["own_rows_swizzle"]) for e in shapes] == [((4096, 3, 1), 8)]
  assert pick.chosen_key(rows[2], classes, shapes) == pick.candidate_key(
      {"own_rows_schedule": "cooperative", "own_rows_swizzle": 8})


def test_the_sweep_rows_skip_candidates_this_build_does_not_take():
  sweep = json.loads((RESULTS / SWEEPS["h200"]).read_text())
  assert any("streamk" in v for run in sweep["runs"] for v in run["settings"]["variants"])
  rows = [r for run in sweep["runs"] for r in pick.swept_rows(run, 132)]
  assert len(rows) == 32 and all(len(r.ratios) == 8 for r in rows)
