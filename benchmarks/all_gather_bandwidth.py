"""Copy-engine all-gather (jaxflux) vs lax.all_gather, bandwidth per shard size.

python benchmarks/all_gather_bandwidth.py --out results.json [--mib 16 64] [--calls 50] [--reps 7]
Per variant: warm-up, then `reps` times: `calls` calls queued, one sync; median ms per call.
GB/s = bytes each device receives ((tp-1) * shard) / time.
"""
import argparse
import datetime
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jaxflux.ops.all_gather import all_gather


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--mib", type=int, nargs="+", default=[16, 64])
  ap.add_argument("--calls", type=int, default=50)
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  devices = jax.devices("gpu")
  tp = len(devices)
  mesh = Mesh(np.asarray(devices), ("tp",))
  rows = []
  for mib in args.mib:
    k = 8192
    m = mib * (1 << 20) // (2 * k)
    x = jax.random.normal(jax.random.key(0), (tp * m, k), jnp.float32).astype(jnp.bfloat16)
    x = jax.device_put(x, jax.NamedSharding(mesh, P("tp")))
    times = {}
    fns = {impl: jax.jit(jax.shard_map(lambda x, impl=impl: all_gather(x, "tp", impl=impl),
                                       mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
           for impl in ("xla", "fused")}
    for fn in fns.values():
      for _ in range(5):
        out = fn(x)
      out.block_until_ready()
    samples = {impl: [] for impl in fns}
    for _ in range(args.reps):  # interleaved so clocks/thermal drift hit both alike
      for impl, fn in fns.items():
        t0 = time.perf_counter()
        for _ in range(args.calls):
          out = fn(x)
        out.block_until_ready()
        samples[impl].append((time.perf_counter() - t0) / args.calls * 1e3)
    recv = (tp - 1) * m * k * 2
    row = {"op": "all_gather", "shard_mib": mib, "shape": [m, k], "tp": tp, "dtype": "bfloat16"}
    for impl, s in samples.items():
      ms = statistics.median(s)
      row[f"{impl}_ms"] = ms
      row[f"{impl}_ms_min_max"] = [min(s), max(s)]
      row[f"{impl}_gbps"] = recv / (ms * 1e-3) / 1e9
    row["speedup_vs_xla"] = row["xla_ms"] / row["fused_ms"]
    print(json.dumps(row), flush=True)
    rows.append(row)
  result = {"command": "python benchmarks/all_gather_bandwidth.py " + " ".join(
      f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()
      if v is not None),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "gpu": devices[0].device_kind, "jax": jax.__version__, "rows": rows}
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
