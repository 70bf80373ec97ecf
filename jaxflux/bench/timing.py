"""Timed runs of a variant: calls chained in one jitted loop, or dispatched one by one."""
from __future__ import annotations

import math
import time
from typing import Callable

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxflux.bench import device_clock, processes
from jaxflux.bench.config import AXIS
from jaxflux.bench.machine import is_gpu
from jaxflux.bench.variants import Variant


def chain_kind(args) -> str:
  """--chain auto: the free barrier on GPU, the data dependency elsewhere (see `_chain`)."""
  if args.chain != "auto":
    return args.chain
  return "barrier" if is_gpu() else "perturb"


def _chain(fn: Callable, sets: list[tuple], n_outer: int, chain: str, eps,
           constrain: Callable = lambda a: a):
  """Calls fn on sets[0], then n_outer times on each of sets[1:] + sets[:1] in turn, every
  call made to depend on the previous call's output y, so that XLA can neither hoist a call out
  of the loop, merge calls on the same inputs, nor overlap one call with the next.

  chain "barrier": the first input passes through `lax.optimization_barrier` with y. Free at
    run time; relies on the barrier surviving XLA's loop optimizations, which holds on GPU (the
    GPU compiler removes barriers only after scheduling) but not on CPU (seen: the CPU compiler
    hoisted the whole loop body out).
  chain "perturb": adds eps * y[0, ..., 0] (eps a run-time 0.0 the compiler cannot see) to
    element [0, ..., 0] of the first input, in place: a true data dependency on any platform,
    for the price of one tiny kernel per call.
  """
  order = list(range(1, len(sets))) + [0]

  def depend(args, y):
    first = args[0]
    if chain == "barrier":  # only the first input: the others need not pass through it
      first, _ = lax.optimization_barrier((first, y))
      return (first,) + tuple(args[1:])
    corner = (0,) * first.ndim
    out = jax.tree.leaves(y)[0]  # a variant may return several arrays (the quantizing pass)
    nudge = (eps * out[(0,) * out.ndim].astype(eps.dtype)).astype(first.dtype)
    first = lax.dynamic_update_slice(first, first[tuple(slice(0, 1) for _ in corner)] + nudge,
                                     corner)
    return (first,) + tuple(args[1:])

  perturb = chain == "perturb"

  def body(_, carry):
    # Under "perturb" the nudged first inputs are carried, so each call sees the last nudge.
    firsts, y = carry
    firsts = list(firsts)
    for s in order:
      first = firsts[s] if perturb else sets[s][0]
      args = constrain(depend((first,) + tuple(sets[s][1:]), y))
      if perturb:
        firsts[s] = args[0]
      y = constrain(fn(*args))
    return tuple(firsts), y

  y = constrain(fn(*sets[0]))
  firsts = tuple(s[0] for s in sets) if perturb else ()
  return lax.fori_loop(0, n_outer, body, (firsts, y))[1]


class Timed:
  """A compiled timed run of one variant: `calls` op invocations, one sync at the end.

  mode "loop": one jitted program runs the calls in a `lax.fori_loop` (see `_chain`), so there
    is no per-call dispatch at all; this is the default and suits any op size.
  mode "dispatch": a Python loop dispatches a jitted single call `calls` times asynchronously,
    then blocks once; fine for ms-scale ops, but host
    dispatch (tens of µs a call) shows through on small ones. On CPU every call is waited for
    (queued multi-device CPU programs can deadlock in XLA's in-process collectives).
  mode "device" (GPU): the calls of "dispatch", timed by the GPUs' own clocks read in stream
    order before and after them (jaxflux/bench/device_clock.py), the first read idling the
    streams until the host has queued every call.
  """

  def __init__(self, variant: Variant, mesh: Mesh, input_sets: list[dict], iters: int, mode: str,
               chain: str):
    self.variant = variant
    self.mode = mode
    self.sync_each = mode == "dispatch" and not is_gpu()
    self.clock = None
    self.queue_filled = None  # device mode: did the host queue every call within the idle time?
    n_sets = len(input_sets)
    self.args = [tuple(s[n] for n in variant.inputs) for s in input_sets]
    out_sharding = None
    if variant.gspmd_out_spec is not None:
      out_sharding = NamedSharding(mesh, variant.gspmd_out_spec)
      in_shardings = tuple(a.sharding for a in self.args[0])

      def constrain(t):
        if isinstance(t, tuple):
          return tuple(lax.with_sharding_constraint(a, s) for a, s in zip(t, in_shardings))
        return lax.with_sharding_constraint(t, out_sharding)
    else:
      constrain = lambda t: t  # noqa: E731
    layouts = tuple(a.sharding.spec for a in self.args[0])

    def compile_(f, in_specs):
      if variant.gspmd_out_spec is not None:
        return jax.jit(f, out_shardings=out_sharding)
      return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=P(AXIS),
                                   check_vma=variant.check_vma))

    if mode == "loop":
      self.n_outer = max(1, math.ceil((iters - 1) / n_sets))
      self.calls = 1 + self.n_outer * n_sets
      n_outer, k = self.n_outer, len(variant.inputs)

      def program(eps, *flat):
        sets = [tuple(flat[i * k:(i + 1) * k]) for i in range(n_sets)]
        return _chain(variant.fn, sets, n_outer, chain, eps, constrain)

      self._program = compile_(program, (P(),) + layouts * n_sets)
      eps_sharding = NamedSharding(mesh, P())
      self._flat = [jax.device_put(np.zeros((), np.float32), eps_sharding)]
      self._flat += [a for s in self.args for a in s]
    elif mode in ("dispatch", "device"):
      self.calls = max(1, iters)
      self._program = compile_(variant.fn, layouts)
      if mode == "device":
        self.clock = device_clock.DeviceClock(mesh)
        # Both reads compiled here, not inside a timed run.
        for spin_ns in (device_clock.spin_ns_for(self.calls), 0):
          self.clock.read(spin_ns).block_until_ready()
    else:
      raise ValueError(f"--timing {mode!r}: use 'loop', 'dispatch' or 'device'")

  def run(self):
    """Queues one timed run and returns its last output, an array or a tuple of arrays (not
    waited for)."""
    if self.mode == "loop":
      return self._program(*self._flat)
    y = None
    for c in range(self.calls):
      y = self._program(*self.args[c % len(self.args)])
      if self.sync_each:
        jax.block_until_ready(y)
    return y

  def time_ms(self) -> float:
    """Milliseconds per call of one timed run (the slowest process's, under jax.distributed)."""
    if self.clock is not None:
      return processes.max_over_processes(self._device_time_ms())
    t0 = time.perf_counter()
    jax.block_until_ready(self.run())
    return processes.max_over_processes((time.perf_counter() - t0) * 1e3 / self.calls)

  def _device_time_ms(self) -> float:
    spin_ns = device_clock.spin_ns_for(self.calls)
    host_start = time.perf_counter()
    start = self.clock.read(spin_ns)
    self.run()
    end = self.clock.read()
    queued_s = time.perf_counter() - host_start
    end.block_until_ready()
    # Were all calls queued before the GPUs left the idle read? If not, the host still showed.
    filled = processes.all_processes(queued_s < spin_ns * 1e-9)
    self.queue_filled = filled if self.queue_filled is None else (self.queue_filled and filled)
    return device_clock.elapsed_ms_per_call(start, end, self.calls)

  def hlo_text(self) -> str:
    if self.mode == "loop":
      return self._program.lower(*self._flat).compile().as_text()
    return self._program.lower(*self.args[0]).compile().as_text()
