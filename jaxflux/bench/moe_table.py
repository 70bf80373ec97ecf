"""`--op moe`: the train step of the MoE layer (`jaxflux.MoE`, Linen), on one device.

Each row is one MoE block of a model: M tokens x [M, hidden] through `jaxflux.MoE` (router,
top-k routing, expert MLP on grouped matmuls, weighted sum over the k experts) with the block's
experts, experts per token, intermediate size and activation; params in float32 (the layer's
default param_dtype, as a mixed-precision training step keeps them), computation in --dtype.
The step, under `jax.jit`:

  loss(params, x) = mean(y * ct) + MOE_AUX_WEIGHT * load_balancing_loss
  step(params, x) = jax.value_and_grad(loss, argnums=(params, x))

with ct [M, hidden] a fixed standard-normal cotangent and load_balancing_loss the one the layer
sows (`intermediates/load_balancing_loss`). A call returns the loss, its two terms and every
gradient (gate, wi_*, wo and x), so the compiler can drop no part of the backward.
Variants, timed side by side (interleaved repeats) as for the other ops, on the same params and
inputs:
  fused        jaxflux.MoE(impl="fused"): the expert GEMMs on the fused grouped GEMM kernel,
               forward and backward; null, with the reason, where it cannot run
               (FusedKernelUnavailableError)
  ragged_dot   the same layer with impl="xla": lax.ragged_dot_general
  fused_gemms  the fused step's grouped GEMMs alone, on the kernel: the expert MLP's
               projections forward (x_rows [M*k, hidden] by each wi, h [M*k, I] by wo) and
               their dx and dw, on the router's group sizes of the first input set, weights
               already in --dtype; `outside_gemms_share` = 1 - its time / fused's, what the
               step spends on the router, sorts, permutes, casts, the activation and the
               combine (rows sorted by expert; fresh data, so no value is checked)
Checks, on the last warm-up call of each (same input set): the losses of the two variants and
their relative difference (`loss_rel_diff`, and `output_loss_rel_diff` for the mean(y * ct) term
alone: the load-balancing term comes from the router, the same program in both), and the
relative difference of each gradient, ||g_fused - g_ragged||_F / ||g_ragged||_F
(`grad_rel_diff`, the largest in `grad_rel_diff_max`); a difference above MOE_MAX_REL_DIFF is a
warning. FLOPs: 3x the forward's matmuls (router 2*M*hidden*E, expert MLP
2*M*k*hidden*I per projection), the usual forward + backward count.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from typing import Any, Callable, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxflux.bench.config import MOE_AUX_WEIGHT, MOE_PARAM_DTYPE, MOE_TABLE_M, MOE_VARIANTS
from jaxflux.bench.grouped_table import time_interleaved
from jaxflux.bench.inputs import random_input
from jaxflux.bench.measure import error_text, prepare
from jaxflux.bench.moe_record import LOSS_TERMS, STEP_VARIANTS, compare, summarize_row
from jaxflux.bench.timing import chain_kind
from jaxflux.bench.variants import Variant
from jaxflux.layers.moe_linen import MoE
from jaxflux.ops.grouped_matmul import grouped_matmul

_IMPLS = {"fused": "fused", "ragged_dot": "xla"}  # a step variant's layer impl


@dataclasses.dataclass(frozen=True)
class MoERow:
  """One row: M tokens [M, hidden] through an MoE block of `experts` experts, `top_k` per
  token, each an MLP of width `intermediate`; run on one device."""
  name: str
  M: int
  hidden: int
  intermediate: int
  experts: int
  top_k: int
  activation: str
  norm_topk_prob: bool
  dtype: str
  op: ClassVar[str] = "moe"
  tp: ClassVar[int] = 1
  param_dtype: ClassVar[str] = MOE_PARAM_DTYPE

  @property
  def weight_names(self) -> tuple[str, ...]:
    """The layer's params, in the order the variants take them."""
    return param_names(self.activation)

  @property
  def shapes(self) -> dict[str, tuple[int, ...]]:
    """Every array the variants take and its shape: x and ct in dtype, the params in
    param_dtype."""
    H, E, I = self.hidden, self.experts, self.intermediate
    wi = {n: (E, H, I) for n in self.weight_names[1:-1]}
    rows = self.M * self.top_k
    return {"x": (self.M, H), "ct": (self.M, H), "gate": (H, E), **wi, "wo": (E, I, H),
            # fused_gemms': the routed rows, the hidden rows, and the weights in dtype
            "x_rows": (rows, H), "h_rows": (rows, I), "dy_rows": (rows, H),
            **{f"{n}_{self.dtype}": (E, H, I) for n in wi}, f"wo_{self.dtype}": (E, I, H)}

  def inputs(self, variant: str) -> tuple[str, ...]:
    """A variant's inputs, in its order: fused_gemms' the rows, the group sizes and the expert
    kernels in the computation dtype; the train step's x, ct and the params."""
    if variant == "fused_gemms":
      return ("x_rows", "h_rows", "dy_rows", "group_sizes",
              *(f"{n}_{self.dtype}" for n in self.weight_names[1:]))
    return ("x", "ct", *self.weight_names)

  @property
  def gemm_flops(self) -> int:
    """fused_gemms' FLOPs: the expert projections, forward and backward (3x the forward)."""
    projections = len(self.weight_names) - 1  # all but the router
    return 3 * 2 * self.M * self.top_k * self.hidden * self.intermediate * projections

  @property
  def flops(self) -> int:
    """Matmul FLOPs of one step: 3x the forward's (router and expert MLP)."""
    return 3 * 2 * self.M * self.hidden * self.experts + self.gemm_flops

  def nbytes(self, name: str) -> int:
    dtype = self.param_dtype if name in self.weight_names else self.dtype
    return math.prod(self.shapes[name]) * jnp.dtype(dtype).itemsize

  def key(self) -> list:
    return [self.op, self.name, self.M, self.hidden, self.intermediate, self.experts,
            self.top_k, self.activation, self.norm_topk_prob, self.dtype]

  def describe(self) -> str:
    return (f"{self.op} {self.name} M={self.M} hidden={self.hidden} "
            f"intermediate={self.intermediate} E={self.experts} k={self.top_k} "
            f"{self.activation} tp={self.tp} {self.dtype}")


# --- rows ---------------------------------------------------------------------------------------

def build_rows(args, shapes: dict) -> list[MoERow]:
  """Every shapes.json "moe" block (--shapes filters) at each M (--M, default 4096 tokens)."""
  table = shapes.get("moe", [])
  if args.shapes:
    known = {s["name"] for s in table}
    if not set(args.shapes) <= known:
      raise ValueError(f"--shapes: unknown name(s) {sorted(set(args.shapes) - known)}; the "
                       f"shapes file's moe blocks are {sorted(known)}")
    table = [s for s in table if s["name"] in args.shapes]
  ms = args.M or list(MOE_TABLE_M)
  return [MoERow(s["name"], int(m), int(s["hidden"]), int(s["intermediate"]),
                 int(s["experts"]), int(s["top_k"]), s.get("activation", "swiglu"),
                 bool(s.get("norm_topk_prob", True)), args.dtype)
          for s in table for m in ms]


# --- the layer, the step, the inputs ------------------------------------------------------------

@functools.cache
def param_names(activation: str) -> tuple[str, ...]:
  """The layer's params with this activation, in the order it makes them (the router first,
  the output projection last): read off an abstract init of a small layer."""
  layer = MoE(num_experts=2, num_experts_per_tok=1, intermediate_size=8, activation=activation)
  shapes = jax.eval_shape(layer.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 8),
                                                                              jnp.float32))
  return tuple(shapes["params"])


def _layer(row: MoERow, impl: str) -> MoE:
  """The layer under test (a module function, so that tests can stand in for the fused
  kernel)."""
  return MoE(num_experts=row.experts, num_experts_per_tok=row.top_k,
             intermediate_size=row.intermediate, activation=row.activation,
             norm_topk_prob=row.norm_topk_prob, dtype=jnp.dtype(row.dtype),
             param_dtype=jnp.dtype(row.param_dtype), impl=impl)


def train_step(layer: MoE, weight_names: tuple[str, ...]) -> Callable:
  """(x, ct, *params) -> (losses [3] float32: LOSS_TERMS, grads {param: d, "x": dx}) of the loss
  in the module docstring."""

  def loss(params, x, ct):
    y, state = layer.apply({"params": params}, x, mutable=["intermediates"])
    output = jnp.mean(y.astype(jnp.float32) * ct.astype(jnp.float32))
    balance = state["intermediates"]["load_balancing_loss"][0]
    return output + MOE_AUX_WEIGHT * balance, (output, balance)

  def step(x, ct, *weights):
    params = dict(zip(weight_names, weights))
    (total, (output, balance)), (dparams, dx) = jax.value_and_grad(
        loss, argnums=(0, 1), has_aux=True)(params, x, ct)
    return jnp.stack([total, output, balance]), {**dparams, "x": dx}

  return step


def _grouped(x, w, sizes):
  """The kernel under test in fused_gemms (a module function, so that tests can stand in)."""
  return grouped_matmul(x, w, sizes, impl="fused")


def expert_gemms(x_rows, h_rows, dy_rows, sizes, *weights):
  """The expert MLP's grouped GEMMs of one step, without anything around them: each first
  projection x_rows @ wi and h_rows @ wo forward, and the dx and dw of each (dy_rows the
  cotangent of the second, h_rows' first columns reused for the first ones')."""
  *wi, wo = weights

  def forward(x, h, wi, wo):
    return [_grouped(x, w, sizes) for w in wi], _grouped(h, wo, sizes)

  (ys, z), vjp = jax.vjp(forward, x_rows, h_rows, tuple(wi), wo)
  return vjp(([h_rows.astype(y.dtype) for y in ys], dy_rows.astype(z.dtype)))


def make_variant(name: str, row: MoERow) -> Variant:
  """The variant `name` (one of MOE_VARIANTS); x (x_rows) comes first, the input a loop-mode
  chain makes depend on the previous call (through the output's first leaf)."""
  if name == "fused_gemms":
    return Variant(name, expert_gemms, row.inputs(name))
  fn = train_step(_layer(row, _IMPLS[name]), row.weight_names)
  return Variant(name, fn, row.inputs(name))


def set_count(row: MoERow, args, names: tuple[str, ...]) -> int:
  """Input sets the variants rotate among so that their calls do not run from L2: enough for the
  bytes of the inputs `names` (params included) to reach --rotate-mib, at most 8
  (inputs.input_set_count's rule). One in loop mode with the perturb chain: it makes each call
  depend on the previous call's loss only, so within a loop step every call but the last could
  lose its gradients."""
  if args.rotate_mib <= 0 or (args.timing == "loop" and chain_kind(args) == "perturb"):
    return 1
  nbytes = sum(row.nbytes(n) for n in names if n in row.shapes)
  return int(min(8, max(1, math.ceil(args.rotate_mib * 2**20 / max(1, nbytes)))))


def _initializer(row: MoERow, sharding: NamedSharding) -> Callable:
  """key -> the layer's params as its own initializers draw them (float32), compiled once per
  layer: the rows of a layer at several M share it."""
  return _layer_initializer(dataclasses.replace(row, M=1), sharding)


@functools.lru_cache(maxsize=16)
def _layer_initializer(row: MoERow, sharding: NamedSharding) -> Callable:
  layer = _layer(row, "xla")  # the params do not depend on impl
  probe = jnp.zeros((1, row.hidden), row.dtype)
  return jax.jit(lambda key: nn.unbox(layer.init(key, probe))["params"], out_shardings=sharding)


def make_inputs(row: MoERow, mesh: Mesh, n_sets: int, seed: int,
                gemms: bool = True) -> list[dict[str, jax.Array]]:
  """`n_sets` input sets, shared by every variant: x and ct fresh standard-normal data in the
  row's dtype, the params the layer's own initializers draw (float32), and the group sizes the
  router gives on the first set; with `gemms`, fused_gemms' rows x_rows, h_rows and dy_rows
  likewise and the expert params cast to the dtype."""
  sharding = NamedSharding(mesh, P())
  base = jax.random.fold_in(jax.random.key(seed), zlib.crc32(repr(row.key()).encode()) >> 1)
  init = _initializer(row, sharding)
  sets = []
  for s in range(n_sets):
    key = jax.random.fold_in(base, s)
    names = ("x", "ct") + (("x_rows", "h_rows", "dy_rows") if gemms else ())
    arrays = {name: random_input(row.shapes[name], row.dtype, sharding)(jax.random.fold_in(key, i))
              for i, name in enumerate(names)}
    params = init(jax.random.fold_in(key, len(names)))
    arrays.update({name: params[name] for name in row.weight_names})
    if gemms:
      arrays.update({f"{n}_{row.dtype}": params[n].astype(row.dtype) for n in row.weight_names
                     if n != "gate"})
    sets.append(arrays)
  sizes = jnp.asarray(expert_rows(row, sets[0]), jnp.int32)
  for arrays in sets:
    arrays["group_sizes"] = jax.device_put(sizes, sharding)
  jax.block_until_ready(sets)
  return sets


def expert_rows(row: MoERow, inputs: dict[str, jax.Array]) -> list[int]:
  """(token, expert) pairs per expert that the layer routes of an input set: its expert_load
  (both variants route alike: the router does not depend on impl)."""
  layer = _layer(row, "xla")

  def load(x, params):
    _, state = layer.apply({"params": params}, x, mutable=["intermediates"])
    return state["intermediates"]["expert_load"][0]

  params = {name: inputs[name] for name in row.weight_names}
  return [int(round(float(n))) for n in np.asarray(jax.jit(load)(inputs["x"], params))]


def _last_set(timed) -> int:
  """The input set of a timed run's last call (the loop's last call takes set 0; dispatched
  calls cycle through the sets)."""
  return 0 if timed.mode == "loop" else (timed.calls - 1) % len(timed.args)


# --- one row ------------------------------------------------------------------------------------

def bench_row(row: MoERow, mesh: Mesh, variants: list[str], args, log=print) -> dict:
  """Builds, warms up, checks and times the requested variants of one row on mesh's one device;
  returns the row's JSON record."""
  names = {n for v in MOE_VARIANTS if v in variants for n in row.inputs(v)}
  n_sets = set_count(row, args, tuple(names))
  input_sets = make_inputs(row, mesh, n_sets, args.seed, gemms="fused_gemms" in variants)
  errors: dict[str, str] = {}
  prepared: dict = {}
  outputs: dict[str, tuple[int, Any]] = {}
  losses: dict[str, dict[str, float]] = {}
  for name in (v for v in MOE_VARIANTS if v in variants):
    try:
      prep, y = prepare(make_variant(name, row), mesh, input_sets, args)
    except Exception as e:  # noqa: BLE001 - a variant that cannot run is recorded, never replaced
      errors[name] = error_text(e)
      continue
    prepared[name] = prep
    if name not in STEP_VARIANTS:  # fused_gemms: its GEMMs' time alone, no loss
      del y
      continue
    losses[name] = dict(zip(LOSS_TERMS, (float(v) for v in np.asarray(y[0], np.float64))))
    outputs[name] = (_last_set(prep.timed), y)
    del y
  checks = None
  if len(outputs) == 2:
    (set_f, y_f), (set_r, y_r) = outputs["fused"], outputs["ragged_dot"]
    try:
      if set_f != set_r:
        raise RuntimeError(f"the warm-up outputs come from input sets {set_f} and {set_r}")
      checks = compare(y_f, y_r)
    except Exception as e:  # noqa: BLE001 - the check's failure does not stop the timing
      errors["comparison"] = error_text(e)
    del y_f, y_r
  outputs.clear()
  rows_per_expert = [int(n) for n in np.asarray(input_sets[0]["group_sizes"])]
  samples = time_interleaved(prepared, args.repeats, errors)
  record = summarize_row(row, samples, errors, losses, checks,
                         {n: p.timed.calls for n, p in prepared.items()},
                         {n: round(p.compile_s, 3) for n, p in prepared.items()}, n_sets,
                         rows_per_expert)
  if args.timing == "device":
    record["device_queue_filled"] = {n: p.timed.queue_filled for n, p in prepared.items()}
  del prepared, input_sets
  return record


