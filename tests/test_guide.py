"""docs/guide.md: its Python blocks run as written, top to bottom in one namespace, in a fresh
Python process that asks for its 8 CPU devices itself (as the guide's first block tells a
reader to); then checks on that namespace compare what the guide computed with independent
references. Also: the guide's auto-rule numbers are the tuning table's."""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guide.md"

# Run after the guide's blocks, in their namespace: what the guide claims, checked against
# references computed here (plain flax.linen / NumPy on the same params).
CHECKS = r'''
import json as _json
import flax.linen as _nn

_out = {"devices": jax.device_count(), "platform": jax.devices()[0].platform}

# Train step: params laid out as documented, learning, and the same loss as a model built
# from flax.linen.Dense on the same params (the drop-in promise).
_out["up_spec"] = str(params["block0"]["up"]["kernel"].sharding.spec)
_out["down_spec"] = str(params["block0"]["down"]["kernel"].sharding.spec)
_out["losses"] = losses


class _RefBlock(_nn.Module):
  ffn: int

  @_nn.compact
  def __call__(self, x):
    h = _nn.Dense(self.ffn, name="up")(_nn.RMSNorm()(x))
    return x + _nn.Dense(x.shape[-1], name="down")(_nn.gelu(h))


class _RefLM(_nn.Module):
  @_nn.compact
  def __call__(self, tokens):
    x = _nn.Embed(64, 32, name="Embed_0")(tokens)
    for i in range(2):
      x = _RefBlock(128, name=f"block{i}")(x)
    return _nn.Dense(64, name="head")(_nn.RMSNorm(name="RMSNorm_0")(x))


_host = jax.device_get(params)
_batch = synthetic_batch(0)
_ref = _RefLM().apply({"params": _host}, _batch[:, :-1])
with jax.set_mesh(mesh):
  _got = jax.jit(lambda p, t: model.apply({"params": p}, t))(
      params, jax.device_put(_batch[:, :-1], data))
_out["lm_max_abs_diff"] = float(np.max(np.abs(np.asarray(_got) - np.asarray(_ref))))
_out["lm_ref_scale"] = float(np.max(np.abs(np.asarray(_ref))))

# Checkpoint: restored shardings are the params' own.
_out["restored_specs_match"] = all(
    a.sharding.is_equivalent_to(b.sharding, a.ndim)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)))

# nn.scan / nnx.scan: the same as applying the stacked layers one by one, unrolled, in NumPy.
def _np_block(p, x):
  norm = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * p["RMSNorm_0"]["scale"]
  h = norm @ p["up"]["kernel"] + p["up"]["bias"]
  h = np.asarray(jax.nn.gelu(h))
  return x + h @ p["down"]["kernel"] + p["down"]["bias"]

_x = np.asarray(x, np.float64)
_want = _x
_stacked = jax.device_get(stack_vars["params"]["block"])
for _i in range(3):
  _want = _np_block(jax.tree.map(lambda a: np.asarray(a[_i], np.float64), _stacked), _want)
_out["scan_max_abs_diff"] = float(np.max(np.abs(np.asarray(y) - _want)))
_out["scan_kernel_spec"] = str(stack_specs["params"]["block"]["up"]["kernel"])

_want = _x
_nnx_state = jax.device_get(nnx.to_pure_dict(nnx.state(blocks, nnx.Param)))
for _i in range(3):
  _p = jax.tree.map(lambda a: np.asarray(a[_i], np.float64), _nnx_state)
  _p["RMSNorm_0"] = _p.pop("norm")
  _want = _np_block(_p, _want)
_out["nnx_scan_max_abs_diff"] = float(np.max(np.abs(np.asarray(y_nnx) - _want)))
_out["nnx_kernel_spec"] = str(nnx.get_partition_spec(nnx.state(blocks))["up"]["kernel"].get_value())

# Mixed precision: bf16 output near the float32 computation, float32 grads.
_out["bf16_dtype"] = str(y_bf16.dtype)
_out["grad_dtypes"] = sorted({str(g.dtype) for g in jax.tree.leaves(mlp_grads)})
_out["bf16_rel_err"] = float(np.max(np.abs(np.asarray(y_bf16, np.float32) - np.asarray(y_fp32)))
                             / np.max(np.abs(np.asarray(y_fp32))))

# Logical axes / FSDP x TP: shardings of params, grads and moments; values and grads against
# the same block built from flax.linen.Dense, on the same params.
_spec = lambda a: str(a.sharding.spec)
_out["fsdp_specs"] = {
    "logical": str(logical["params"]["Dense_0"]["kernel"]),
    "up": _spec(fsdp_vars["params"]["Dense_0"]["kernel"]),
    "down": _spec(fsdp_vars["params"]["Dense_1"]["kernel"]),
    "up_bias": _spec(fsdp_vars["params"]["Dense_0"]["bias"]),
    "grad_up": _spec(fsdp_grads["params"]["Dense_0"]["kernel"]),
    "grad_down": _spec(fsdp_grads["params"]["Dense_1"]["kernel"]),
    "mu_up": _spec(fsdp_opt_state[0].mu["params"]["Dense_0"]["kernel"]),
}


class _RefFSDPBlock(_nn.Module):
  @_nn.compact
  def __call__(self, x):
    h = _nn.Dense(128, name="Dense_0")(_nn.RMSNorm(name="RMSNorm_0")(x))
    return x + _nn.Dense(x.shape[-1], name="Dense_1")(_nn.gelu(h))


_v = jax.device_get(fsdp_vars)
_xh = np.asarray(x_fsdp)
_ref_loss = lambda v: jnp.mean(_RefFSDPBlock().apply(v, _xh) ** 2)
with jax.set_mesh(fsdp_mesh), nn.logical_axis_rules(rules):
  _loss, _g = jax.jit(jax.value_and_grad(
      lambda v, x: jnp.mean(fsdp_block.apply(v, x) ** 2)))(fsdp_vars, x_fsdp)
_rl, _rg = jax.value_and_grad(_ref_loss)(_v)
_out["fsdp_loss_rel_err"] = abs(float(_loss) - float(_rl)) / abs(float(_rl))
_out["fsdp_grad_max_err"] = max(
    float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(1e-30, np.max(np.abs(np.asarray(b)))))
    for a, b in zip(jax.tree.leaves(_g), jax.tree.leaves(_rg)))
_out["rule_error"] = rule_error
_k, _b = np.asarray(nnx_up.kernel[...]), np.asarray(nnx_up.bias[...])
_out["nnx_fsdp_spec"] = [_spec(nnx_up.kernel[...]), nnx_up.axis_name]
_out["nnx_fsdp_max_err"] = float(np.max(np.abs(np.asarray(nnx_y) - (_xh @ _k + _b))))

_out["fused_error"] = fused_error
_out["fused_calls"] = fused_calls
print("GUIDE-CHECKS " + _json.dumps(_out))
'''


def guide_blocks() -> list[str]:
  return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)


# Every test of the guide's run is the slow tier's: the run takes about 25 s on 2 cores, the
# largest single cost of the README's test command.
@pytest.fixture(scope="module")
def guide_run(tmp_path_factory):
  """Runs the guide's blocks plus CHECKS in a fresh interpreter on 8 virtual CPU devices."""
  blocks = guide_blocks()
  assert len(blocks) >= 8, "the guide lost its examples"
  script = tmp_path_factory.mktemp("guide") / "guide_blocks.py"
  script.write_text("\n\n".join(blocks) + "\n\n" + CHECKS)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"  # the guide's own device-count setting does the rest
  proc = subprocess.run([sys.executable, str(script)], cwd=script.parent, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
  line = next(l for l in proc.stdout.splitlines() if l.startswith("GUIDE-CHECKS "))
  return json.loads(line.removeprefix("GUIDE-CHECKS "))


@pytest.mark.slow
def test_guide_runs_on_8_cpu_devices(guide_run):
  assert guide_run["devices"] == 8 and guide_run["platform"] == "cpu"


@pytest.mark.slow
def test_train_step_lays_out_learns_and_matches_flax(guide_run):
  assert guide_run["up_spec"] == "P(None, 'tp')", guide_run["up_spec"]
  assert guide_run["down_spec"] == "P('tp', None)", guide_run["down_spec"]
  losses = guide_run["losses"]
  assert len(losses) == 8 and sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, losses
  # The jaxflux model equals the same model built from flax.linen on the trained params.
  assert guide_run["lm_max_abs_diff"] <= 1e-4 * max(1.0, guide_run["lm_ref_scale"]), guide_run


@pytest.mark.slow
def test_checkpoint_restores_onto_the_mesh(guide_run):
  assert guide_run["restored_specs_match"]


@pytest.mark.slow
def test_scans_match_unrolled_layers(guide_run):
  assert guide_run["scan_kernel_spec"] == "P(None, None, 'tp')"
  assert guide_run["nnx_kernel_spec"] == "P(None, None, 'tp')"
  assert guide_run["scan_max_abs_diff"] < 1e-4, guide_run["scan_max_abs_diff"]
  assert guide_run["nnx_scan_max_abs_diff"] < 1e-4, guide_run["nnx_scan_max_abs_diff"]


@pytest.mark.slow
def test_logical_axes_fsdp_by_tp(guide_run):
  specs = guide_run["fsdp_specs"]
  assert specs == {"logical": "P('embed', 'mlp')", "up": "P('fsdp', 'tp')",
                   "down": "P('tp', 'fsdp')", "up_bias": "P('tp',)",
                   "grad_up": "P('fsdp', 'tp')", "grad_down": "P('tp', 'fsdp')",
                   "mu_up": "P('fsdp', 'tp')"}, specs
  assert guide_run["fsdp_loss_rel_err"] < 1e-5, guide_run["fsdp_loss_rel_err"]
  assert guide_run["fsdp_grad_max_err"] < 1e-4, guide_run["fsdp_grad_max_err"]
  assert "logical axis 'mlp', which maps to no mesh axis" in guide_run["rule_error"]
  assert guide_run["nnx_fsdp_spec"] == ["P('fsdp', 'tp')", "tp"]
  assert guide_run["nnx_fsdp_max_err"] < 1e-4, guide_run["nnx_fsdp_max_err"]


@pytest.mark.slow
def test_mixed_precision(guide_run):
  assert guide_run["bf16_dtype"] == "bfloat16"
  assert guide_run["grad_dtypes"] == ["float32"]
  assert 0 < guide_run["bf16_rel_err"] < 5e-2, guide_run["bf16_rel_err"]


@pytest.mark.slow
def test_what_runs_where_on_cpu(guide_run):
  assert guide_run["fused_calls"] == []
  assert "all_gather_matmul(impl='fused')" in guide_run["fused_error"]
  assert "CUDA" in guide_run["fused_error"]


def test_guide_states_the_tuning_tables_auto_rules():
  """The 'what runs where' table quotes every AUTO_RULES rule: op, tp, rows, operands and
  kind of GPU."""
  from jaxflux.tuning import AUTO_RULES

  text = GUIDE.read_text()
  table = text[text.index("## What runs where"):]
  for rule in AUTO_RULES:
    rows = f" to {rule.max_rows} rows" if rule.max_rows is not None else ""
    assert f"`{rule.op}` from {rule.min_rows}{rows}" in table, rule
    assert (f"tp = {rule.tp}" if rule.tp != "*" else "at any tp") in table, rule
    if rule.operands == "fp8":
      assert "with FP8 operands" in table, rule
    if rule.device != "*":
      kind = {"h100_sxm": "on an H100", "h200": "on an H200"}[rule.device]
      assert kind in table, rule
    if rule.max_rows_times_k is not None:
      exponent = rule.max_rows_times_k.bit_length() - 1
      assert rule.max_rows_times_k == 2 ** exponent
      sup = str(exponent).translate(str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹"))
      assert f"2{sup}" in table, rule
