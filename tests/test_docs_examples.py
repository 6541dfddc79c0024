"""The Python examples of README.md and docs/*.md work as written: every block compiles, and every
block that needs no checkpoint (no "path/to/") runs on the CPU up to its "# Needs a CUDA GPU" line."""
import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
GPU_PART = "# Needs a CUDA GPU"
pytestmark = pytest.mark.cpu


def examples():
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for i, match in enumerate(BLOCK.finditer(path.read_text())):
            yield f"{path.relative_to(REPO)}#{i + 1}", match.group(1)


EXAMPLES = dict(examples())
RUNNABLE = [name for name, code in EXAMPLES.items() if "path/to/" not in code]


def test_the_docs_have_examples_and_some_run_here():
    assert len(EXAMPLES) >= 4 and len(RUNNABLE) >= 2, EXAMPLES.keys()


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_compiles(name):
    compile(EXAMPLES[name], name, "exec")


@pytest.mark.parametrize("name", RUNNABLE)
def test_example_runs_on_the_cpu(name):
    code = EXAMPLES[name].split(GPU_PART)[0]
    assigned = {target.id for node in ast.parse(code).body if isinstance(node, ast.Assign)
                for target in ast.walk(node) if isinstance(target, ast.Name) and isinstance(target.ctx, ast.Store)}
    namespace = {}
    exec(compile(code, name, "exec"), namespace)  # the examples' own asserts run here
    assert assigned and assigned <= namespace.keys()
