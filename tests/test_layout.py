"""The layout's rules, checked: each floor imports only what it stands on.

pipeline/ is the floor: nothing in it imports distill/, eval/, export/ or cli/; cli/ is the top floor: it may import
everything and nothing imports it; the package format and the server load without the training loop; no import
cycle between our modules.
"""

import ast
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, child_env

PACKAGES = ("pipeline", "distill", "eval", "export", "cli")


def _imports() -> dict[str, set[str]]:
    """module -> the project modules it imports (lazy imports inside functions included)."""
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            mods[name] = path
    graph = {}
    for name, path in mods.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {m for m in found if m in mods and m != name}
    return graph


def test_pipeline_is_the_floor():
    upward = [(m, t) for m, targets in _imports().items() if m.split(".")[0] == "pipeline"
              for t in targets if t.split(".")[0] != "pipeline"]
    assert upward == []


def test_cli_is_the_top_floor():
    graph = _imports()
    assert [(m, t) for m, targets in graph.items() if m.split(".")[0] != "cli"
            for t in targets if t.split(".")[0] == "cli"] == []
    assert {t.split(".")[0] for m, targets in graph.items() if m.startswith("cli.") for t in targets} == \
        {"cli", "pipeline", "distill", "eval", "export"}  # the walker does see the CLI's imports


def test_no_import_cycle():
    graph = _imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m, path):
        state[m] = 1
        for t in sorted(graph[m]):
            assert state.get(t) != 1, "import cycle: " + " -> ".join(path + [m, t])
            if t not in state:
                visit(t, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_package_format_and_server_load_without_training_code():
    code = ("import sys; import export.package, export.inference, export.serve.server, export.serve.http, "
            "export.serve.engine, export.serve.placement.controller, export.serve.placement.exchange, "
            "export.serve.placement.predictor, eval.models; "
            "print(sorted(m for m in sys.modules if m == 'distill' or m.startswith(('distill.', 'pipeline.train', "
            "'pipeline.teacher', 'deepspeed.runtime.engine'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "barrier", "monitored_barrier",
               "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather",
               "scatter", "send", "recv", "isend", "irecv", "all_gather_object", "broadcast_object_list"}
COMM_MODULES = {"torch.distributed", "deepspeed.comm"}


def _collective_calls(path: Path) -> list[str]:
    """`X.collective(...)` calls in `path` whose X is torch.distributed or deepspeed.comm (however imported)."""
    tree = ast.parse(path.read_text())
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name in COMM_MODULES and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch", "deepspeed"):
            aliases |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in COMM_MODULES}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            target = ast.unparse(node.func.value)
            if target in aliases or target in COMM_MODULES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node.func)}")
        elif isinstance(node, ast.ImportFrom) and node.module in COMM_MODULES and \
                {a.name for a in node.names} & COLLECTIVES:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module} import a collective")
    return found


def test_every_collective_goes_through_pipeline_dist():
    """pipeline/dist.py builds every collective's tensors on the accelerator's device (NCCL rejects CPU tensors), and
    the serving ranks' transport (export/serve/transport.py, on dist's process group and device) its per-step ones;
    nothing else calls torch.distributed or deepspeed.comm collectives directly."""
    homes = (ROOT / "pipeline" / "dist.py", ROOT / "export" / "serve" / "transport.py")
    calls = [c for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py")) if path not in homes
             for c in _collective_calls(path)]
    assert calls == []
    assert all(_collective_calls(home) for home in homes)  # the walker does see them where they are
