"""The ``<python>`` tool: run model-written code once in the sandbox and report what it printed.

Result text: stdout on success (``"(no output)"`` when empty); on failure stdout followed by
stderr (the traceback) and a line saying why the run stopped (timeout, CPU limit, output cap,
signal). The result is cut to ``max_result_chars``.

Deliberately left out: retries - the reference code re-runs code whose output was empty, which
repeats side effects and doubles cost (docs/algorithm.md §4); here every call runs exactly once. Also left
out: persistent interpreter state across calls (each call is a fresh process, so a trajectory
that needs earlier definitions must repeat them, as in the reference prompt format).
"""
from __future__ import annotations

import logging
import signal

from aepo_engine.tools.base import ConfiguredTool, ToolResult, error_result, register_tool, truncate_text
from aepo_engine.tools.config import PythonConfig
from aepo_engine.tools.sandbox import (SandboxOutcome, check_cgroup, check_isolation, describe_limits,
                                      run_python)

NO_OUTPUT = "(no output)"
logger = logging.getLogger(__name__)


@register_tool("python")
class PythonTool(ConfiguredTool):
    """``<python>code</python>`` -> the code's output.

    Args:
        config: sandbox limits and isolation.
        max_result_chars: the result text is cut to this many characters.

    Raises:
        IsolationUnavailable: the configured isolation cannot be had here (the tool refuses to
            start rather than run generated code unisolated).
    """

    config_type = PythonConfig

    def __init__(self, config: PythonConfig | None = None, max_result_chars: int = 3000) -> None:
        self.config = config or PythonConfig()
        self.max_result_chars = max_result_chars
        self.isolation = check_isolation(self.config)  # fail early, not per call
        check_cgroup(self.config)
        logger.info("python tool: %s", describe_limits(self.config))

    @classmethod
    def from_config(cls, config: PythonConfig, max_result_chars: int) -> "PythonTool":
        """Build from a validated :class:`PythonConfig` (``build_tool`` calls this)."""
        return cls(config, max_result_chars=max_result_chars)

    def __call__(self, payload: str) -> ToolResult:
        code = strip_code_fence(payload)
        if not code.strip():
            return error_result("empty python code")
        try:
            code.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: no file can hold it
            return error_result(f"the code is not valid text: {exc.reason} at character {exc.start}")
        try:
            outcome = run_python(code, self.config)
        except (OSError, RuntimeError) as exc:
            return error_result(f"could not start the sandbox: {exc}")
        return self._to_result(outcome)

    def _to_result(self, outcome: SandboxOutcome) -> ToolResult:
        reason = stop_reason(outcome, self.config)
        if reason is None:
            text = outcome.stdout if outcome.stdout.strip() else NO_OUTPUT
            return ToolResult(truncate_text(text, self.max_result_chars), ok=True,
                              elapsed_s=outcome.elapsed_s)
        output = "\n".join(p for p in (outcome.stdout.rstrip("\n"), outcome.stderr.rstrip("\n")) if p)
        footer = f"[{reason}]"
        budget = max(0, self.max_result_chars - len(footer) - 1)
        text = (truncate_text(output, budget) + "\n" + footer).lstrip("\n")
        return ToolResult(text[: self.max_result_chars], ok=False, error=reason,
                          elapsed_s=outcome.elapsed_s, timed_out=outcome.timed_out)


def stop_reason(outcome: SandboxOutcome, config: PythonConfig) -> str | None:
    """Why a run failed, in words for the model; None when it exited with status 0.

    Args:
        outcome: the sandbox outcome.
        config: the limits it ran under (quoted in the message).

    Returns:
        A one-line reason or None.
    """
    if outcome.timed_out:
        return f"timeout: killed after the {config.timeout_s:g}s wall-clock limit"
    if outcome.output_limited:
        return f"output limit: killed after {config.max_output_bytes} bytes of output"
    code = outcome.returncode
    if code == 0:
        return None
    if code is not None and code < 0:
        sig = signal.Signals(-code)
        if sig == signal.SIGXCPU:
            return f"CPU time limit: killed after {config.cpu_s}s of CPU"
        return f"killed by signal {sig.name}"
    return f"exit status {code}"


def strip_code_fence(payload: str) -> str:
    """Remove a Markdown code fence (```python ... ```) that models often wrap code in.

    Args:
        payload: the text between ``<python>`` and ``</python>``.

    Returns:
        The code without the fence lines, or the payload unchanged when there is no fence.
    """
    lines = payload.strip().splitlines()
    if len(lines) >= 2 and lines[0].startswith("```") and lines[-1].strip() == "```":
        return "\n".join(lines[1:-1])
    return payload
