"""The authors' evaluation metrics, reproduced: ``eval.scoring = "authors"``.

Written from our reading of the AEPO/ARPO authors' public evaluation code (github.com/RUC-NLPIR/ARPO,
read at commit a95cd08: ``evaluation/src/utils.py`` (answer extraction), ``data_loader.py``
(golds), ``evaluator.py`` (the empty-prediction fallback, which metric is the accuracy),
``metrics.py`` (em, acc, f1, math_equal), ``math_equivalence.py`` (``is_equiv``) and
``evaluate_passk.sh`` (which sets are "math" and which "qa")), in our own code. It is checked
against our reading, not against their code run side by side.

1. The prediction (:func:`authors_prediction`), from the whole response *with* tool results:
   the text between the last ``</answer>`` and the ``<answer>`` before it; if that is non-empty,
   its last ``\\boxed`` (else ``\\fbox``) with braces counted from there (an unclosed one runs to
   the end), unwrapped when it is exactly ``\\boxed{...}``, and then unwrapped once more when
   what is left is exactly ``\\text{...}``; a block without a box (or with an empty one) is the
   prediction as it is.
   With no (non-empty) answer block, the same box rule on the whole response (no box: empty).
   An empty prediction becomes the last five lines of the response.
2. The task of a set: "math" for the maths sets (aime24, aime25, math500, gsm8k, math), "qa" for
   all others, HLE included.
3. Normalisation: lowercase, strip, collapse whitespace; "qa" also drops the articles a/an/the.
   Punctuation is kept ("Lowy." is not "lowy"). Tokens are split on whitespace only (a Chinese
   answer is one token).
4. Metrics, the best over the golds for "qa": ``em`` (normalised strings equal), ``acc``
   (normalised gold is a substring of the normalised prediction), ``f1`` (token F1, no
   yes/no rule) and ``math_equal`` (:func:`is_equiv` of the normalised strings). A "qa" gold
   that is a string starting with ``[`` is split on commas (quotes and inner brackets kept); a
   "math" gold is one string (a list is compared as its Python text).
5. :func:`is_equiv`: the MATH-dataset string clean-up (``\\left``/``\\right``, ``\\!``, degrees,
   ``\\$``, ``\\%``, units after ``\\text{ ``, ``k = `` prefixes, ``\\frac12``, ``\\sqrt3``, ``a/b``,
   ``0.5``) and string equality; a clean-up that fails compares the raw strings.
6. Their paper number: the mean ``math_equal`` ("math") or mean ``f1`` ("qa"); with a judge, the
   mean judge verdict.

Their mistakes are reproduced on purpose (the point is a number comparable with the paper's
table): a gold ``025`` rejects ``25``; GSM8K golds lose their thousands commas but predictions
keep theirs (``1,000`` is wrong against gold ``1,000``); ``\\text{}`` is unwrapped from the
prediction only; an HLE gold ``[11,19,22]`` becomes three golds, any of which is an exact match.

What is ours: ``correct`` (what pass@k counts) is ``math_equal`` for "math" sets and ``em`` for
"qa" sets (their paper reports mean F1 there, which is not a yes/no outcome; docs/scoring.md);
an integer gold in a "qa" set is compared as its decimal string (theirs raises).
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Any

__all__ = ["authors_metrics", "authors_normalize", "authors_prediction", "authors_task", "gsm8k_gold", "is_equiv",
           "strip_math_string"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_GSM8K_ANSWER = re.compile(r"#### (-?[0-9.,]+)")
_FALLBACK_LINES = 5


def authors_task(check: str) -> str:
    """Their task of a set with answer check ``check``: "math" for maths sets, else "qa" (HLE too)."""
    return "math" if check == "math" else "qa"


def gsm8k_gold(solution: str) -> str | None:
    """Their GSM8K gold: the number after ``#### `` with its commas removed (None without one)."""
    match = _GSM8K_ANSWER.search(solution)
    return match.group(1).replace(",", "") if match else None


# ---------------------------------------------------------------------------------------------
# The prediction.

def _last_box(text: str) -> str:
    """Their last box of ``text``: from the last ``\\boxed`` (else ``\\fbox``) to the brace that
    brings the count back to 0, or to the end; "" when there is none."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
    if start < 0:
        return ""
    depth = 0
    for pos in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[pos], 0)
        if text[pos] == "}" and depth == 0:
            return text[start:pos + 1]
    return text[start:]


def _unbox(box: str) -> str:
    """``\\boxed{x}`` -> x, then ``\\text{y}`` -> y; anything else is kept as it is."""
    if box.startswith("\\boxed{") and box.endswith("}"):
        box = box[len("\\boxed{"):-1]
        if box.startswith("\\text{") and box.endswith("}"):
            box = box[len("\\text{"):-1]
    return box


def authors_prediction(response: str) -> str:
    """Their prediction of a response (module docstring, rule 1).

    Args:
        response: the model's text with the tool results in it.

    Returns:
        The prediction; "" only when the response is blank.
    """
    end = response.rfind("</answer>")
    start = response.rfind("<answer>", 0, end) if end != -1 else -1
    block = response[start + len("<answer>"):end] if start != -1 else ""
    if block:
        box = _last_box(block.strip())
        prediction = (_unbox(box) if box else "") or block  # an empty box gives the block too
    else:
        prediction = _unbox(_last_box(response.strip()))
    if not prediction:
        lines = response.replace("\n\n", "\n").strip().split("\n")
        prediction = "\n".join(lines[-_FALLBACK_LINES:])
    return prediction


# ---------------------------------------------------------------------------------------------
# Maths string equivalence.

def _fix_sqrt(text: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}`` (one character); a trailing ``\\sqrt`` is an error."""
    head, *pieces = text.split("\\sqrt")
    out = [head]
    for piece in pieces:
        if not piece:
            raise ValueError("\\sqrt with nothing after it")
        out.append("\\sqrt" + piece if piece[0] == "{" else "\\sqrt{" + piece[0] + "}" + piece[1:])
    return "".join(out)


def _fix_fracs(text: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{2}`` -> ``\\frac{1}{2}``; a ``\\frac`` followed by
    one character leaves the whole text unchanged; by nothing, an error."""
    head, *pieces = text.split("\\frac")
    out = [head]
    for piece in pieces:
        if not piece:
            raise ValueError("\\frac with nothing after it")
        if piece[0] == "{":
            out.append("\\frac" + piece)
        elif len(piece) < 2:
            return text
        elif piece[1] != "{":
            out.append("\\frac{" + piece[0] + "}{" + piece[1] + "}" + piece[2:])
        else:
            out.append("\\frac{" + piece[0] + "}" + piece[1:])
    return "".join(out)


def _fix_slash(text: str) -> str:
    """``3/4`` -> ``\\frac{3}{4}`` when both sides are plain integers written canonically."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        canonical = text == f"{int(parts[0])}/{int(parts[1])}"
    except ValueError:
        return text
    return f"\\frac{{{parts[0]}}}{{{parts[1]}}}" if canonical else text


def strip_math_string(text: str) -> str:
    """Their MATH-dataset clean-up of one answer (module docstring, rule 5).

    Raises:
        ValueError: where theirs raises (two ``\\text{ `` units, a dangling ``\\sqrt``/``\\frac``).
    """
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        text = text.replace(old, new)
    if "\\text{ " in text:  # a unit: keep what precedes it
        parts = text.split("\\text{ ")
        if len(parts) != 2:
            raise ValueError("more than one \\text{ unit")
        text = parts[0]
    text = text.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5" -> " 5"
        text = sides[1]
    text = _fix_fracs(_fix_sqrt(text).replace(" ", ""))
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _fix_slash(text)


def is_equiv(first: Any, second: Any) -> bool:
    """Their maths equivalence: the cleaned-up strings are equal; when a clean-up fails (or an
    argument is not a string), the arguments themselves are compared."""
    if first is None or second is None:
        return first is None and second is None
    try:
        return strip_math_string(first) == strip_math_string(second)
    except (ValueError, AttributeError):
        return first == second


# ---------------------------------------------------------------------------------------------
# Metrics.

def authors_normalize(text: Any, remove_articles: bool = False) -> str:
    """Their normalisation (module docstring, rule 3); non-strings are read as ``str()``."""
    text = str(text).lower().strip()
    if remove_articles:
        text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _f1(prediction: str, gold: str) -> float:
    pred, ref = prediction.split(), gold.split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if not common:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def _pair(prediction: str, gold: str) -> dict[str, float]:
    return {"em": float(prediction == gold), "acc": float(gold in prediction), "f1": _f1(prediction, gold),
            "math": float(is_equiv(prediction, gold))}


def _qa_golds(gold: Any) -> list[Any]:
    if isinstance(gold, str):
        if not gold.startswith("["):
            return [gold]
        return [item.strip() for item in re.split(r",\s*", gold.strip("[]"))]
    if isinstance(gold, (list, tuple)):
        return list(gold)
    return [gold]  # an int: theirs raises here; compared as its decimal string


def authors_metrics(prediction: str, gold: Any, task: str) -> dict[str, float]:
    """Their ``em``, ``acc``, ``f1`` and ``math`` (math_equal) of one prediction.

    Args:
        prediction: :func:`authors_prediction` of the response.
        gold: the gold as their loader reads it (a string, an int, or a list of strings).
        task: "math" or "qa" (:func:`authors_task`).

    Returns:
        ``{em, acc, f1, math}``; all 0 for an empty prediction.
    """
    if task not in ("math", "qa"):
        raise ValueError(f"unknown authors' task {task!r}: use math or qa")
    zero = {"em": 0.0, "acc": 0.0, "f1": 0.0, "math": 0.0}
    if not prediction:
        return zero
    if task == "math":
        return _pair(authors_normalize(prediction), authors_normalize(gold))
    pred = authors_normalize(prediction, remove_articles=True)
    scores = dict(zero)
    for item in _qa_golds(gold):
        for key, value in _pair(pred, authors_normalize(item, remove_articles=True)).items():
            scores[key] = max(scores[key], value)
    return scores
