"""Tool contract: call/result records, the ``Tool`` base class and the name registry.

A tool is a callable object with a ``name`` (its XML tag in the prompt format) that turns the
text between ``<name>`` and ``</name>`` into a :class:`ToolResult`. Tools are registered by name
so configs can refer to them; adding one is a small subclass plus ``@register_tool("name")``.

Deliberately left out: async tools (the runner gives each call a thread; tools block), tool
schemas/JSON arguments (the prompt format passes one free-text payload), and retries (a tool
call has side effects in general; re-running it is the caller's decision, never ours).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, TypeVar

import msgspec

from aepo_engine.plugins import import_user_code
from aepo_engine.tools.config import ToolsConfig

# ---------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call parsed from model output.

    Args:
        tool: the tool name (the tag), e.g. ``"search"``.
        payload: the text between the tags, stripped of surrounding whitespace.
    """

    tool: str
    payload: str


@dataclass(frozen=True)
class MalformedToolCall:
    """An opened-but-broken call (unclosed/nested tags, empty or oversized payload, unknown tool).

    Args:
        reason: a short human-readable reason; it is shown to the model as the tool result.
        tool: the tool name when it could be told, else None.
    """

    reason: str
    tool: str | None = None


@dataclass
class ToolResult:
    """What one tool call returned.

    Args:
        text: the text shown to the model (already truncated by the tool).
        ok: False when the call failed (bad call, tool error, timeout, non-zero exit).
        error: a short machine-oriented reason when ``ok`` is False.
        elapsed_s: wall-clock seconds the call took.
        timed_out: True when the call was stopped by a time limit.
    """

    text: str
    ok: bool
    error: str | None = None
    elapsed_s: float = 0.0
    timed_out: bool = False


def error_result(message: str, *, timed_out: bool = False, elapsed_s: float = 0.0) -> ToolResult:
    """A failed result whose text tells the model what went wrong.

    Args:
        message: the reason, used both as ``error`` and (prefixed) as ``text``.
        timed_out: whether a time limit stopped the call.
        elapsed_s: wall-clock seconds spent.

    Returns:
        ``ToolResult(ok=False)`` with text ``"Error: <message>"``.
    """
    return ToolResult(f"Error: {message}", ok=False, error=message, elapsed_s=elapsed_s,
                      timed_out=timed_out)


def truncate_text(text: str, max_chars: int) -> str:
    """Cut ``text`` to at most ``max_chars`` characters, marking the cut.

    Args:
        text: the text to shorten.
        max_chars: the budget; the result (marker included) never exceeds it.

    Returns:
        ``text`` unchanged when it fits, else its head plus ``"\\n...[truncated N chars]"``.
    """
    if len(text) <= max_chars:
        return text
    marker = f"\n...[truncated {len(text)} chars]"
    keep = max(0, max_chars - len(marker))
    return (text[:keep] + marker)[:max_chars]


# ---------------------------------------------------------------------------------------------
# Tool base class and registry


class Tool:
    """Base class of all tools. Subclasses set ``name`` and implement ``__call__``.

    ``__call__`` must not raise for bad input from the model (return an error result instead);
    the runner still catches anything that escapes so one broken tool cannot stop a rollout.
    """

    name: str = ""

    def __call__(self, payload: str) -> ToolResult:
        raise NotImplementedError

    @classmethod
    def from_options(cls, **options: Any) -> "Tool":
        """Build the tool from keyword options (``build_tool`` calls this).

        Args:
            **options: constructor keyword arguments; subclasses may validate them into a config.

        Returns:
            A new tool instance.
        """
        return cls(**options)

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        """Check ``options`` (a ``tools.options.NAME`` table) without building the tool.

        Raises:
            TypeError: the constructor takes no such keywords.
        """
        inspect.signature(cls).bind_partial(**options)

    def close(self) -> None:
        """Release resources (connections, indices). The default does nothing."""


class ConfiguredTool(Tool):
    """A tool configured by one ``msgspec`` struct (``config_type``), as the built-in tools are.

    ``build_tool`` passes either the struct (``config=...``) or its fields as keywords, which
    are validated into one; subclasses set ``config_type`` and implement :meth:`from_config`.
    """

    config_type: ClassVar[type]

    @classmethod
    def from_config(cls, config: Any, max_result_chars: int) -> Tool:
        """Build the tool from its validated config.

        Args:
            config: an instance of ``config_type``.
            max_result_chars: the result text is cut to this many characters.

        Returns:
            A new tool instance.
        """
        raise NotImplementedError

    @classmethod
    def from_options(cls, config: Any = None, max_result_chars: int = 3000, **fields: Any) -> Tool:
        """Build from a ``config_type`` instance or from its fields as keywords (validated).

        Raises:
            TypeError: both ``config`` and fields were given.
            msgspec.ValidationError: a field is unknown or has a bad value.
        """
        if config is None:
            config = msgspec.convert(fields, cls.config_type)
        elif fields:
            raise TypeError(f"pass either config or config fields, not both: {sorted(fields)}")
        return cls.from_config(config, max_result_chars)

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        """Check ``options`` against ``config_type`` (unknown fields, types, its checks).

        Raises:
            msgspec.ValidationError, ValueError: what is wrong, naming the field.
        """
        msgspec.convert(options, cls.config_type)


_REGISTRY: dict[str, type[Tool]] = {}
ToolT = TypeVar("ToolT", bound=type[Tool])


def register_tool(name: str) -> Callable[[ToolT], ToolT]:
    """Class decorator: register a :class:`Tool` subclass under ``name`` (its tag).

    Args:
        name: the tag the model writes, e.g. ``"search"`` for ``<search>...</search>``.

    Returns:
        The decorator; it sets ``cls.name = name`` and returns the class unchanged otherwise.
    """
    if not name.isidentifier():
        raise ValueError(f"tool name {name!r} must be an identifier because it is an XML tag")

    def decorate(cls: ToolT) -> ToolT:
        if not (isinstance(cls, type) and issubclass(cls, Tool)):
            raise TypeError(f"@register_tool({name!r}) needs a Tool subclass, got {cls!r}")
        previous = _REGISTRY.get(name)
        if previous is not None and previous is not cls:
            raise ValueError(f"tool name {name!r} is already registered by {previous.__qualname__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def registered_tools() -> list[str]:
    """Names of all registered tools, sorted."""
    return sorted(_REGISTRY)


def build_tool(name: str, **options: Any) -> Tool:
    """Instantiate the registered tool ``name``.

    Args:
        name: a registered tool name.
        **options: passed to the tool's ``from_options``.

    Returns:
        The tool instance.

    Raises:
        KeyError: when no tool has that name (the message lists the registered names).
    """
    cls = _REGISTRY.get(name)
    if cls is None:
        raise KeyError(f"unknown tool {name!r}; registered tools: {registered_tools()}")
    return cls.from_options(**options)


# ---------------------------------------------------------------------------------------------
# The tools of a run (the ``tools`` config section)


def tool_problems(cfg: ToolsConfig) -> list[str]:
    """Every problem of the ``tools`` section that needs the registry: ``tools.path`` that does
    not import, an enabled tool nothing registered, ``tools.options`` a tool does not take.

    Returns:
        One message per problem, each naming the setting.
    """
    if cfg.path:
        try:
            import_user_code(cfg.path, "tools.path")
        except ValueError as err:
            return [str(err)]
    known = registered_tools()
    problems = [f"tools.enabled names {name!r}, which is no registered tool ({', '.join(known)}); a tool of "
                "your own is registered by its module, named in tools.path"
                for name in cfg.enabled if name not in known]
    for name, options in cfg.options.items():
        if name not in known:
            problems.append(f"tools.options.{name}: no tool {name!r} is registered ({', '.join(known)})")
            continue
        try:
            _REGISTRY[name].check_options(options)
        except (TypeError, ValueError, msgspec.ValidationError) as err:
            problems.append(f"tools.options.{name}: {err}")
    return problems


def build_tools(cfg: ToolsConfig) -> dict[str, Tool]:
    """Instantiate the enabled tools (``tools.path`` imported first).

    Args:
        cfg: the tools config. A built-in tool gets its own section (``cfg.section(name)``), any
            other its ``tools.options`` table as keywords; every tool gets ``max_result_chars``.

    Returns:
        ``{name: Tool}`` in ``cfg.enabled`` order.

    Raises:
        ValueError: ``tools.path`` does not import, or a tool's options do not fit it (naming the
            setting).
        KeyError: an enabled tool nothing registered.
    """
    if cfg.path:
        import_user_code(cfg.path, "tools.path")
    tools = {}
    for name in cfg.enabled:
        section = cfg.section(name)
        if section is not None:
            tools[name] = build_tool(name, max_result_chars=cfg.result_max_chars, config=section)
            continue
        try:
            tools[name] = build_tool(name, max_result_chars=cfg.result_max_chars, **cfg.options.get(name, {}))
        except (TypeError, msgspec.ValidationError) as err:
            raise ValueError(f"tools.options.{name}: {err}") from err
    return tools
