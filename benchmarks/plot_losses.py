"""Plots the loss curves of training-example runs (examples/train_tp_transformer.py --out) and
states how far the first run's curve is from each other run's.

    python benchmarks/plot_losses.py RUN.json [RUN.json ...] [--png benchmarks/losses.png]
                                     [--smooth 20] [--title TEXT] [--labels A,B,...]

Per pair it states: the first step whose losses differ by more than 1e-3 (relative), the
largest relative difference step by step, the same for the curves smoothed by a moving average
of --smooth steps, and the mean loss of the last --smooth steps. Two bf16 runs of a model whose
per-step loss jumps around (a batch of one sequence) agree step by step until rounding
differences have grown, and then only on average: the smoothed figures are the ones to compare.

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


def first_divergence(a: np.ndarray, b: np.ndarray, rtol: float = 1e-3) -> int | None:
  """The first step whose losses differ by more than rtol (relative to b), or None."""
  n = min(len(a), len(b))
  over = np.abs(a[:n] - b[:n]) > rtol * np.maximum(np.abs(b[:n]), 1e-12)
  return int(np.argmax(over)) if over.any() else None


def moving_average(x: np.ndarray, k: int) -> np.ndarray:
  """Means of every k consecutive values (len(x) - k + 1 of them); x itself if k <= 1."""
  if k <= 1 or len(x) < k:
    return x
  return np.convolve(x, np.ones(k) / k, mode="valid")


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("runs", nargs="+", help="JSON files written by the example's --out")
  p.add_argument("--png", default="benchmarks/losses.png")
  p.add_argument("--smooth", type=int, default=20, help="moving-average window, in steps")
  p.add_argument("--title", default=None)
  p.add_argument("--labels", default=None,
                 help="comma-separated names for the runs, in order (default: each run's mode); "
                      "tells apart runs of one mode, e.g. two builds' xla runs")
  args = p.parse_args(argv)
  if args.smooth < 1:
    p.error("--smooth must be >= 1")
  labels = args.labels.split(",") if args.labels else None
  if labels is not None and len(labels) != len(args.runs):
    p.error(f"--labels names {len(labels)} runs but {len(args.runs)} were given")
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError as e:
    raise SystemExit(f"plot_losses.py needs matplotlib ({e}); pip install matplotlib") from e

  curves = [load(r) for r in args.runs]
  if labels is not None:
    curves = [(label, losses) for label, (_, losses) in zip(labels, curves)]
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                    gridspec_kw={"height_ratios": [3, 1]})
  base_label, base = curves[0]
  for label, losses in curves:
    line, = top.plot(np.arange(len(losses)), losses, label=label, linewidth=0.6, alpha=0.5)
    smooth = moving_average(losses, args.smooth)
    top.plot(np.arange(len(smooth)) + (len(losses) - len(smooth)), smooth, color=line.get_color(),
             linewidth=1.8, label=f"{label}, mean of {args.smooth} steps")
  for label, losses in curves[1:]:
    n = min(len(base), len(losses))
    bottom.plot(np.arange(n), (base[:n] - losses[:n]) / losses[:n],
                label=f"{base_label} vs {label}", linewidth=1)
    a, b = moving_average(base[:n], args.smooth), moving_average(losses[:n], args.smooth)
    first = first_divergence(base, losses)
    tail = min(args.smooth, n)
    print(f"{base_label} vs {label} over {n} steps: first step differing by > 1e-3 relative: "
          f"{'none' if first is None else first}; max |relative difference| "
          f"{max_rel_diff(base, losses):.3e}; of the {args.smooth}-step means "
          f"{max_rel_diff(a, b):.3e}; mean of the last {tail} steps "
          f"{base[n - tail:n].mean():.4f} vs {losses[n - tail:n].mean():.4f}")
  top.set_ylabel("training loss")
  if args.title:
    top.set_title(args.title, fontsize=9)
  top.legend()
  bottom.set_xlabel("step")
  bottom.set_ylabel("relative diff")
  bottom.axhline(0, color="gray", linewidth=0.5)
  fig.tight_layout()
  fig.savefig(args.png, dpi=120)
  print(f"wrote {args.png}")


if __name__ == "__main__":
  main()
