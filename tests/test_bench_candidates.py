"""`python -m jaxflux.bench --op gemm --candidates` (jaxflux/bench/tuning_sweep.py) on CPU, with
stand-ins for the kernels that record the tuning override each call ran under."""
from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from jaxflux import bench, tuning
from jaxflux.bench import gemm_table, tuning_sweep

SHAPES = {"ag_gemm": [{"name": "a", "K": 64, "N": 96}],
          "gemm_rs": [{"name": "r", "K": 128, "N": 32}], "M": [64]}
OPS = {"all_gather_matmul": "all_gather_matmul", "own_rows": "matmul_reduce_scatter"}


@pytest.fixture(scope="module")
def shapes_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("bench_candidates") / "shapes.json"
  path.write_text(json.dumps(SHAPES))
  return path


def _run(shapes_file, out, *extra):
  argv = ["--op", "gemm", "--candidates", "--shapes-file", str(shapes_file), "--M", "64",
          "--iters", "2", "--warmup", "1", "--repeats", "2", "--out", str(out), *extra]
  return bench.run(argv, log=lambda *a, **k: None)


def _recording_gemm(seen):
  """jaxflux.ops.gemm.gemm's 16-bit form on CPU, noting (kernel, override fields) per trace."""
  def gemm(x, w, *, kernel, c=None, transpose_w=False):
    assert not transpose_w and (c is not None) == (kernel == "own_rows")
    if kernel in OPS:
      seen.append((kernel, tuple(sorted(tuning.overrides(OPS[kernel]).items()))))
    y = jnp.dot(x, w, preferred_element_type=jnp.float32)
    return (y if c is None else y + c.astype(jnp.float32)).astype(x.dtype)
  return gemm


def test_candidate_names_round_trip_and_cover_the_table_options():
  names = tuning_sweep.variant_names(["ag_gemm", "gemm_rs", "gemm_ar"])
  assert len(names) == len(tuning.AG_TILES) * 4 + len(tuning.OWN_ROWS_SCHEDULES) * 4
  for name in names:
    of, fields = tuning_sweep.parse(name)
    assert tuning_sweep.name(of, fields) == name
    with tuning.override(tuning_sweep.OPS[of], **fields):  # every candidate is a valid override
      pass
  assert tuning_sweep.parse("xla") is None and tuning_sweep.parse("gemm_ar:tile=x") is None
  assert tuning_sweep.parse("ag_gemm:tile") is None
  with pytest.raises(ValueError, match="no sweep for 'matmul_all_reduce'"):
    tuning.candidates("matmul_all_reduce")


@pytest.mark.slow
def test_every_candidate_runs_under_its_override_against_the_reference(shapes_file, tmp_path,
                                                                       monkeypatch):
  seen = []
  monkeypatch.setattr(gemm_table, "_gemm", _recording_gemm(seen))
  result = _run(shapes_file, tmp_path / "c.json")
  assert result["settings"]["variants"][:2] == ["xla", "xla_own_rows_c"]
  ag, rs = result["rows"]
  for row, kernel in ((ag, "all_gather_matmul"), (rs, "own_rows")):
    ref = tuning_sweep.REFERENCES[row["of"]]
    ratios = row["candidate_ratios"]
    assert set(ratios) == set(tuning_sweep.variant_names([row["of"]]))
    for cand, ratio in ratios.items():
      assert ratio == pytest.approx(row["ms"][cand] / row["ms"][ref], rel=1e-4)
      assert row["rel_err"][cand] < 1e-2  # against the float32 product (+ C)
      fields = tuple(sorted(tuning_sweep.parse(cand)[1].items()))
      assert (kernel, fields) in seen, cand  # traced under the candidate's override
  sweep = result["summary"]["candidates"]
  assert sweep["ag_gemm"]["reference"] == "xla"
  assert sweep["gemm_rs"]["reference"] == "xla_own_rows_c"
  for of, row in (("ag_gemm", ag), ("gemm_rs", rs)):
    best = sweep[of]["best"]
    assert len(best) == 1 and best[0]["ratio"] == min(row["candidate_ratios"].values())
    for cand, stats in sweep[of]["candidates"].items():
      assert stats["rows"] == 1 and stats["mean"] == stats["worst"] == row["candidate_ratios"][cand]
  text = gemm_table.format_gemm_table(result)
  assert "ag_gemm candidates (time / xla" in text and "best a M=64" in text


@pytest.mark.slow
def test_fp8_candidates_run_the_fp8_gemm_only_composition(shapes_file, tmp_path, monkeypatch):
  from jaxflux.ops import gemm as gemm_module
  seen = []

  def gemm(x, wt, *, kernel, c=None, transpose_w, x_scale, w_scale, out_dtype, accumulate):
    assert transpose_w and x.dtype == jnp.float8_e4m3fn
    if kernel in OPS:
      seen.append((kernel, tuple(sorted(tuning.overrides(OPS[kernel]).items()))))
    y = jnp.dot(x.astype(jnp.float32) * x_scale, (wt.astype(jnp.float32) * w_scale.T).T)
    return (y if c is None else y + c.astype(jnp.float32)).astype(out_dtype)

  monkeypatch.setattr(gemm_module, "gemm", gemm)
  result = _run(shapes_file, tmp_path / "f.json", "--dtype", "float8_e4m3fn",
                "--variants", "xla_fp8_fast,fp8_gemm_only")
  ag, rs = result["rows"]
  for row, kernel in ((ag, "all_gather_matmul"), (rs, "own_rows")):
    assert row["ratios"]["fp8_gemm_only_vs_xla_fp8"] is not None
    for cand, ratio in row["candidate_ratios"].items():
      assert ratio == pytest.approx(row["ms"][cand] / row["ms"]["xla_fp8_fast"], rel=1e-4)
      assert row["rel_err"][cand] < 2e-2
      assert (kernel, tuple(sorted(tuning_sweep.parse(cand)[1].items()))) in seen
  assert result["summary"]["candidates"]["gemm_rs"]["reference"] == "xla_fp8_fast"
  assert "gemm_rs candidates (time / xla_fp8_fast" in gemm_table.format_gemm_table(result)


def test_candidates_need_the_gemm_op():
  with pytest.raises(SystemExit):
    bench.parse_args(["--op", "ag_gemm", "--candidates"])
