"""The layering of docs/architecture.md is enforced: import-linter's contract (pyproject.toml) holds on the tree
and breaks when a lower layer imports a higher one (no exception: model.generate() names its implementation); no import
cycle; short model files; the old module paths still import."""

from __future__ import annotations

import ast
import itertools
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "lint-imports"
    env = {"PYTHONPATH": str(tree / "src"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([str(exe), "--no-cache", "--config", str(tree / "pyproject.toml")], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_the_layers_hold_and_an_upward_import_breaks_them(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "src" / "txl", tree / "src" / "txl", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    ok = lint_imports(tree)
    assert ok.returncode == 0 and "1 kept, 0 broken" in ok.stdout and "ignored" not in ok.stdout, ok.stdout + ok.stderr
    fileio = tree / "src" / "txl" / "util" / "fileio.py"
    fileio.write_text(fileio.read_text() + "\n\ndef _late():\n    from txl.train.checkpoint import RunLock  # noqa\n")
    broken = lint_imports(tree)
    assert broken.returncode != 0 and "txl.util.fileio -> txl.train.checkpoint" in broken.stdout, broken.stdout


def test_no_import_cycle_between_modules():
    """No module imports itself through others (call-time imports included: grimp reads every import statement),
    apart from a package's __init__ re-exporting its own modules."""
    import grimp

    graph = grimp.build_graph("txl", cache_dir=None, exclude_type_checking_imports=True)
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            if imported.startswith(module + ".") or module.startswith(imported + "."):
                continue  # (a package and its own modules)
            path = graph.find_shortest_chain(importer=imported, imported=module)
            if path and not any(a.startswith(b + ".") or b.startswith(a + ".") for a, b in itertools.pairwise(path)):
                cycles.append((module, *path))
    assert not cycles, cycles


def test_model_files_are_short_and_the_folders_are_the_layers():
    """The model reads in one sitting per file (<= 600 lines), every module lives in its layer's folder, and the
    layer folders are the contract's (pyproject.toml)."""
    src = ROOT / "src" / "txl"
    long = {p.name: n for p in (src / "model").glob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long
    flat = sorted(p.name for p in src.glob("*.py"))
    assert flat == ["__init__.py", "__main__.py", "config.py", "demo.py"], flat
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    named = {m.strip() for layer in contract["layers"] for m in layer.split("|")}
    for layer in ("cli", "serve", "interop", "train", "infer", "config", "data", "model", "kernels", "util"):
        assert layer in named, layer


def test_the_house_stays_small():
    """The size limits of DEVELOPERS.md and issues 75/76: no file in src/txl over 700 lines, no function over 100, and
    src/txl at most 25,500 lines of Python in all."""
    sizes, long_functions = {}, []
    for path in (ROOT / "src" / "txl").rglob("*.py"):
        text = path.read_text()
        sizes[path] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 100:
                long_functions.append(f"{path.name}:{node.name}")
    long_files = {p.name: n for p, n in sizes.items() if n > 700}
    assert not long_files, long_files
    assert not long_functions, long_functions
    assert sum(sizes.values()) <= 25_500, sum(sizes.values())


def test_old_module_paths_import_the_same_modules():
    """The flat layout's module paths still import, as the very module objects of the new layout (so patching a
    name through an old path patches what the code reads)."""
    import importlib

    import txl

    for old, new in txl.MOVED_MODULES.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    from txl.modeling import TransformerXLLM  # noqa: F401  (the names of the one-file model)
    from txl.trainer import Trainer  # noqa: F401

    from txl.serve import ServeLimits, create_app  # noqa: F401  (txl.serve was a module)

    assert importlib.import_module("txl.modeling").__spec__.name == "txl.model.modeling"


def test_the_package_face_is_lazy_and_patches_no_class():
    """``import txl`` imports no layer and not torch; each exported name imports its module when first asked for;
    no module sets an attribute on a class of another module (the model's generate() names its implementation:
    txl.util.entry_points, every entry of which resolves)."""
    import ast

    code = (
        "import sys, txl; assert 'torch' not in sys.modules, 'torch'; "
        "assert sorted(m for m in sys.modules if m.startswith('txl')) == ['txl'], sorted(sys.modules); "
        "assert sorted(txl.__all__) == sorted(txl.EXPORTS); "
        "from txl import *; assert TransformerXLLM.__module__ == 'txl.model.heads'; "
        "assert 'generate' in TransformerXLLM.__dict__; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src")})  # fmt: skip
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
    patched = []
    for path in (ROOT / "src" / "txl").rglob("*.py"):
        tree = ast.parse(path.read_text())
        own = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id not in own:
                    patched.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(t)}")
    assert not patched, patched

    from txl.infer.generation import generate_like_hf
    from txl.util.entry_points import IMPLEMENTATIONS, implementation

    assert implementation("TransformerXLLM.generate") is generate_like_hf
    for name in IMPLEMENTATIONS:
        assert callable(implementation(name)), name


def test_generate_on_the_model_is_generation_by_the_inference_layer(monkeypatch):
    """model.generate() passes its arguments to txl.infer.generation.generate_like_hf and returns its result."""
    import torch

    from txl import TransformerXLConfig, TransformerXLLM
    from txl.infer import generation

    seen = []
    monkeypatch.setattr(generation, "generate_like_hf", lambda *a, **kw: seen.append((a, kw)) or "tokens")
    model = TransformerXLLM(TransformerXLConfig(n_token=20, d_model=16, n_head=2, d_head=8, d_inner=32, n_layer=1))
    prompt = torch.tensor([[1, 2]])
    assert model.generate(prompt, max_new_tokens=3, do_sample=True) == "tokens"
    assert seen[0][0][0] is model and seen[0][0][1] is prompt and seen[0][1] == {"max_new_tokens": 3, "do_sample": True}
