"""Device tables: the kernel choices measured on one kind of GPU, as JSON files.

A device table holds the GEMM fields (the all-gather tile and swizzle, the own-rows schedule and
swizzle) that the tuning sweep picked on one device kind, per shape class and, where a shape's
own best beat its class's choice, per exact shape. The choices it does not hold (how GEMM+RS
reduces and pushes, GEMM+AllReduce's tiles) come from the sm90 defaults (table.py).

Where the tables are, most specific first:
  user     <tuning dir>/<device slug>.json, written by `python -m jaxflux.tune`. The tuning dir
           is $JAXFLUX_TUNING_DIR, else $XDG_CACHE_HOME/jaxflux/tuning, else
           ~/.cache/jaxflux/tuning.
  shipped  jaxflux/tuning/tables/<name>.json for the kinds in device.SHIPPED_TABLES.
Each is read once per process (`reload()` reads them again). A table that can't be read, or a
user table measured on another kind, is skipped with a logged warning (never an error inside a
trace), and `jaxflux.tuning.describe()` lists what was skipped.

Every process of a fused op must choose alike: a choice is a pure function of the tables and the
shape, so the processes of one host that see the same files choose the same kernels.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib

from jaxflux.tuning.device import Device
from jaxflux.tuning.fields import check_fields, shape_classes

FORMAT = "jaxflux.tuning/1"
ENV_DIR = "JAXFLUX_TUNING_DIR"
SHIPPED_DIR = pathlib.Path(__file__).resolve().parent / "tables"
# The fields a device table may set: the GEMM's, which the one-GPU sweep measures.
TUNED_FIELDS = {"all_gather_matmul": ("tile", "swizzle"),
                "matmul_reduce_scatter": ("own_rows_schedule", "own_rows_swizzle")}

log = logging.getLogger("jaxflux.tuning")


class TableError(ValueError):
  """A device table file that can't be used, with its path and the reason."""


@dataclasses.dataclass(frozen=True)
class ClassEntry:
  op: str
  dtype: str
  tp: int
  shape_class: str
  choice: dict       # a subset of TUNED_FIELDS[op]
  ratio: float       # geometric mean over the class's rows of time / cuBLAS's


@dataclasses.dataclass(frozen=True)
class ShapeEntry:
  op: str
  dtype: str
  tp: int
  problem: tuple     # (rows, k, n) of the per-device GEMM (all_gather_matmul: gathered rows)
  choice: dict
  ratio: float       # time / cuBLAS's of this choice on this shape


@dataclasses.dataclass(frozen=True)
class DeviceTable:
  origin: str        # "user" | "shipped"
  path: pathlib.Path
  device: dict       # Device fields of the GPU it was measured on
  measured: dict     # command, date, versions, sweep file
  classes: tuple
  shapes: tuple
  digest: str        # sha256 of the file's bytes

  def fields(self, op: str, dtype: str, tp: int, shape_class: str, problem: tuple | None,
             band_rows: int) -> dict | None:
    """The tuned fields for a call: its exact shape's entry, else its class's (its swizzle
    fitted to `band_rows`, see `fit_swizzle`), else None."""
    if problem is not None:
      for e in self.shapes:
        if (e.op, e.dtype, e.tp, e.problem) == (op, dtype, tp, tuple(problem)):
          return dict(e.choice)
    for e in self.classes:
      if (e.op, e.dtype, e.tp, e.shape_class) == (op, dtype, tp, shape_class):
        return fit_swizzle(op, dict(e.choice), band_rows)
    return None


# Rows of one cluster row of tiles: 2 x 128 for the cooperative 2x1 clusters, 128 for the
# all-gather ping-pong tile's 1x2 cluster.
_CLUSTER_ROWS = {"cooperative_128x256_cluster2x1": 256, "pingpong_128x128_cluster1x2": 128,
                 "cooperative": 256, "pingpong": 128}
_SWIZZLE_FIELD = {"all_gather_matmul": ("tile", "swizzle"),
                  "matmul_reduce_scatter": ("own_rows_schedule", "own_rows_swizzle")}


def fit_swizzle(op: str, fields: dict, rows: int) -> dict:
  """A class entry's swizzle, halved until its band (swizzle cluster rows of tiles) divides
  `rows` (the rows a band sweeps: a shard's for the all-gather GEMM, the own rows for GEMM+RS;
  0: unknown, kept). A class is measured on a few shapes, and a band that overhangs the rows
  pads the grid: swizzle 8 (bands of 2048 rows) took 2.1-2.3x cuBLAS's time on 1024 own rows
  on H100 SXM, where swizzle 1-4 took 1.01-1.03x (h100_gemm_candidates.json)."""
  tile_field, swizzle_field = _SWIZZLE_FIELD[op]
  swizzle = fields.get(swizzle_field)
  if swizzle is None or rows <= 0:
    return fields
  cluster_rows = _CLUSTER_ROWS[fields.get(tile_field, "cooperative")]
  while swizzle > 1 and rows % (swizzle * cluster_rows):
    swizzle //= 2
  return {**fields, swizzle_field: swizzle}


def user_dir() -> pathlib.Path:
  """Where `python -m jaxflux.tune` writes and the library reads user tables."""
  if directory := os.environ.get(ENV_DIR):
    return pathlib.Path(directory).expanduser()
  cache = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
  return pathlib.Path(cache) / "jaxflux" / "tuning"


def user_path(device: Device) -> pathlib.Path:
  return user_dir() / f"{device.slug}.json"


def shipped_path(name: str) -> pathlib.Path:
  return SHIPPED_DIR / f"{name}.json"


# --- the file format --------------------------------------------------------------------------

def to_json(device: Device, measured: dict, classes, shapes) -> str:
  """The text of a device table."""
  doc = {"format": FORMAT, "device": device.as_dict(), "measured": measured,
         "classes": [dataclasses.asdict(e) for e in classes],
         "shapes": [{**dataclasses.asdict(e), "problem": list(e.problem)} for e in shapes]}
  return json.dumps(doc, indent=1) + "\n"


def read(path: pathlib.Path, origin: str) -> DeviceTable:
  """A device table from its file; TableError naming the path and the fault otherwise."""
  try:
    raw = path.read_bytes()
    doc = json.loads(raw)
  except (OSError, ValueError) as e:
    raise TableError(f"jaxflux.tuning: can't read the device table {path}: {e}") from e
  try:
    return _parse(doc, path, origin, hashlib.sha256(raw).hexdigest())
  except (KeyError, TypeError, ValueError) as e:
    raise TableError(f"jaxflux.tuning: the device table {path} is not a valid {FORMAT} table "
                     f"({type(e).__name__}: {e}). Write it again with python -m jaxflux.tune."
                     ) from e


def _parse(doc: dict, path: pathlib.Path, origin: str, digest: str) -> DeviceTable:
  if doc.get("format") != FORMAT:
    raise ValueError(f"format is {doc.get('format')!r}, not {FORMAT!r}")
  device = Device(**doc["device"])

  def choice(op: str, fields: dict) -> dict:
    if op not in TUNED_FIELDS:
      raise ValueError(f"op {op!r}: a device table tunes {tuple(TUNED_FIELDS)}")
    if not set(fields) <= set(TUNED_FIELDS[op]):
      raise ValueError(f"{op}: fields {sorted(fields)}; a device table sets "
                       f"{TUNED_FIELDS[op]}")
    check_fields(op, fields)
    return dict(fields)

  classes = tuple(ClassEntry(e["op"], str(e["dtype"]), int(e["tp"]), str(e["shape_class"]),
                             choice(e["op"], e["choice"]), float(e["ratio"]))
                  for e in doc["classes"])
  for e in classes:
    if e.shape_class not in shape_classes(e.op):
      raise ValueError(f"{e.op}: unknown shape class {e.shape_class!r}")
  shapes = tuple(ShapeEntry(e["op"], str(e["dtype"]), int(e["tp"]),
                            tuple(int(v) for v in e["problem"]), choice(e["op"], e["choice"]),
                            float(e["ratio"])) for e in doc["shapes"])
  for e in shapes:
    if len(e.problem) != 3:
      raise ValueError(f"{e.op}: problem {e.problem} is not (rows, k, n)")
  return DeviceTable(origin, path, device.as_dict(), dict(doc.get("measured", {})), classes,
                     shapes, digest)


# --- which tables a device uses -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Active:
  """The device tables the kernel choices come from on one device, most specific first, and
  why (what was found, skipped or missing)."""
  device: Device | None
  tables: tuple
  notes: tuple

  def describe(self) -> str:
    if self.device is None:
      head = "no GPU: the sm90 defaults (jaxflux/tuning/table.py)"
    else:
      head = (f"{self.device.kind} (compute capability {self.device.compute_capability}, "
              f"{self.device.sms} SMs)")
    lines = [f"jaxflux.tuning on {head}:"]
    lines += [f"  {t.origin} table {t.path} (measured {t.measured.get('date', '?')}, "
              f"{len(t.classes)} class and {len(t.shapes)} shape entries)" for t in self.tables]
    lines += [f"  {note}" for note in self.notes]
    lines.append("  then the sm90 defaults (jaxflux/tuning/table.py) for every other choice")
    return "\n".join(lines)

  @property
  def digest(self) -> str:
    """One hash of the tables in use: processes that agree on it choose alike."""
    return hashlib.sha256(" ".join(t.digest for t in self.tables).encode()).hexdigest()[:16]


def active(device: Device | None) -> Active:
  return _active(device, str(user_dir()))


def reload() -> None:
  """Forgets the tables read so far: the next choice reads them again (after a tune)."""
  _active.cache_clear()


@functools.cache
def _active(device: Device | None, directory: str) -> Active:
  if device is None:
    return Active(None, (), ())
  tables, notes = [], []
  path = pathlib.Path(directory) / f"{device.slug}.json"
  if path.is_file():
    try:
      table = read(path, "user")
    except TableError as e:
      notes.append(f"skipped: {e}")
      log.warning("%s; using the shipped choices instead.", e)
    else:
      if table.device["kind"] != device.kind:
        note = (f"skipped the user table {path}: measured on {table.device['kind']!r}, this GPU "
                f"is {device.kind!r}")
        notes.append(note)
        log.warning("jaxflux.tuning: %s.", note)
      else:
        tables.append(table)
  else:
    notes.append(f"no user table at {path} (python -m jaxflux.tune writes one)")
  if device.shipped_table is not None:
    try:
      tables.append(read(shipped_path(device.shipped_table), "shipped"))
    except TableError as e:  # a broken install: say so, and choose as for an unknown GPU
      notes.append(f"skipped: {e}")
      log.warning("%s; using the sm90 defaults instead.", e)
  else:
    notes.append(f"no shipped table for {device.kind!r}: the sm90 defaults, which are the "
                 "choices best on every measured device")
  return Active(device, tuple(tables), tuple(notes))
