"""Smallest end-to-end check of the fused all-gather, for diagnosing a new machine or jaxlib.

JAXFLUX_DEBUG=1 python benchmarks/all_gather_smoke.py state|site
Dumps all thread stacks and exits if it hangs (SMOKE_DUMP_S, default 45 s).
"""
import faulthandler
import os
import sys

faulthandler.enable()
faulthandler.dump_traceback_later(int(os.environ.get("SMOKE_DUMP_S", "45")), exit=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import jaxflux  # noqa: E402
from jaxflux import _runtime  # noqa: E402
from jaxflux.ops.all_gather import all_gather  # noqa: E402

mode = sys.argv[1] if len(sys.argv) > 1 else "state"
_runtime._settings.rank_cache = mode
jaxflux.configure(timeout_s=10, sync_errors=True)
print("targets", sorted(_runtime.register_targets()), "using", _runtime.target_name("all_gather"),
      flush=True)
devices = jax.devices("gpu")
for order in ("natural", "reversed"):
  mesh = Mesh(np.asarray(devices if order == "natural" else devices[::-1]), ("tp",))
  x = jnp.arange(len(devices) * 8 * 16, dtype=jnp.float32).reshape(-1, 16)
  f = jax.jit(jax.shard_map(lambda x: all_gather(x, "tp")[None], mesh=mesh, in_specs=P("tp"),
                            out_specs=P("tp")))
  for i in range(3):
    try:
      out = np.asarray(f(x + i))
      print(order, i, "ok" if all(np.array_equal(o, np.asarray(x + i)) for o in out) else
            f"WRONG {out[:, ::8, 0]}", flush=True)
    except Exception as e:  # noqa: BLE001
      print(order, i, "EXC", type(e).__name__, str(e)[:2000], flush=True)
    print("device error:", _runtime._ext.take_device_error(), flush=True)
print("discoveries", _runtime._ext.discovery_count())
