"""Where the JSON record goes and how it is written."""
from __future__ import annotations

import datetime
import json
import pathlib

from jaxflux.bench.config import repo_root


def output_path(args, platform: str, tp: int, stamp: datetime.datetime) -> pathlib.Path:
  name = f"{args.op}_{'gpu' if platform in ('gpu', 'cuda', 'rocm') else platform}_tp{tp}_" \
         f"{stamp.strftime('%Y%m%dT%H%M%SZ')}.json"
  if args.out and args.out.endswith(".json"):
    return pathlib.Path(args.out)
  if args.out:
    return pathlib.Path(args.out) / name
  root = repo_root()
  base = root if (root / "pyproject.toml").is_file() else pathlib.Path.cwd()
  return base / "benchmarks" / "results" / name


def _rounded(obj):
  """Floats to 6 significant digits, so the JSON stays readable."""
  if isinstance(obj, float):
    return float(f"{obj:.6g}")
  if isinstance(obj, dict):
    return {k: _rounded(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_rounded(v) for v in obj]
  return obj


def _dumps(obj, indent: int = 0) -> str:
  """JSON with one key per line but lists of scalars on one line (readable diffs)."""
  pad = " " * (indent + 1)
  if isinstance(obj, dict) and obj:
    items = [f"{pad}{json.dumps(str(k))}: {_dumps(v, indent + 1)}" for k, v in obj.items()]
    return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
  if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
    items = [pad + _dumps(v, indent + 1) for v in obj]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
  return json.dumps(obj)


def write_json(path: pathlib.Path, result: dict) -> None:
  path.write_text(_dumps(_rounded(result)) + "\n")
