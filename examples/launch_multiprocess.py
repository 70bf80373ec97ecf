"""Runs examples/train_tp_transformer.py (or, with --bench, `python -m jaxflux.bench`) as N
local processes joined by jax.distributed.

One process per GPU when the machine has NVIDIA GPUs (each process drives its own GPU, chosen with
the example's --local-device-ids; every GPU stays visible to every process, which CUDA IPC between
their workspaces needs), else N processes of k CPU devices each, with cross-process CPU
collectives through gloo. This is the process model of SLURM / Kubernetes launchers, on one
machine: process 0 runs the coordinator on 127.0.0.1 and only process 0 prints.

    python examples/launch_multiprocess.py                          # all GPUs, or 2 x 4 CPU devices
    python examples/launch_multiprocess.py -n 2 --cpu-devices 2 -- --tp 2 --steps 20
    python examples/launch_multiprocess.py --bench -- --op ag_gemm --M 2048,8192

Every process runs with the Python that runs the launcher (sys.executable): start it with the
one that has jaxflux installed (.venv/bin/python after the README's setup). Arguments after
``--`` go to the training script (or the benchmark). Exits with the first
non-zero exit status of a process; when one process fails, the others are stopped after a grace
period instead of waiting for a peer that is gone.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

EXAMPLE = pathlib.Path(__file__).resolve().parent / "train_tp_transformer.py"


def free_port() -> int:
    """A port that is free on the loopback interface now (the coordinator binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_gpus() -> list[str]:
    """The GPUs this launcher may hand out: CUDA_VISIBLE_DEVICES if set, else nvidia-smi's list.

    Asked without importing JAX, which would start a CUDA client in the launcher.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g for g in visible.split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


def missing_modules(names=("jax", "jaxflux")) -> list[str]:
    """The modules the processes need that this interpreter cannot import: each process runs
    with this interpreter (sys.executable), so a launcher started by a Python without jaxflux
    would start N processes that all fail on their first import."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def launch(commands: list[list[str]], envs: list[dict], *, timeout: float | None = None,
           grace: float = 20.0, stdouts: list | None = None) -> list[int]:
    """Runs the processes to completion; returns their exit statuses.

    Once one has failed, the others get `grace` seconds to fail by themselves (jax.distributed
    tells them) and are then killed; past `timeout` all are killed. A killed process reports -9.
    `stdouts`: per process, a file for its stdout and stderr (default: inherit ours).
    """
    stdouts = stdouts or [None] * len(commands)
    procs = [subprocess.Popen(cmd, env=env, stdout=out, stderr=out and subprocess.STDOUT)
             for cmd, env, out in zip(commands, envs, stdouts)]
    stop_at = float("inf") if timeout is None else time.monotonic() + timeout
    failure_seen = False
    try:
        while None in (codes := [p.poll() for p in procs]):  # poll each: any() would stop early
            if not failure_seen and any(c not in (None, 0) for c in codes):
                failure_seen = True
                stop_at = min(stop_at, time.monotonic() + grace)
            if time.monotonic() > stop_at:
                break
            time.sleep(0.1)
    finally:  # also on KeyboardInterrupt: leave no process behind
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    return [p.returncode for p in procs]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, example_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-n", "--num-processes", type=int, default=None,
                   help="processes to start (default: one per GPU, or 2 without GPUs)")
    p.add_argument("--cpu-devices", type=int, default=4,
                   help="CPU devices per process, when running on CPU")
    p.add_argument("--platform", choices=("auto", "gpu", "cpu"), default="auto",
                   help="auto: GPUs if nvidia-smi lists any")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument("--bench", action="store_true",
                   help="run the benchmark (python -m jaxflux.bench) instead of the example")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds before all processes are killed (default: none)")
    args = p.parse_args(ours)
    missing = missing_modules()
    if missing:
        p.error(f"{sys.executable} cannot import {', '.join(missing)}, and every process runs "
                "with it: run the launcher with the Python that has jaxflux installed, e.g. "
                ".venv/bin/python examples/launch_multiprocess.py after the README's setup")

    gpus = local_gpus() if args.platform != "cpu" else []
    if args.platform == "gpu" and not gpus:
        p.error("--platform gpu, but no GPU is listed by nvidia-smi or CUDA_VISIBLE_DEVICES")
    n = args.num_processes or len(gpus) or 2
    if gpus and n > len(gpus):
        p.error(f"{n} processes but {len(gpus)} GPUs: one process per GPU")
    coordinator = f"127.0.0.1:{args.port or free_port()}"

    commands, envs = [], []
    for i in range(n):
        env = dict(os.environ)
        # The coordinator listens on loopback only (JAX's default is every interface).
        env["JAX_COORDINATOR_BIND_ADDRESS"] = coordinator
        program = ["-m", "jaxflux.bench"] if args.bench else [str(EXAMPLE)]
        cmd = [sys.executable, *program, *example_args, "--distributed", f"{coordinator},{n},{i}"]
        if gpus:
            cmd += ["--local-device-ids", str(i)]  # the i-th visible GPU
        else:
            env["JAX_PLATFORMS"] = "cpu"
            cmd += ["--cpu-devices", str(args.cpu_devices)]
        commands.append(cmd)
        envs.append(env)
    where = (f"one GPU each ({','.join(gpus[:n])})" if gpus
             else f"{args.cpu_devices} CPU devices each")
    print(f"launching {n} processes, {where}, coordinator {coordinator}", flush=True)

    codes = launch(commands, envs, timeout=args.timeout)
    for i, c in enumerate(codes):
        if c:
            what = "was stopped" if c < 0 else f"exited with {c}"
            print(f"process {i} {what}", file=sys.stderr)
    # A process that failed by itself says more than one we stopped afterwards.
    return next((c for c in codes if c > 0), 1 if any(codes) else 0)


if __name__ == "__main__":
    sys.exit(main())
