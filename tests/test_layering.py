"""The package's layering, read from the source with ast (imports inside functions included):
no import cycle among jaxflux modules, the ops and the tuning table below the layers and the
benchmark, the tuning table below the ops, the benchmark on the public modules of the ops,
layers and tuning table, and no file of jaxflux/ or xla_ffi/ over 500 lines."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxflux"
MAX_LINES = 500


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
EXTENSIONS = {"jaxflux._jaxflux"}  # the native extension: compiled, imports no Python module


def _is_package(name: str) -> bool:
  return MODULES[name].name == "__init__.py"


def _target(name: str) -> str | None:
  """The jaxflux module `name` names (a non-module attribute: its module), or None outside."""
  while name and name not in MODULES:
    name = name.rpartition(".")[0]
  return name or None


def _imports(name: str) -> set:
  """The jaxflux modules `name` imports anywhere in its source (importlib.import_module with a
  literal name counts too)."""
  tree = ast.parse(MODULES[name].read_text())
  package = name if _is_package(name) else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")
        anchor = anchor[:len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
      for alias in node.names:
        full = f"{base}.{alias.name}"
        if full not in EXTENSIONS:
          found.add(full if full in MODULES else base)
    elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
          and node.args and isinstance(node.args[0], ast.Constant)):
      found.add(node.args[0].value)
  return {t for t in map(_target, found) if t is not None and t != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _reachable(start: str) -> set:
  seen, todo = set(), [start]
  while todo:
    for nxt in GRAPH[todo.pop()]:
      if nxt not in seen:
        seen.add(nxt)
        todo.append(nxt)
  return seen


def test_the_graph_sees_the_modules():
  assert "jaxflux.ops._fused" in GRAPH["jaxflux.ops._differentiable"]
  assert "jaxflux.tuning.table" in GRAPH["jaxflux.tuning"]
  assert "jaxflux.layers.linen" in GRAPH["jaxflux"]  # the lazy import inside __getattr__


def test_no_import_cycle():
  cycles = sorted(name for name in GRAPH if name in _reachable(name))
  assert not cycles, f"modules on an import cycle: {cycles}"


@pytest.mark.parametrize("layer", ["jaxflux.ops", "jaxflux.tuning"])
def test_ops_and_tuning_stay_below_the_layers_and_the_benchmark(layer):
  above = ("jaxflux.layers", "jaxflux.nnx", "jaxflux.bench")
  for name in GRAPH:
    if name == layer or name.startswith(layer + "."):
      bad = sorted(m for m in _reachable(name) | {name}
                   if any(m == a or m.startswith(a + ".") for a in above))
      assert not bad, f"{name} reaches {bad}"


def test_tuning_imports_nothing_from_the_ops():
  for name in GRAPH:
    if name == "jaxflux.tuning" or name.startswith("jaxflux.tuning."):
      bad = sorted(m for m in _reachable(name) if m.startswith("jaxflux.ops"))
      assert not bad, f"{name} reaches {bad}"


def test_the_benchmark_uses_the_ops_layers_and_tuning_through_their_public_modules():
  # What the benchmark and the tune command time is what users run: no private module of the
  # ops, the layers or the tuning table (jaxflux._runtime, the native module's face, is theirs
  # too: the device clock is one of its targets).
  tools = ("jaxflux.bench", "jaxflux.tune")
  libraries = ("jaxflux.ops", "jaxflux.layers", "jaxflux.tuning")
  bad = {}
  for name in GRAPH:
    if any(name == t or name.startswith(t + ".") for t in tools):
      private = sorted(m for m in GRAPH[name]
                       if any(m.startswith(lib + ".") for lib in libraries)
                       and any(part.startswith("_") for part in m.split(".")[2:]))
      if private:
        bad[name] = private
  assert not bad, bad


def test_no_file_is_over_500_lines():
  long = {}
  for top in ("jaxflux", "xla_ffi"):
    for path in (ROOT / top).rglob("*"):
      if path.is_file() and path.suffix in (".py", ".cc", ".h", ".cu", ".cuh"):
        lines = len(path.read_text(errors="replace").splitlines())
        if lines > MAX_LINES:
          long[str(path.relative_to(ROOT))] = lines
  assert not long, long
