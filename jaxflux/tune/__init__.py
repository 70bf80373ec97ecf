"""python -m jaxflux.tune: measure the fused ops' GEMM candidates on this GPU and write its table.

  python -m jaxflux.tune                      # the benchmark shapes, about 5 minutes on one H100
  python -m jaxflux.tune --shapes-file my_model.json --M 4096,8192
  python -m jaxflux.tune --show               # which tables this process uses, and why

It runs the tuning sweep (`python -m jaxflux.bench --op gemm --candidates`: every all-gather tile
and swizzle, every own-rows schedule and swizzle, side by side with cuBLAS per row), picks each
shape class's fastest candidate and exact-shape entries where a shape's own best is clearly
faster (jaxflux/tune/pick.py), and writes the device table that jaxflux.tuning then reads on
this kind of GPU (jaxflux/tuning/tables.py says where). It prints every row's time / cuBLAS's
with the choice before and after.

--from SWEEP.json builds the table from recorded sweeps instead (no GPU needed); such a table
is for the GPU the sweeps ran on, and is written to the tuning dir only on that kind of GPU
(--out writes it anywhere, e.g. the tables jaxflux ships).
"""
