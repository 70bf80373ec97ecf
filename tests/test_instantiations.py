"""The CUTLASS kernel instantiations (xla_ffi/kernels/instantiations/) are exactly what
xla_ffi/kernels/generate_instantiations.py writes, and the dispatch tables list each of them.
Pure Python: no compiler or GPU needed."""
import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNELS = ROOT / "xla_ffi" / "kernels"
COMMITTED = KERNELS / "instantiations"


@pytest.fixture(scope="module")
def generator():
  spec = importlib.util.spec_from_file_location("generate_instantiations",
                                                KERNELS / "generate_instantiations.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_generator_reproduces_the_committed_files(generator, tmp_path):
  written = generator.write(tmp_path)
  assert written, "the generator wrote nothing"
  generated = {p.name: p.read_text() for p in tmp_path.glob("*.cu")}
  committed = {p.name: p.read_text() for p in COMMITTED.glob("*.cu")}
  assert sorted(generated) == sorted(committed)
  for name, text in generated.items():
    assert committed[name] == text, f"{name} differs from the generator's output"


def test_every_file_says_it_is_generated(generator):
  for path in COMMITTED.glob("*.cu"):
    assert path.read_text().splitlines()[0] == generator.HEADER.rstrip("\n"), path.name


def test_the_generator_leaves_no_stale_files(generator, tmp_path):
  (tmp_path / "ag_gemm_sm90_bf16_c2.cu").write_text("// stale\n")
  generator.write(tmp_path)
  assert not (tmp_path / "ag_gemm_sm90_bf16_c2.cu").exists()


def test_two_all_gather_matmul_tile_configs_per_dtype_and_layout(generator):
  ag = [i for i in generator.instances() if i.kernel == "ag_gemm_sm90"]
  assert list(generator.AG_GEMM_TILES) == ["cooperative_128x256_cluster2x1",
                                           "pingpong_128x128_cluster1x2"]
  # The FP8 configs are the same tiles in the same order (AgGemmConfig), K-major B only.
  assert list(generator.AG_GEMM_FP8_TILES) == list(generator.AG_GEMM_TILES)
  sixteen_bit = len(generator.DTYPES) * 2 * len(generator.B_LAYOUTS)
  fp8 = len(generator.FP8_DTYPES) * 2
  assert len(ag) == sixteen_bit + fp8 == 12
  assert all(i.name.endswith("_kmajor") for i in ag if i.name.split("_")[0] in
             generator.FP8_DTYPES)


# How each dispatch file names an instance: declared, then listed in its table.
@pytest.mark.parametrize("kernel,patterns", [
    ("ag_gemm_sm90", (r"JAXFLUX_DECLARE_AG_GEMM\({}\)", r"JAXFLUX_AG_GEMM_ENTRY\({}\)")),
    ("rs_gemm_sm90", (r"\bRsGemmWorkspaceBytes_{}\(", r"\bRsGemmRun_{}\(")),
    ("gemm_sm90", (r"\bGemmWorkspaceBytes_{}\(", r"\bGemmRun_{}\(")),
    ("gemm_swap_ab_sm90", (r"JAXFLUX_DECLARE_SWAP_AB\({}\)", r"JAXFLUX_SWAP_AB_ENTRY\({}\)")),
    ("grouped_gemm_sm90", (r"JAXFLUX_DECLARE_GROUPED_GEMM\({}\)",
                           r"JAXFLUX_GROUPED_GEMM_ENTRY\({}\)")),
])
def test_the_dispatch_table_lists_every_instance(generator, kernel, patterns):
  dispatch = (KERNELS / f"{kernel}_dispatch.cu").read_text()
  names = [i.name for i in generator.instances() if i.kernel == kernel]
  assert names
  for name in names:
    for pattern in patterns:
      # Declared and used: at least twice for the plain dispatches, once each for the macros.
      found = re.findall(pattern.format(name), dispatch)
      assert len(found) >= (1 if "JAXFLUX" in pattern else 2), (pattern.format(name), kernel)


def test_the_all_gather_matmul_table_is_in_enum_order(generator):
  # kTable[dtype][B K-major][config]: the entries in that nested order.
  dispatch = (KERNELS / "ag_gemm_sm90_dispatch.cu").read_text()
  table = dispatch[dispatch.index("kTable"):]
  listed = re.findall(r"JAXFLUX_AG_GEMM_ENTRY\((\w+)\)", table)
  # GemmDtype order: the 16-bit kinds, both layouts; then FP8, K-major only.
  expected = [f"{dtype}_{tiles}_{layout}" for dtype in generator.DTYPES
              for layout in ("nmajor", "kmajor") for tiles in generator.AG_GEMM_TILES]
  expected += [f"{dtype}_{tiles}_kmajor" for dtype in generator.FP8_DTYPES
               for tiles in generator.AG_GEMM_FP8_TILES]
  assert listed == expected


def test_the_decode_gemm_table_is_in_enum_order(generator):
  # kTable[dtype][B K-major][token width], GemmDtype order; FP8 K-major only.
  dispatch = (KERNELS / "gemm_swap_ab_sm90_dispatch.cu").read_text()
  table = dispatch[dispatch.index("kTable"):]
  listed = re.findall(r"JAXFLUX_SWAP_AB_ENTRY\((\w+)\)", table)
  widths = generator.SWAP_AB_WIDTHS
  expected = [f"{dtype}_{layout}_t{w}" for dtype in generator.DTYPES
              for layout in ("nmajor", "kmajor") for w in widths]
  expected += [f"{dtype}_kmajor_t{w}" for dtype in generator.FP8_DTYPES for w in widths]
  assert listed == expected
  header = (KERNELS / "gemm_swap_ab_sm90.h").read_text()
  assert f"kSwapAbTokenWidths[] = {{{', '.join(map(str, widths))}}}" in header
