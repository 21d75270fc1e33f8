"""The project's files import in one direction, so each can be read before the ones above it."""
import ast
import os

from conftest import ROOT

# A file may import only files of a lower layer (README, "The files").
LAYERS = {"lora": 0, "workflows": 0, "sandbox": 0, "machine": 0, "tasks": 0, "model": 0, "decode": 0,
          "rollout": 1, "reward": 1,
          "grpo": 2, "critic": 2, "runs": 2,
          "launch": 3,
          "train": 4,
          "bench": 5,
          "diagnose": 6, "course": 6, "grid": 7}


def project_imports(source: str) -> set[str]:
    """The project files that a source imports, wherever the import statement stands."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found & set(LAYERS)


def test_every_top_level_file_has_a_layer():
    files = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}
    assert files <= set(LAYERS), files - set(LAYERS)


def test_imports_point_down():
    for name, layer in LAYERS.items():
        with open(os.path.join(ROOT, f"{name}.py")) as f:
            imported = project_imports(f.read())
        for other in imported:
            assert LAYERS[other] < layer, f"{name}.py imports {other}.py, which is not below it"


def test_a_lazy_import_inside_a_function_counts():
    source = "import os\nfrom grpo import policy_loss\n\ndef f():\n    import train\n    from . import x\n"
    assert project_imports(source) == {"grpo", "train"}
