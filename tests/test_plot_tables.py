"""The plot script's table reading (matplotlib itself is not needed for this)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("plot_speedup", ROOT / "benchmarks/plot_speedup.py")
plot_speedup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_speedup)

DENSE = """intro

| shape | M | BF16 cuBLAS us | hopper_triton_w8a8 us (ratio) | hopper_flashinfer_blockscale us (ratio) |
|---|---|---|---|---|
| qkv 2048->5120 | 1 | 13.0 | 57.7 (0.23x) | 31.5 (0.41x) |
| qkv 2048->5120 | 16 | 13.6 | 88.1 (0.15x) | 27.4 (0.50x) |
| o 4096->2048 | 1 | 13.7 | 71.8 (0.19x) | 16.0 (0.86x) |

after
"""

MOE = """| tokens | BF16 us | MXFP8 us | speedup | rel. error vs BF16 |
|---|---|---|---|---|
| 1 | 307.9 | 407.5 | 0.76x | 0.0594 |
| 4096 | 843.4 | 799.4 | 1.06x | 0.0639 |
"""


def test_dense_table_series_per_shape_and_backend():
    header, rows = plot_speedup.first_table(DENSE)
    size_col, groups = plot_speedup.series_of(header, rows)
    assert size_col == 1 and list(groups) == ["qkv 2048->5120", "o 4096->2048"]
    assert groups["qkv 2048->5120"]["hopper_flashinfer_blockscale"] == [(1.0, 0.41), (16.0, 0.50)]
    assert groups["o 4096->2048"]["hopper_triton_w8a8"] == [(1.0, 0.19)]


def test_speedup_column_table():
    header, rows = plot_speedup.first_table(MOE)
    _, groups = plot_speedup.series_of(header, rows)
    assert dict(groups["all"]) == {"speedup": [(1.0, 0.76), (4096.0, 1.06)]}  # 0.0594 is not a ratio
