"""Plots the loss curves of training-example runs (examples/train_tp_transformer.py --out) and
states how far the first run's curve is from each other run's.

    python benchmarks/plot_losses.py RUN.json [RUN.json ...] [--png benchmarks/losses.png]

Needs matplotlib (not a jaxflux dependency: pip install matplotlib).
"""
from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np


def load(path: str) -> tuple[str, np.ndarray]:
  record = json.loads(pathlib.Path(path).read_text())
  label = record.get("mode", pathlib.Path(path).stem)
  return label, np.asarray(record["losses"], dtype=np.float64)


def max_rel_diff(a: np.ndarray, b: np.ndarray) -> float:
  n = min(len(a), len(b))
  return float(np.max(np.abs(a[:n] - b[:n]) / np.maximum(np.abs(b[:n]), 1e-12)))


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("runs", nargs="+", help="JSON files written by the example's --out")
  p.add_argument("--png", default="benchmarks/losses.png")
  args = p.parse_args(argv)
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError as e:
    raise SystemExit(f"plot_losses.py needs matplotlib ({e}); pip install matplotlib") from e

  curves = [load(r) for r in args.runs]
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                    gridspec_kw={"height_ratios": [3, 1]})
  base_label, base = curves[0]
  for label, losses in curves:
    top.plot(np.arange(len(losses)), losses, label=label, linewidth=1)
  for label, losses in curves[1:]:
    n = min(len(base), len(losses))
    bottom.plot(np.arange(n), (base[:n] - losses[:n]) / losses[:n], label=f"{base_label} vs {label}",
                linewidth=1)
    print(f"{base_label} vs {label}: max |relative difference| over {n} steps "
          f"{max_rel_diff(base, losses):.3e}")
  top.set_ylabel("training loss")
  top.legend()
  bottom.set_xlabel("step")
  bottom.set_ylabel("relative diff")
  bottom.axhline(0, color="gray", linewidth=0.5)
  fig.tight_layout()
  fig.savefig(args.png, dpi=120)
  print(f"wrote {args.png}")


if __name__ == "__main__":
  main()
