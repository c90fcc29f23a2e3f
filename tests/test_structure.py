"""The package's design, checked: its modules import one another in one direction (layers, function-level imports
included) and never in a circle; every named patch finds its target on the SGLang under test (CI runs this with the
oldest and the newest supported release); the startup hook watches what the patches name."""

import ast
import importlib
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang  # CI runs these again with the newest SGLang

PACKAGE = Path(__file__).resolve().parents[1] / "sglang_mxfp8"

# lowest first: a module may import its own layer and the layers before it, never one after
LAYERS = (
    ("sglang_mxfp8", "sglang_mxfp8.flags", "sglang_mxfp8.settings"),
    ("sglang_mxfp8.platform", "sglang_mxfp8.compat"),
    ("sglang_mxfp8.format",),
    ("sglang_mxfp8.layouts",),
    ("sglang_mxfp8.ops",),
    ("sglang_mxfp8.kernels",),
    ("sglang_mxfp8.sglang.patching", "sglang_mxfp8.sglang.launch", "sglang_mxfp8.sglang.loads",
     "sglang_mxfp8.sglang.quant_methods", "sglang_mxfp8.sglang.weights"),
    ("sglang_mxfp8.sglang.patches", "sglang_mxfp8.sglang.autoload", "sglang_mxfp8.sglang"),
    ("sglang_mxfp8.bench",),
    ("sglang_mxfp8.cli",),  # the commands run the benchmarks; the benchmarks never import a command
)


def _name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(module: str) -> set:
    """The package's modules ``module`` imports anywhere in it (in functions too)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            candidates = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        found.update(c for c in candidates if c in MODULES and c != module)
    return found


def _layer(module: str) -> int:
    """The layer of the longest prefix of ``module`` the LAYERS name."""
    best = max((len(prefix), i) for i, layer in enumerate(LAYERS) for prefix in layer
               if module == prefix or module.startswith(prefix + "."))
    return best[1]


GRAPH = {m: _imports(m) for m in MODULES}


def test_no_module_imports_a_higher_layer():
    upward = [f"{m} -> {dep}" for m, deps in GRAPH.items() for dep in deps if _layer(dep) > _layer(m)]
    assert upward == []


def test_no_import_circle_even_through_function_level_imports():
    def visit(m, path):
        assert m not in path, f"import circle: {' -> '.join(path[path.index(m):] + [m])}"
        for dep in GRAPH[m]:
            if dep not in done:
                visit(dep, path + [m])
        done.add(m)

    done: set = set()
    for m in GRAPH:
        visit(m, [])


def test_the_benchmarks_ask_compat_where_sglang_keeps_things_never_the_patches():
    bench = {m: deps for m, deps in GRAPH.items() if m.startswith("sglang_mxfp8.bench")}
    assert any("sglang_mxfp8.compat" in deps for deps in bench.values())
    assert [f"{m} -> {d}" for m, deps in bench.items() for d in deps if d.startswith("sglang_mxfp8.sglang.")] == []


def test_where_things_are_is_readable_from_the_file_names():
    """A kernel is chosen in kernels/registry.py, SGLang is touched in sglang/patches/, each launch flag is read in
    sglang/launch.py (no other module reads SGLang's backend flags)."""
    for module, path in MODULES.items():
        if module == "sglang_mxfp8.sglang.launch":
            continue
        text = path.read_text()
        for reader in ("get_moe_runner_backend", "get_fp8_gemm_runner_backend", ".fp8_gemm_runner_backend",
                       ".moe_runner_backend"):
            assert reader not in text, f"{module} reads a launch flag ({reader}); sglang/launch.py reads them"
    assert {m.rsplit(".", 1)[1] for m in MODULES if m.startswith("sglang_mxfp8.sglang.patches.")} == {
        "server_args", "model_config", "quantization", "loader", "loader_utils", "moe_config", "model_runner"}


def _resolve(target: str):
    """The object ``module:attr.path`` names on this SGLang; where the module needs sgl_kernel (no CPU build), the
    definition found in its source file instead (True)."""
    module_name, attrs = target.split(":")
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith(("sgl_kernel", "sglang")) or e.name == module_name:
            raise
        spec = importlib.util.find_spec(module_name)
        tree = ast.parse(Path(spec.origin).read_text())
        head, *rest = attrs.split(".")
        node = next((n for n in tree.body if getattr(n, "name", None) == head or (
            isinstance(n, ast.Assign) and any(getattr(t, "id", None) == head for t in n.targets))), None)
        for name in rest:
            node = next((n for n in getattr(node, "body", ()) if getattr(n, "name", None) == name), None)
        return node is not None
    for name in attrs.split("."):
        obj = getattr(obj, name, None)
    return obj


@pytest.mark.parametrize("patch", __import__("sglang_mxfp8.sglang.patches", fromlist=["PATCHES"]).PATCHES,
                         ids=lambda p: p.name)
def test_every_patch_finds_one_of_its_targets_on_this_sglang(patch):
    found = []
    for target in patch.targets:
        try:
            found.append(_resolve(target))
        except ImportError:
            found.append(None)
    assert any(f is not None and f is not False for f in found), (patch.name, patch.targets)


def test_the_startup_hook_watches_what_the_patches_name_and_imports_nothing_heavy():
    from sglang_mxfp8.sglang import autoload, patches

    assert autoload.WATCHED is patches.WATCHED
    assert {m for p in patches.PATCHES for m in p.modules} == set(autoload.WATCHED)
    assert len({p.name for p in patches.PATCHES}) == len(patches.PATCHES)
    for patch in patches.PATCHES:  # each names code that exists
        submodule, function = patch.apply.split(":")
        assert callable(getattr(importlib.import_module(f"sglang_mxfp8.sglang.patches.{submodule}"), function)), patch
    assert "sglang_mxfp8.sglang.patches.server_args" in sys.modules  # imported above, not by the hook

