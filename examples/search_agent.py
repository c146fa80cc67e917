"""An agent written only against the OpenAI API, trained by aepo_engine through its gateway.

    python -m aepo_engine.train --agent.function=examples/search_agent.py:run   # from the repository root

It answers the synthetic task's questions with two tools it implements itself: ``search`` (a
keyword search over the task's corpus, a JSONL of ``{"id", "contents"}`` pages) and ``python``
(``print(<arithmetic>)`` lines, evaluated without exec). Nothing here imports aepo_engine: the
engine calls ``run(task, client)`` with a client whose base URL is the episode's gateway session,
and the episode's reward is what ``run`` returns.

The tool schemas are the ones the engine's own tool loop offers: in the chat template's format
(``--tools.format=chat_template``) the prompt the policy reads, and was warm-started on, is then the
same; in the paper's tag format (the default) the gateway writes the calls and results as tags and
the schemas give the tools' names and their one argument.
"""
from __future__ import annotations

import ast
import json
import operator
import re

SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the knowledge base; returns the best matching pages.",
    "parameters": {"type": "object", "properties": {"query": {
        "type": "string", "description": "Search the knowledge base; returns the best matching pages."}},
        "required": ["query"]}}}
PYTHON = {"type": "function", "function": {
    "name": "python", "description": "Run Python code in a sandbox; returns what it prints.",
    "parameters": {"type": "object", "properties": {"code": {
        "type": "string", "description": "Run Python code in a sandbox; returns what it prints."}},
        "required": ["code"]}}}
MAX_TURNS = 6
TOP_PAGES = 1

_corpora: dict[str, list[tuple[set[str], str]]] = {}
_WORD = re.compile(r"\w+")


def _pages(path: str) -> list[tuple[set[str], str]]:
    """The corpus's pages with their words (read once per process)."""
    if path not in _corpora:
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        _corpora[path] = [(set(_WORD.findall(row["contents"].lower())), row["contents"]) for row in rows]
    return _corpora[path]


def search(corpus: str, query: str) -> str:
    """The pages sharing the most words with the query, as ``Page 1: ...`` lines ("" for none)."""
    words = set(_WORD.findall(query.lower()))
    scored = sorted(((len(words & page_words), i) for i, (page_words, _) in enumerate(_pages(corpus))),
                    key=lambda x: (-x[0], x[1]))
    hits = [_pages(corpus)[i][1] for score, i in scored[:TOP_PAGES] if score > 0]
    return "\n".join(f"Page {n}: {text}" for n, text in enumerate(hits, start=1))


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _arithmetic(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arithmetic(node.left), _arithmetic(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_arithmetic(node.operand)
    raise ValueError("only integer + - * is supported")


def python(code: str) -> str:
    """What ``print(<arithmetic>)`` lines print; an error line for anything else."""
    try:
        out = []
        for statement in ast.parse(code.strip()).body:
            call = statement.value if isinstance(statement, ast.Expr) else None
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "print"
                    and len(call.args) == 1):
                raise ValueError("only print(expression) is supported")
            out.append(str(_arithmetic(call.args[0])))
        return "\n".join(out)
    except (SyntaxError, ValueError, RecursionError) as error:
        return f"Error: {error}"


def boxed_answer(text: str) -> str | None:
    """The last ``\\boxed{...}`` inside ``<answer>...</answer>``."""
    answers = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", answers[-1]) if answers else []
    return boxed[-1].strip() if boxed else None


async def run(task: dict, client) -> dict:
    """One episode: ask, run the tool calls the model makes, grade the final answer."""
    messages = list(task["messages"])
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[SEARCH, PYTHON])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        call = message.tool_calls[0]
        arguments = json.loads(call.function.arguments)
        if call.function.name == "search":
            result = search(task["search_corpus"], str(arguments.get("query", "")))
        else:
            result = python(str(arguments.get("code", "")))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = boxed_answer(messages[-1].get("content") or "") if messages[-1]["role"] == "assistant" else None
    correct = answer is not None and answer.lower() in {g.lower() for g in task["ground_truth"]}
    return {"reward": 1.0 if correct else 0.0, "correct": correct}
