"""The README's Python examples run as written (they share one namespace, top to bottom)."""
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
