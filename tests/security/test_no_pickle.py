"""No module of the project unpickles anything: saved data is JSON (docs/security.md, Saved data).

Greps the package sources (not the tests) for pickle, shelve, marshal, dill/cloudpickle/joblib, numpy
loads that allow pickles, and `torch.load` without `weights_only=True`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "protocol", "eventstore", "projections", "participant", "workers", "trainer", "gym_agent",
    "simulation", "cli", "migrations", "benchmarks",
)  # fmt: skip
FORBIDDEN_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "shelve",
    "marshal",
    "dill",
    "cloudpickle",
    "joblib",
    "copyreg",
}


def _sources() -> list[Path]:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 30, "the package sources were not found"
    return files


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_unpickling(path: Path) -> None:
    text = path.read_text()
    tree = ast.parse(text, filename=str(path))
    problems: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            problems += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            problems.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            keywords = {k.arg: k.value for k in node.keywords}
            if name.endswith("torch.load") or (name == "load" and "torch" in text):
                weights_only = keywords.get("weights_only")
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    problems.append(f"line {node.lineno}: {name}(...) without weights_only=True")
            if name.endswith(("np.load", "numpy.load")):
                allow = keywords.get("allow_pickle")
                if isinstance(allow, ast.Constant) and allow.value is True:
                    problems.append(f"line {node.lineno}: {name}(..., allow_pickle=True)")
            if name in ("__import__", "importlib.import_module") and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and str(first.value).split(".")[0] in FORBIDDEN_MODULES:
                    problems.append(f"line {node.lineno}: dynamic import of {first.value!s}")
    # torch.save writes pickles too: nothing the project saves may be one.
    problems += [f"torch.save at offset {m.start()}" for m in re.finditer(r"\btorch\.save\(", text)]
    assert not problems, f"{path.relative_to(ROOT)}: {problems}"
