"""The project's files import in one direction, so each can be read before the ones above it; the
tutorial's files stand at the root, the run's plumbing and the experiments in lab/."""
import ast
import os

from conftest import ROOT

# A file may import only files of a lower layer (README, "The files"), named as imported.
LAYERS = {"lora": 0, "workflows": 0, "sandbox": 0, "lab.machine": 0, "tasks": 0, "model": 0,
          "decode": 0, "lab.harness": 0,
          "rollout": 1, "verifier": 1, "lab.files": 1,
          "reward": 2, "grpo": 2, "critic": 2, "warmup": 2, "lab.checkpoint": 2,
          "measure": 3, "lab.settings": 3,
          "lab.run": 4,
          "train": 5,
          "lab.bench": 6, "lab.probe": 6,
          "diagnose": 7,
          "lab.course": 8, "lab.tables": 8,
          "lab.grid": 9}


def project_imports(source: str) -> set[str]:
    """The project files that a source imports, wherever the import statement stands:
    `import lora`, `from lora import x`, `from lab import files` and `from lab.files import x`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found & set(LAYERS)


def path_of(name: str) -> str:
    return os.path.join(ROOT, *name.split(".")) + ".py"


def test_every_file_has_a_layer():
    files = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}
    files |= {"lab." + f[:-3] for f in os.listdir(os.path.join(ROOT, "lab")) if f.endswith(".py")}
    assert files == set(LAYERS), files ^ set(LAYERS)


def test_imports_point_down():
    for name, layer in LAYERS.items():
        with open(path_of(name)) as f:
            imported = project_imports(f.read())
        for other in imported:
            assert LAYERS[other] < layer, f"{name} imports {other}, which is not below it"


def test_a_lazy_import_inside_a_function_counts():
    source = ("import os\nfrom grpo import policy_loss\n\n"
              "def f():\n    import train\n    from . import x\n")
    assert project_imports(source) == {"grpo", "train"}


def test_a_file_in_lab_counts_however_it_is_imported():
    source = ("from lab import files, machine\nfrom lab.run import Run\n"
              "import lab.grid\n")
    assert project_imports(source) == {"lab.files", "lab.machine", "lab.run", "lab.grid"}



def test_the_readme_draws_these_layers():
    """The README's block of layers, top line first, is LAYERS from the highest down."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    block = readme[readme.index("holds these layers"):]
    block = block[block.index("```\n") + 4:]
    block = block[:block.index("\n```")]
    drawn = [{name.strip()[:-3].replace("/", ".") for name in line.split(",")}
             for line in block.splitlines()]
    layers = [{n for n, k in LAYERS.items() if k == layer}
              for layer in sorted(set(LAYERS.values()), reverse=True)]
    assert drawn == layers
