"""The startup hook ships at the top of site-packages in a wheel, the tuned MoE configs inside the package
(editable installs are used by CI itself)."""

import subprocess
import sys
import zipfile
from pathlib import Path
import pytest

pytestmark = pytest.mark.sglang  # CI runs these again with the newest SGLang

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """This package's wheel, built once for the tests that read it."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, cwd=out)
    return next(out.glob("sglang_mxfp8-*.whl"))


def test_wheel_carries_startup_hook_and_entry_points(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert "sglang_mxfp8.pth" in names
        assert z.read("sglang_mxfp8.pth").decode() == (ROOT / "sglang_mxfp8/sglang/sglang_mxfp8.pth").read_text()
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
        shipped = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "sglang_mxfp8/sglang/moe_configs").glob("*/*.json"))
        assert shipped and all(n in names for n in shipped), (shipped, names)
    assert "sglang-mxfp8 = sglang_mxfp8.cli:main" in entry_points
    assert "[sglang.srt.plugins]" in entry_points and "mxfp8 = sglang_mxfp8.sglang.patches:register" in entry_points


def test_hook_is_silent_where_the_package_is_gone(tmp_path):
    """An editable install whose source moved leaves the .pth behind; Python must still start cleanly."""
    (tmp_path / "sglang_mxfp8.pth").write_text((ROOT / "sglang_mxfp8/sglang/sglang_mxfp8.pth").read_text())
    code = f"import site, sys; site.addsitedir({str(tmp_path)!r}); print('autoload' in str(sys.modules.keys()))"
    gone = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert gone.returncode == 0 and gone.stderr == "" and gone.stdout.strip() == "False"
    here = subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); " + code],
                          capture_output=True, text=True, cwd=tmp_path)
    assert here.returncode == 0 and here.stdout.strip() == "True", here.stderr[-2000:]


def test_the_supported_sglang_range_is_written_once_and_read_alike_everywhere(wheel):
    """sglang_mxfp8/__init__.py holds the range, so a new release that moved nothing is one line there: the wheel's
    serve extra and the CI script read it, README names the oldest only, ci/newest.txt only what the newest imports."""
    from sglang_mxfp8 import NEWEST_SGLANG, OLDEST_SGLANG

    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith("METADATA"))).decode()
    pins = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: sglang")]
    assert pins == [f'Requires-Dist: sglang<={NEWEST_SGLANG},>={OLDEST_SGLANG}; extra == "serve"'], pins
    assert not [line for line in (ROOT / "ci/newest.txt").read_text().splitlines() if line.startswith("sglang==")]
    assert f"SGLang, {OLDEST_SGLANG} or newer" in (ROOT / "README.md").read_text().replace("\n", " ")
    script = (ROOT / "ci/test.sh").read_text()
    assert '"sglang==$OLDEST"' in script and '"sglang==$NEWEST_RELEASE"' in script
    assert OLDEST_SGLANG not in script and NEWEST_SGLANG not in script
    assert "sglang" not in (ROOT / "setup.cfg").read_text().split("[options]")[1].split("\n[")[0]


def test_the_readme_stays_under_8_kb():
    assert len((ROOT / "README.md").read_bytes()) < 8 * 1024
