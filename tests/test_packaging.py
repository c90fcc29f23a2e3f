"""The startup hook ships at the top of site-packages in a wheel (editable installs are used by CI itself)."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_carries_startup_hook_and_entry_points(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True, cwd=tmp_path)
    wheel = next(tmp_path.glob("sglang_mxfp8-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert "sglang_mxfp8.pth" in names
        assert z.read("sglang_mxfp8.pth").decode().strip() == "import sglang_mxfp8.startup.autoload"
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "sglang-mxfp8 = sglang_mxfp8.cli:main" in entry_points
    assert "[sglang.srt.plugins]" in entry_points and "mxfp8 = sglang_mxfp8.plugin:register" in entry_points
