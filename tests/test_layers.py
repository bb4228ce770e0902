"""The import contract of the runtime's packages: dependencies point one way.

    megatron/training  ->  recover_patches  ->  megatron.core / torch
    inside recover_patches:  collectives (layer 1)  <-  recovery (layer 2)  <-  workload (layer 3)
                             pipeline (the engine) beside them; launcher, supervisor, faults, log

A layer imports its own package, and a lower layer only through that layer's package (its public
names, e.g. `from recover_patches.collectives import PeerFailure`), never a module inside it; no
layer imports the pipeline engine, and the engine imports no layer but layer 1's public names.
Every import is read from the source (module level and inside functions), so a new one that
breaks the rule fails here, and so does an exception below that is no longer needed.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "recover_patches"
LAYERS = ["collectives", "recovery", "workload"]  # bottom to top
ENGINE = "pipeline"
COMMON = {f"{PACKAGE}.log"}  # logging set-up: anyone may use it

# Known violations, each with why it stands and what removes it. The test fails if one goes away
# without being deleted here, so this list only shrinks.
KNOWN = {
    # layer 3's finish-time model of the interleaved schedule is the schedule's own simulation
    ("recover_patches.workload.policy", "recover_patches.pipeline.interleaved"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports (for `from X import a`: X.a when that is a module, else X)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                is_module = (REPO / Path(*sub.split("."))).with_suffix(".py").exists() or \
                    (REPO / Path(*sub.split(".")) / "__init__.py").exists()
                found.add(sub if is_module else node.module)
    return found


def package_of(module: str) -> str | None:
    """The layer or engine package a recover_patches module belongs to (None: top level)."""
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) < 2 or parts[1] not in [*LAYERS, ENGINE]:
        return None
    return parts[1]


def violation(importer: str, imported: str) -> str | None:
    """Why `importer` may not import `imported`, or None."""
    if imported.startswith(("megatron.training", "scripts", "pretrain_gpt_recover")):
        return "the runtime package imports nothing above it"
    if not imported.startswith(PACKAGE + ".") or imported in COMMON:
        return None
    mine, theirs = package_of(importer), package_of(imported)
    if mine is None or mine == theirs:
        return None
    public_root = imported == f"{PACKAGE}.{theirs}"
    if mine == ENGINE:
        return None if theirs == "collectives" and public_root else "the engine uses no layer"
    if theirs is None:
        return f"layer {mine} imports a top-level module"
    if theirs == ENGINE:
        return f"layer {mine} imports the pipeline engine"
    if LAYERS.index(theirs) > LAYERS.index(mine):
        return f"layer {mine} imports the layer above it ({theirs})"
    return None if public_root else f"layer {mine} reaches inside {theirs} (use its package)"


def runtime_violations() -> dict[tuple[str, str], str]:
    found = {}
    for path in sorted((REPO / PACKAGE).rglob("*.py")):
        importer = module_name(path)
        for imported in imports_of(path):
            why = violation(importer, imported)
            if why is not None:
                found[(importer, imported)] = why
    return found


def test_the_runtime_packages_import_one_way():
    found = runtime_violations()
    new = {pair: why for pair, why in found.items() if pair not in KNOWN}
    assert not new, "\n".join(f"{a} imports {b}: {why}" for (a, b), why in new.items())
    gone = KNOWN - set(found)
    assert not gone, f"no longer violated, delete from KNOWN: {sorted(gone)}"


def test_the_contract_sees_what_it_forbids():
    """Negative controls: each kind of import the contract forbids is reported."""
    cases = {
        ("recover_patches.collectives.membership", "recover_patches.recovery.grow"): "above",
        ("recover_patches.recovery.iteration", "recover_patches.pipeline.schedule"): "engine",
        ("recover_patches.recovery.iteration", "recover_patches.collectives.rendezvous"): "inside",
        ("recover_patches.pipeline.p2p", "recover_patches.recovery.reduce"): "no layer",
        ("recover_patches.workload.policy", "megatron.training.training"): "above it",
        ("recover_patches.recovery.grow", "recover_patches.faults"): "top-level",
    }
    for (importer, imported), word in cases.items():
        why = violation(importer, imported)
        assert why is not None and word in why, (importer, imported, why)
    assert violation("recover_patches.recovery.iteration", "recover_patches.collectives") is None
    assert violation("recover_patches.pipeline.p2p", "recover_patches.collectives") is None
    assert violation("recover_patches.launch", "recover_patches.collectives.nccl_env") is None
    # the reader finds imports inside functions too
    assert "recover_patches.collectives.coordinator" in imports_of(
        REPO / PACKAGE / "collectives" / "launcher_link.py")


# Runtime files not under the 400-line limit, with why they stand (the list only shrinks; the
# distributed optimizer was the last: its weight gathers and re-shard moves are modules now).
LONG_FILES: set[str] = set()
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def runtime_files() -> list[Path]:
    return [*sorted((REPO / PACKAGE).rglob("*.py")),
            *sorted((REPO / "megatron" / "training").rglob("*.py")),
            REPO / "pretrain_gpt_recover.py"]


def test_runtime_files_and_functions_stay_readable():
    """Files under 400 lines, functions under 60 (the project's style), so a reader can hold one."""
    long_files, long_functions = set(), []
    for path in runtime_files():
        source = path.read_text()
        name = str(path.relative_to(REPO))
        if len(source.splitlines()) >= MAX_FILE_LINES:
            long_files.add(name)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length >= MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}:{node.lineno} {node.name} ({length} lines)")
    assert not long_functions, long_functions
    assert long_files - LONG_FILES == set(), sorted(long_files - LONG_FILES)
    assert LONG_FILES - long_files == set(), f"now short, delete from LONG_FILES: {LONG_FILES - long_files}"


# --- megatron/training: its packages (and its few top-level modules) and whom each may use ------
TRAINING = "megatron.training"
# Bottom to top. A unit is a sub-package or a top-level module of megatron.training; it may import
# itself and the units listed here, nothing else of megatron.training (recover_patches and
# megatron.core are below all of them). Adding a dependency is a design change: say why here.
TRAINING_USES: dict[str, set[str]] = {
    "errors": set(),  # the user-mistake exception shape every front-end check raises
    "replication": set(), "profiling": set(), "straggler": set(),
    "rerun": set(),  # Megatron's rerun state machine
    # the typed configuration reads the feature configs of rerun, profiling and the straggler log
    "config": {"errors", "profiling", "rerun", "straggler"},
    "arguments": {"errors", "config", "replication"},
    "data": {"errors", "config"},
    "model": {"errors", "config"},
    "optimizer": {"errors", "config"},
    "initialize": {"optimizer"},  # the distributed optimizer's shard domains are a group's
    "collective_backend": {"config", "initialize"},
    "checkpointing": {"errors", "config", "initialize", "model", "optimizer"},
    "metrics": {"config"},
    "step": {"errors", "config", "initialize", "model", "optimizer", "rerun", "checkpointing"},
    "tools": {"errors", "config", "arguments", "data"},
    # the running job as checkpoints and joins see it
    "live_job": {"checkpointing", "initialize", "metrics", "optimizer", "step"},
    "training": {"config", "initialize", "checkpointing", "live_job", "metrics", "optimizer",
                 "profiling", "step", "straggler"},
    "ending": {"checkpointing", "errors", "rerun", "step"},  # how a run that cannot go on ends
}
# Known exceptions (importer module, imported module), each with why it stands; only shrinks.
TRAINING_KNOWN: set[tuple[str, str]] = set()


def training_unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if module.startswith(TRAINING + ".") and len(parts) > 2 else None


def training_violation(importer: str, imported: str) -> str | None:
    mine, theirs = training_unit(importer), training_unit(imported)
    if mine is None or theirs is None or mine == theirs:
        return None
    if mine not in TRAINING_USES:
        return f"{mine} is not in the contract (add it to TRAINING_USES)"
    return None if theirs in TRAINING_USES[mine] else f"{mine} may not use {theirs}"


def training_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted((REPO / "megatron" / "training").rglob("*.py"))}


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one member (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            nxt = next((w for w in edges if w not in index or w in stack), None)
            if nxt is not None:
                if nxt in index:
                    low[node] = min(low[node], index[nxt])
                else:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = stack[stack.index(node):]
                del stack[stack.index(node):]
                if len(members) > 1:
                    loops.append(sorted(members))
    return loops


def training_graph() -> dict[str, set[str]]:
    modules = training_modules()
    return {name: {imported for imported in imports_of(path) if imported in modules
                   and imported != name} for name, path in modules.items()}


def test_megatron_training_packages_import_one_way():
    found = {(importer, imported): why for importer, imports in training_graph().items()
             for imported in imports
             if (why := training_violation(importer, imported)) is not None}
    new = {pair: why for pair, why in found.items() if pair not in TRAINING_KNOWN}
    assert not new, "\n".join(f"{a} imports {b}: {why}" for (a, b), why in new.items())
    gone = TRAINING_KNOWN - set(found)
    assert not gone, f"no longer violated, delete from TRAINING_KNOWN: {sorted(gone)}"


def test_megatron_training_has_no_import_loops_and_its_contract_has_an_order():
    assert import_loops(training_graph()) == []
    assert import_loops(TRAINING_USES) == []
    top = [path.stem if path.suffix else path.name
           for path in (REPO / "megatron" / "training").iterdir()
           if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").exists()]
    assert sorted(top) == sorted(TRAINING_USES), "every unit of megatron.training has a row"


def test_the_training_contract_sees_what_it_forbids():
    """Negative controls: a use the contract does not list, an upward one, a loop."""
    assert "may not use" in training_violation("megatron.training.config.io",
                                               "megatron.training.arguments.refused")
    assert "may not use" in training_violation("megatron.training.model",
                                               "megatron.training.step.replica")
    assert "not in the contract" in training_violation("megatron.training.newcomer",
                                                       "megatron.training.config")
    assert training_violation("megatron.training.step.replica",
                              "megatron.training.optimizer") is None
    assert training_violation("megatron.training.checkpointing.state",
                              "megatron.training.checkpointing.torch_dist") is None
    assert import_loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_loops({"a": {"b"}, "b": set()}) == []
