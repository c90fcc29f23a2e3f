"""Ships ``sglang_mxfp8.pth`` at the top of site-packages, in wheels and in editable installs.

SGLang 0.5.10.post1 has no plugin system and starts its scheduler with ``spawn``, so the only way
a stock ``python -m sglang.launch_server`` runs our code in every process is a startup ``.pth``
hook. Metadata lives in setup.cfg; this file adds the hook to both install modes, and the ``serve`` extra's SGLang
range, read from the one place it is written (``sglang_mxfp8/__init__.py``).
"""

import re
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH_NAME = "sglang_mxfp8.pth"
PTH_SOURCE = Path(__file__).parent / "sglang_mxfp8" / "sglang" / PTH_NAME


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(str(PTH_SOURCE), str(Path(self.build_lib) / PTH_NAME), preserve_mode=0)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [str(Path(self.build_lib) / PTH_NAME)]


class EditableWheelWithPth(editable_wheel):
    def _install_namespaces(self, installation_dir, pth_prefix):
        super()._install_namespaces(installation_dir, pth_prefix)
        (Path(installation_dir) / PTH_NAME).write_text(PTH_SOURCE.read_text())


def sglang_range() -> str:
    """``sglang>=OLDEST,<=NEWEST`` from the package's constants, read without importing it."""
    text = (Path(__file__).parent / "sglang_mxfp8" / "__init__.py").read_text()
    oldest, newest = re.search(r'^OLDEST_SGLANG, NEWEST_SGLANG = "([^"]+)", "([^"]+)"', text, re.M).groups()
    return f"sglang>={oldest},<={newest}"


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth},
      extras_require={"serve": [sglang_range()], "deepgemm": ["sgl-deep-gemm==0.1.5.post1"], "test": ["pytest>=8", "hypothesis>=6.100", "transformers>=4.51"]})
