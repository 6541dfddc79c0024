"""The Python examples of README.md and docs/*.md work as written: every block compiles, every
block that needs no checkpoint (no "path/to/") runs on the CPU up to its "# Needs a CUDA GPU" line,
and on a GPU (tier gpu) such a block runs whole."""
import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
GPU_PART = "# Needs a CUDA GPU"


def examples():
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for i, match in enumerate(BLOCK.finditer(path.read_text())):
            yield f"{path.relative_to(REPO)}#{i + 1}", match.group(1)


EXAMPLES = dict(examples())
RUNNABLE = [name for name, code in EXAMPLES.items() if "path/to/" not in code]
WITH_GPU_PART = [name for name in RUNNABLE if GPU_PART in EXAMPLES[name]]


def run(code, name):
    """Runs code (the examples' own asserts with it); returns the names it assigned at top level,
    and its namespace."""
    assigned = {target.id for node in ast.parse(code).body if isinstance(node, ast.Assign)
                for target in ast.walk(node) if isinstance(target, ast.Name) and isinstance(target.ctx, ast.Store)}
    namespace = {}
    exec(compile(code, name, "exec"), namespace)
    return assigned, namespace


@pytest.mark.cpu
def test_the_docs_have_examples_and_some_run_here():
    assert len(EXAMPLES) >= 4 and len(RUNNABLE) >= 2 and WITH_GPU_PART, EXAMPLES.keys()


@pytest.mark.cpu
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_compiles(name):
    compile(EXAMPLES[name], name, "exec")


@pytest.mark.cpu
@pytest.mark.parametrize("name", RUNNABLE)
def test_example_runs_on_the_cpu(name):
    assigned, namespace = run(EXAMPLES[name].split(GPU_PART)[0], name)
    assert assigned and assigned <= namespace.keys()


@pytest.mark.gpu
@pytest.mark.parametrize("name", WITH_GPU_PART)
def test_example_runs_whole_on_the_gpu(name):
    assigned, namespace = run(EXAMPLES[name], name)
    assert assigned and assigned <= namespace.keys()
    import torch
    torch.cuda.synchronize()
    gpu_values = [v for v in namespace.values() if isinstance(v, torch.Tensor) and v.is_cuda]
    assert gpu_values and all(bool(torch.isfinite(v.float()).all()) for v in gpu_values
                              if v.is_floating_point())
