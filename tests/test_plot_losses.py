"""benchmarks/plot_losses.py: the loss-curve plot and the stated difference between runs."""
import json
import pathlib

import pytest

from conftest import load_script

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "plot_losses.py"


def _module():
  return load_script(SCRIPT, "plot_losses")


def test_states_the_largest_relative_difference_and_writes_a_png(tmp_path, capsys):
  pytest.importorskip("matplotlib")
  runs = []
  for mode, losses in (("jaxflux", [4.0, 3.0, 2.2]), ("xla", [4.0, 3.0, 2.0])):
    path = tmp_path / f"{mode}.json"
    path.write_text(json.dumps({"mode": mode, "losses": losses}))
    runs.append(str(path))
  png = tmp_path / "losses.png"
  _module().main(runs + ["--png", str(png), "--smooth", "2"])
  out = capsys.readouterr().out
  assert ("jaxflux vs xla over 3 steps: first step differing by > 1e-3 relative: 2; "
          "max |relative difference| 1.000e-01; of the 2-step means 4.000e-02; "
          "mean of the last 2 steps 2.6000 vs 2.5000") in out, out
  assert png.stat().st_size > 1000


def test_max_rel_diff_compares_the_common_prefix():
  np = pytest.importorskip("numpy")
  m = _module()
  assert m.max_rel_diff(np.array([1.0, 2.0, 9.0]), np.array([1.0, 2.5])) == pytest.approx(0.2)


def test_first_divergence_and_moving_average():
  np = pytest.importorskip("numpy")
  m = _module()
  assert m.first_divergence(np.array([1.0, 2.0, 3.1]), np.array([1.0, 2.0, 3.0])) == 2
  assert m.first_divergence(np.array([1.0, 2.0]), np.array([1.0, 2.0001])) is None
  assert m.moving_average(np.array([1.0, 3.0, 5.0, 7.0]), 2).tolist() == [2.0, 4.0, 6.0]
  assert m.moving_average(np.array([1.0, 3.0]), 5).tolist() == [1.0, 3.0]  # too short: as is


def test_labels_name_runs_of_one_mode_apart(tmp_path, capsys):
  pytest.importorskip("matplotlib")
  runs = []
  for name, losses in (("a", [4.0, 3.0]), ("b", [4.0, 3.3])):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"mode": "xla", "losses": losses}))
    runs.append(str(path))
  m = _module()
  m.main(runs + ["--png", str(tmp_path / "l.png"), "--smooth", "1", "--labels", "xla new,xla old"])
  assert "xla new vs xla old over 2 steps: first step differing by > 1e-3 relative: 1" in \
      capsys.readouterr().out
  with pytest.raises(SystemExit):
    m.main(runs + ["--png", str(tmp_path / "l.png"), "--labels", "only one"])
