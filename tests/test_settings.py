"""Every COLDSNAP_* variable is read in one place (coldsnap/base/paths.py) and documented in docs/settings.md with its
default: the code's list and the docs' list are compared here, and any other module that reads one from the
environment fails the suite."""

import ast
import re
from pathlib import Path

from coldsnap.base.paths import VARIABLES, settings
from coldsnap.oci.spec import ENV_ANNOTATIONS

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "coldsnap"
DOC = (REPO / "docs" / "settings.md").read_text()
NAME = re.compile(r"COLDSNAP_[A-Z][A-Z0-9_]*[A-Z0-9]")


def documented() -> dict[str, str]:
    """variable → default, from the docs' first table."""
    rows = re.findall(r"^\| `(COLDSNAP_[A-Z0-9_]+)` \| ([^|]*) \|", DOC.split("## ")[0], re.M)
    return {name: default.strip() for name, default in rows}


def test_the_docs_list_every_setting_with_its_default():
    code = {v.name: v.default or "(unset)" for v in VARIABLES}
    assert documented() == code


def test_every_coldsnap_variable_the_code_names_is_documented():
    named = set()
    for path in PACKAGE.rglob("*.py"):
        named |= set(NAME.findall(path.read_text()))
    known = {v.name for v in VARIABLES} | set(ENV_ANNOTATIONS) | {"COLDSNAP_CPU_SLOT"}
    assert named - known == set(), "named in the code but not a setting: add it to base/paths.py and docs"
    assert all(f"`{name}`" in DOC for name in known)
    assert {v.name for v in VARIABLES} <= named  # no setting documented that the code never reads


def environment_reads(tree: ast.AST) -> list[str]:
    """COLDSNAP_* names a module reads with os.environ.get / os.getenv / os.environ[...]."""
    out = []
    for node in ast.walk(tree):
        arg = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            target = ast.unparse(node.func)
            if target in ("os.environ.get", "os.getenv", "environ.get"):
                arg = node.args[0]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ", "environ") \
                and isinstance(node.ctx, ast.Load):
            arg = node.slice
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("COLDSNAP_"):
            out.append(arg.value)
    return out


# The shim's pass-through path (every runc call on a node) imports nothing of ours but oci/: it reads the two
# variables it needs itself (tests/test_shim_decision.py holds it to that).
SHIM_READS = {"coldsnap/oci/runtime.py": ["COLDSNAP_RUNC"], "coldsnap/oci/records.py": ["COLDSNAP_RUN"]}


def test_no_module_but_the_settings_reads_a_coldsnap_variable():
    readers = {}
    for path in PACKAGE.rglob("*.py"):
        reads = environment_reads(ast.parse(path.read_text()))
        if reads and path != PACKAGE / "base" / "paths.py":
            readers[str(path.relative_to(REPO))] = reads
    assert readers == SHIM_READS


def test_settings_follow_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("COLDSNAP_HOME", str(tmp_path))
    monkeypatch.delenv("COLDSNAP_STORE", raising=False)
    monkeypatch.setenv("COLDSNAP_PREFETCH", "0")
    monkeypatch.setenv("COLDSNAP_INSECURE_REGISTRIES", " a:5000, ,b ")
    monkeypatch.setenv("COLDSNAP_REGISTRY_PASSWORD", "s3cret")
    s = settings()
    assert s.store == tmp_path / "store" and s.code == tmp_path / "code"
    assert s.prefetch is False and s.pull_pieces is True
    assert s.insecure_registries == {"a:5000", "b"}
    assert "s3cret" not in repr(s)  # a password never reaches a log through the settings
