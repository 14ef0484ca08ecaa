"""Packaging: every third-party package the installed code imports is declared in pyproject.toml,
and an optional extra's package is imported only where its absence is handled.

A plain `pip install agentflash` installs `dependencies` and nothing else, so an import of a
package that only a test extra (or some other package) happens to pull in breaks users while
CI stays green. tools/check_install.sh proves the plain install end to end; this catches the
mistake at its source, file by file.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("agentflash", "engine", "kernels", "examples")  # what the wheel installs
# Modules that exist for an extra and are imported only after checking it is installed
# (kernels.dispatch looks for triton with importlib.util.find_spec before importing them;
# `agentflash serve` imports the server package inside a try that names the extra; each
# framework adapter is imported only by users of that framework).
EXTRA_MODULES = {
    "agentflash/server/app.py": "server",
    "agentflash/server/metrics.py": "server",
    "agentflash/integrations/pydantic_ai.py": "pydantic-ai",
    "agentflash/integrations/openai_agents.py": "openai-agents",
    "agentflash/integrations/langchain.py": "langchain",
    "kernels/triton_accept.py": "triton",
    "kernels/triton_attention.py": "triton",
    "kernels/triton_context_kv.py": "triton",
}
# Import names of optional packages not installed here, by the distribution that provides them
DISTRIBUTIONS = {"fla": "fla-core"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(reqs: list[str]) -> set[str]:
    return {_norm(re.match(r"[A-Za-z0-9_.\-]+", r).group(0)) for r in reqs}


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    own = {_norm(project["name"])}  # an extra may pull in another: "agentflash[server]"
    extras = {name: _requirement_names(reqs) - own
              for name, reqs in project.get("optional-dependencies", {}).items()}
    return _requirement_names(project["dependencies"]), extras


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(top-level module, line, guarded) for each absolute import in the file; guarded: inside
    a function or a `try` that handles ImportError, so the module loads without the package.
    Imports under `if TYPE_CHECKING:` never run and are left out."""
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((a.name.split(".")[0], node.lineno, guarded) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], node.lineno, guarded))
        elif isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            return
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            guarded = True
        elif isinstance(node, ast.Try) and any(
                getattr(h.type, "id", None) in ("ImportError", "ModuleNotFoundError")
                for h in node.handlers):
            for stmt in node.body:
                visit(stmt, True)
            for stmt in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(stmt, guarded)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def _installed_files() -> list[tuple[Path, str]]:
    """(file, importable module name) for every module the wheel installs."""
    files = []
    for folder in PACKAGE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if parts[0] != "agentflash":
                parts.insert(0, "agentflash")
            files.append((path, ".".join(parts)))
    return files


def test_every_import_is_a_declared_dependency():
    required, extras = _declared()
    optional = set().union(*extras.values())
    dists = packages_distributions()
    problems = []
    for path, _ in _installed_files():
        rel = path.relative_to(ROOT).as_posix()
        own_extra = extras.get(EXTRA_MODULES.get(rel, ""), set())
        for module, line, guarded in _imports(path):
            if module in sys.stdlib_module_names or module in ("agentflash", "__future__"):
                continue
            names = {_norm(d) for d in dists.get(module, [DISTRIBUTIONS.get(module, module)])}
            where = f"{rel}:{line} imports {module}"
            if names & required:
                continue
            if not names & optional:
                problems.append(f"{where}, which pyproject.toml does not declare")
            elif not guarded and not names & own_extra:
                problems.append(f"{where} (an optional extra's package) at module level; "
                                "import it lazily, with an error naming the extra")
    assert not problems, "\n".join(problems)


def test_core_modules_import_without_any_extra(tmp_path):
    """Every installed module but an extra's own loads with the extras' packages missing, and
    the kernel dispatch then offers no Triton backend."""
    required, extras = _declared()
    optional = set().union(*extras.values())
    blocked = sorted(module for module, names in packages_distributions().items()
                     if {_norm(d) for d in names} & optional
                     and not {_norm(d) for d in names} & required)
    modules = [name for path, name in _installed_files()
               if path.relative_to(ROOT).as_posix() not in EXTRA_MODULES
               and path.name != "__main__.py"]  # runs the CLI
    # a None entry in sys.modules makes `import x` fail and importlib.util.find_spec(x) None
    script = f"""
import importlib, sys
for name in {blocked!r}:
    sys.modules[name] = None
for m in {modules!r}:
    importlib.import_module(m)
from agentflash import telemetry
from agentflash.kernels import dispatch
assert telemetry.otel_trace is None
assert dispatch._triton() == {{}}
"""
    assert "triton" in blocked and "opentelemetry" in blocked and "trio" in blocked
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_checkouts_folders_never_shadow_an_installed_distribution(tmp_path):
    """Python started in the checkout's root has the root first on sys.path (`python -m pytest`,
    `python -c`). A distribution installed under the name of one of its folders (Hugging Face's
    `kernels`, which transformers imports) must still be the one imported: the folders are no
    regular packages there, only agentflash's subpackages (agentflash/engine -> ../engine)."""
    folders = sorted(p.name for p in ROOT.iterdir()
                     if p.is_dir() and p.name.isidentifier() and p.name != "agentflash")
    assert {"engine", "kernels", "examples", "tools", "tests"} <= set(folders)
    site = tmp_path / "site-packages"
    for name in folders:  # an installed regular package of that name
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text("ORIGIN = 'installed'\n")
    script = f"""
import importlib
for name in {folders!r}:
    module = importlib.import_module(name)
    assert getattr(module, "ORIGIN", None) == "installed", (name, module)
import agentflash.engine.engine, agentflash.kernels.cpu_ops, agentflash.examples.demo_tools
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr[-3000:]
