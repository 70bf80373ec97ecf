"""The README: its Python examples run as written (they share one namespace, top to bottom), it
keeps the two commands and the generated tables' markers, and names no removed setting."""
import pathlib
import re

import jax.numpy as jnp
import numpy as np

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_blocks_run():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
  assert len(blocks) >= 2, "README lost its usage examples"
  ns: dict = {}
  for block in blocks:
    exec(compile(block, str(README), "exec"), ns)  # noqa: S102 - our own documentation
  # The shard_map example computes the MLP it claims to.
  rng = np.random.default_rng(0)
  x = rng.standard_normal((64, 32), np.float32)
  w1 = rng.standard_normal((32, 128), np.float32)
  w2 = rng.standard_normal((128, 32), np.float32)
  want = np.asarray(ns["jax"].nn.gelu(jnp.asarray(x) @ w1)) @ w2
  np.testing.assert_allclose(ns["f"](x, w1, w2), want, rtol=1e-4, atol=1e-3)
  assert "params" in ns["params"]


COMMANDS = (
    'python3 -m venv .venv && .venv/bin/pip install -e ".[test]" && '
    '.venv/bin/python examples/train_tp_transformer.py',
    'python3 -m venv .venv && .venv/bin/pip install -e ".[test]" && '
    '.venv/bin/python -m pytest -q -m "not slow"',
)


def test_readme_keeps_the_two_commands_and_the_table_markers():
  text = README.read_text()
  lines = text.splitlines()
  for command in COMMANDS:
    assert command in lines, f"README lost the command: {command}"
  for table in ("ops_h200x2", "gemm_h200"):
    start, end = f"<!-- table:{table} -->", f"<!-- end table:{table} -->"
    assert text.count(start) == 1 and text.count(end) == 1, table
    assert text.index(start) < text.index(end), table


def test_readme_names_only_existing_environment_variables():
  # JAXFLUX_CUDA (build), JAXFLUX_DEBUG (runtime) and JAXFLUX_TUNING_DIR (where device tables
  # are read) are the only ones there are.
  names = set(re.findall(r"JAXFLUX_[A-Z0-9_]+", README.read_text()))
  assert names <= {"JAXFLUX_CUDA", "JAXFLUX_DEBUG", "JAXFLUX_TUNING_DIR"}, names
