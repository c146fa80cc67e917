"""The python tool's sandbox against escape attempts: each is contained and reported, and the
runner keeps working afterwards.

What is asserted depends on the machine, and the skips say why: uid separation needs root (it
is what makes RLIMIT_NPROC and write denial work), the network/PID containment needs working
``unshare`` namespaces.
"""
import os
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from aepo_engine.tools import PythonConfig, ToolCall, ToolRunner, build_tool
from aepo_engine.tools.sandbox import namespaces_work, run_python

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="sandbox uid separation needs root")
needs_netns = pytest.mark.skipif(not namespaces_work(),
                                 reason="`unshare --net --pid` does not work on this machine")

FAST = dict(timeout_s=2.0, cpu_s=2, memory_mb=256)


# "full": everything this machine allows; "bare": no namespaces, no uid - what a non-root
# machine without user namespaces gets (rlimits, scrubbed env, process-group kill only).
MODES = {"full": {}, "bare": {"isolation": "none", "run_as_uid": "engine"}}


@pytest.fixture(scope="module", params=sorted(MODES))
def python_tool(request):
    return build_tool("python", **MODES[request.param], **FAST)


def _processes_with(token: str) -> list[int]:
    """PIDs whose command line contains ``token``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and token.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_prints_and_reports_errors(python_tool):
    assert python_tool("print(6 * 7)").text == "42\n"
    assert python_tool("```python\nprint('fenced')\n```").text == "fenced\n"
    empty = python_tool("x = 1")
    assert empty.ok and empty.text == "(no output)"
    failed = python_tool("print('before')\n1 / 0")
    assert not failed.ok and failed.error == "exit status 1"
    assert failed.text.startswith("before\nTraceback") and 'File "main.py", line 2' in failed.text
    assert "ZeroDivisionError" in failed.text and "_bootstrap" not in failed.text


def test_code_runs_exactly_once(tmp_path):
    # The reference re-runs code with empty output; here a run with side effects and no output
    # must run once. The counter file lives outside the sandbox, so run as the engine's uid.
    counter = tmp_path / "count"
    counter.write_text("")
    tool = build_tool("python", run_as_uid="engine", **FAST)
    result = tool(f"open({str(counter)!r}, 'a').write('x')")
    assert result.ok and result.text == "(no output)"
    assert counter.read_text() == "x"


def test_infinite_loop_times_out(python_tool):
    result = python_tool("while True:\n    pass")
    assert not result.ok
    # either the wall clock (2 s) or the CPU limit (2 s) stops it, whichever comes first
    assert result.timed_out or result.error.startswith("CPU time limit")
    assert result.elapsed_s < 6


def test_sleep_is_stopped_by_wall_clock(python_tool):
    result = python_tool("import time\nprint('started', flush=True)\ntime.sleep(60)")
    assert result.timed_out and result.text.startswith("started\n[timeout")


def test_memory_hog_is_denied(python_tool):
    result = python_tool("blob = bytearray(2 * 1024**3)\nprint(len(blob))")
    assert not result.ok and "MemoryError" in result.text


def test_huge_output_is_capped():
    tool = build_tool("python", max_output_bytes=10_000, max_result_chars=500, **FAST)
    result = tool("while True:\n    print('x' * 1000)")
    assert not result.ok and result.error.startswith("output limit")
    assert len(result.text) <= 500 and result.text.endswith("bytes of output]")
    assert result.elapsed_s < 5  # killed at the cap, not at the timeout


def test_environment_secret_is_not_visible(python_tool, monkeypatch):
    monkeypatch.setenv("AEPO_TEST_SECRET", "hunter2-" + uuid.uuid4().hex)
    secret = os.environ["AEPO_TEST_SECRET"]
    code = (f"import os\nprint(sorted(os.environ))\n"
            f"try:\n    print(open('/proc/{os.getpid()}/environ', 'rb').read())\n"
            f"except OSError as e:\n    print('denied', e)")
    result = python_tool(code)
    assert result.ok
    assert secret not in result.text and "AEPO_TEST_SECRET" not in result.text
    assert result.text.startswith("['HOME', 'LANG', 'MKL_NUM_THREADS', 'OMP_NUM_THREADS', "
                                  "'OPENBLAS_NUM_THREADS', 'PATH', 'TMPDIR']\n")


@pytest.mark.parametrize("run_as_uid", [61_000, "engine"])
def test_workdir_is_fresh_and_removed(run_as_uid):
    # chmod 000 on a sub-directory must not leave the work dir behind
    code = ("import os\nos.makedirs('d/e')\nopen('d/e/f.txt', 'w').write('x')\n"
            "os.chmod('d/e', 0)\nos.chmod('d', 0)\nprint(os.getcwd(), os.listdir('.'))")
    outcome = run_python(code, PythonConfig(run_as_uid=run_as_uid, **FAST))
    workdir, listing = outcome.stdout.split(" ", 1)
    assert outcome.returncode == 0 and Path(workdir).name.startswith("aepo_py_")
    assert listing.strip() == "['main.py', 'd']" or listing.strip() == "['d', 'main.py']"
    assert not Path(workdir).exists()


@needs_root
def test_concurrent_runs_get_distinct_uids():
    config = PythonConfig(**FAST)
    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(lambda _: run_python("import time; time.sleep(0.3)", config),
                                 range(4)))
    assert all(o.returncode == 0 for o in outcomes)
    assert len({o.uid for o in outcomes}) == 4


@needs_root
def test_writes_outside_the_workdir_are_denied_or_cleaned(tmp_path):
    # tmp_path is root-owned: denied. /tmp and the work dir's parent are world-writable: the
    # write succeeds (no filesystem namespace) but everything the sandbox uid left is removed.
    token = uuid.uuid4().hex
    protected = tmp_path / "protected.txt"
    code = (f"import os\n"
            f"for path in [{str(protected)!r}, '/tmp/aepo_escape_{token}', '../aepo_up_{token}']:\n"
            f"    try:\n        open(path, 'w').write('x'); print('wrote', path)\n"
            f"    except OSError as e:\n        print('denied', path, type(e).__name__)")
    outcome = run_python(code, PythonConfig(**FAST))
    assert f"denied {protected} PermissionError" in outcome.stdout
    assert outcome.uid is not None and outcome.uid != 0
    assert not protected.exists()
    assert not list(Path("/tmp").glob(f"*{token}*")), "files left by the sandbox uid remain"


@needs_root
@pytest.mark.parametrize("isolation", ["auto", "none"])
def test_fork_bomb_is_bounded_by_nproc_and_cleaned_up(isolation):
    # "none": no PID namespace; the setsid children escape the process-group kill and are
    # caught by killing every process of the sandbox uid.
    token = uuid.uuid4().hex
    code = (f"import os, sys\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
            f"            os.setsid()\n"  # try to escape the process group
            f"            os.execv(sys.executable, [sys.executable, '-c', "
            f"'import time; time.sleep(600)', '{token}'])\n"
            f"        n += 1\nexcept OSError as e:\n    print('fork refused after', n, e.errno)")
    outcome = run_python(code, PythonConfig(nproc=16, isolation=isolation, **FAST))
    assert "fork refused after" in outcome.stdout  # RLIMIT_NPROC bites for the sandbox uid
    assert int(outcome.stdout.split()[3]) < 16
    assert _processes_with(token) == [], "fork bomb children survived the run"


@needs_root
@needs_netns
def test_as_root_nproc_is_ignored_but_the_pid_namespace_kills_everything():
    # What actually happens without uid separation: the kernel does not apply RLIMIT_NPROC to
    # root, so 40 forks succeed under nproc=8; the PID namespace still reaps them all.
    token = uuid.uuid4().hex
    code = (f"import os, sys\nfor _ in range(40):\n    if os.fork() == 0:\n        os.setsid()\n"
            f"        os.execv(sys.executable, [sys.executable, '-c', "
            f"'import time; time.sleep(600)', '{token}'])\nprint('forked 40')")
    outcome = run_python(code, PythonConfig(nproc=8, run_as_uid="engine", **FAST))
    assert outcome.stdout == "forked 40\n" and outcome.uid is None
    assert _processes_with(token) == []


@needs_netns
@pytest.mark.parametrize("mode, expected", [("full", "blocked"), ("bare", "connected")])
def test_network_is_unreachable(mode, expected):
    # "bare" documents the limit: without a network namespace the code reaches the host.
    tool = build_tool("python", **MODES[mode], **FAST)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), "
                f"timeout=1)\n    print('connected')\nexcept OSError as e:\n"
                f"    print('blocked', type(e).__name__)")
        result = tool(code)
    assert result.ok and result.text.startswith(expected)


def test_runner_survives_escape_attempts():
    tool = build_tool("python", **FAST)
    calls = [ToolCall("python", "while True: pass"),
             ToolCall("python", "import os\nos.kill(os.getpid(), 9)"),
             ToolCall("python", "print('x' * 10**8)"),
             ToolCall("python", "print('still fine')")]
    with ToolRunner({"python": tool}, max_workers=4) as runner:
        results = runner.run(calls)
        assert [r.ok for r in results] == [False, False, False, True]
        assert results[1].error == "killed by signal SIGKILL"
        assert results[3].text == "still fine\n"
        assert runner.run([ToolCall("python", "print(1)")])[0].text == "1\n"
        assert runner.stats["python"]["calls"] == 5 and runner.stats["python"]["errors"] == 3
