"""How far the project's scoring (``scoring="project"``) and the authors' rules (``scoring="authors"``)
agree, and how many deliberately wrong answers each accepts.

Cases are built at run time from the real gold answers of the shared eval sets
(``../shared/data/arpo/eval``, the first ``--questions`` of each of the 13 sets; nothing is
copied into the repository) and of the RL parquet sets (``../shared/data/arpo/rl_datasets``,
for the reward), each turned into systematic response variants:

- right answers in other clothes (case, articles, a full stop, quotes, ``\\text{}`` in the box, no
  box, a box in the reasoning or after the answer block, ``<answer>`` quoted by a tool result,
  ``x =`` prefixes, ``.0``, thousands commas, spaced Chinese): ``kind = "right"``;
- deliberately wrong answers (another question's gold, a flipped sign, a shifted decimal point,
  off by one, a swapped fraction, a changed interval bracket, a flipped ``+``/``-``, "not ...", a
  first word only): ``kind = "wrong"``;
- responses with no answer (truncated inside a box, no tags): ``kind = "none"``.

Every case is scored by ``score_response`` under ``scoring="project"`` and ``"authors"`` (and the
reward cases by ``deep_research`` under both ``rules``). A row per (set, variant) gives the
agreement of the two modes on the extracted answer, em, f1, acc, math and correct, and how many
cases each mode counts correct. What this checks, honestly: the reference mode against the
project's rules, and the reference mode against *our reading* of the authors' code. With
``--authors-code DIR`` (a checkout of github.com/RUC-NLPIR/ARPO) it also runs the authors' own
functions on the same cases (``evaluation/src``: extraction, ``Evaluator.evaluate_sample`` without
a judge; the verl ``reward_score/deep_research.py``) and reports how often our reference mode
gives exactly their numbers; nothing of theirs is copied here, the files are imported from DIR.

    python bench/bench_scoring_agreement.py --questions 10 --reward-rows 20 [--authors-code DIR]

Rows go to ``bench/results/scoring_agreement.jsonl`` (with the machine and the commit).
In the cases and rows, "engine" is the project's rules (``scoring="project"``), "reference" our
reproduction of the authors' rules (``scoring="authors"``; the keys keep the names the modes had when
the first rows were written, so old and new rows compare) and "authors" their own code.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import io
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import print_table, write_rows  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data" / "arpo"
METRICS = ("answer", "em", "f1", "acc", "math", "correct")
RL_SETS = ("valid", "hard_search_1k", "train_10k", "gaia_test", "hle_test")


def _wrap(answer: str, think: str = "<think>Let me reason.</think>") -> str:
    return f"{think}<answer>The final answer is \\[ \\boxed{{{answer}}} \\]</answer>"


def _plain(text: str) -> bool:
    return bool(re.search(r"[^\W\d_]", text)) and not re.search(r"[\d\\{}^_$=<>+*/|%\[\]-]", text)


def _integer(text: str) -> int | None:
    return int(text) if re.fullmatch(r"-?\d+", text.strip()) else None


def eval_variants(gold: str, other: str, aliases: list[str], check: str) -> list[tuple[str, str, str]]:
    """(variant, kind, response) for one gold answer; ``other`` is another question's gold; a
    "wrong" variant that happens to be one of the question's ``aliases`` is left out. Maths
    notations (``x =``, ``.0``, thousands commas) are variants on maths and mixed sets only."""
    known = {_loose(a) for a in aliases}
    out = [("exact", "right", _wrap(gold)), ("period", "right", _wrap(gold + ".")),
           ("no_box", "right", f"<think>t</think><answer>{gold}</answer>"),
           ("box_in_reasoning", "right", _wrap(gold, f"<think>maybe \\boxed{{{other}}}</think>")),
           ("box_after_answer", "right", _wrap(gold) + f" so \\boxed{{{other}}}"),
           ("answer_tag_in_result", "right", "<think>t</think><search>q</search> <result>Page: <answer>"
            f"\\boxed{{{other}}}</answer></result>" + _wrap(gold)),
           ("truncated", "none", f"<think>so it is \\boxed{{{gold}"), ("no_tags", "none", "I do not know.")]
    if "{" not in gold and "}" not in gold:
        out.append(("text_box", "right", _wrap(f"\\text{{{gold}}}")))
    if _plain(gold):
        out += [("upper", "right", _wrap(gold.upper())), ("article", "right", _wrap("the " + gold)),
                ("quotes", "right", _wrap(f'"{gold}"')), ("negated", "wrong", _wrap("not " + gold))]
        if len(gold.split()) > 1:
            out.append(("first_word", "wrong", _wrap(gold.split()[0])))
    if re.search(r"[\u4e00-\u9fff]", gold) and not re.search(r"\d", gold):
        out.append(("cjk_spaced", "right", _wrap(" ".join(gold.replace(" ", "")))))
    if other.strip().lower() != gold.strip().lower():
        out.append(("other_gold", "wrong", _wrap(other)))
    number = _integer(gold.replace(",", ""))
    if number is not None:
        out += [("sign_flipped", "wrong", _wrap(str(-number))), ("off_by_one", "wrong", _wrap(str(number + 1)))]
        if check != "qa":
            out += [("x_equals", "right", _wrap(f"x = {number}")), ("decimal_zero", "right", _wrap(f"{number}.0"))]
        if abs(number) >= 1000 and check != "qa":
            out.append(("thousands_commas", "right", _wrap(f"{number:,}")))
        if abs(number) >= 10:
            digits = str(abs(number))
            shifted = ("-" if number < 0 else "") + digits[:-1] + "." + digits[-1]
            out.append(("decimal_shifted", "wrong", _wrap(shifted)))
    elif re.fullmatch(r"-?\d+\.\d+", gold):
        out.append(("decimal_dropped", "wrong", _wrap(gold.replace(".", ""))))
    fraction = re.fullmatch(r"(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}", gold)
    if fraction and fraction.group(2) != fraction.group(3):
        out.append(("fraction_swapped", "wrong", _wrap(f"{fraction.group(1)}\\frac{{{fraction.group(3)}}}"
                                                           f"{{{fraction.group(2)}}}")))
    if len(gold) > 2 and gold[0] in "([" and gold[-1] in ")]" and "," in gold:
        out.append(("bracket_changed", "wrong", _wrap({"(": "[", "[": "("}[gold[0]] + gold[1:])))
    sign = re.search(r"(?<=\S)\s*([+-])\s*(?=\S)", gold)
    if sign and not fraction and number is None and check != "qa":  # in QA text a hyphen is a word's
        flipped = gold[:sign.start(1)] + {"+": "-", "-": "+"}[sign.group(1)] + gold[sign.end(1):]
        out.append(("sign_flipped", "wrong", _wrap(flipped)))
    return [v for v in out if v[1] != "wrong" or _loose(_boxed_text(v[2])) not in known]


def _loose(text: str) -> str:
    """Lower case, outer spaces and a trailing full stop or comma dropped (what makes an alias)."""
    return text.strip().lower().rstrip(".,;:").strip()


def _boxed_text(response: str) -> str:
    return response.rsplit("\\boxed{", 1)[-1].rsplit("} \\]", 1)[0]


def reward_variants(gold: str, other: str) -> list[tuple[str, str, str]]:
    """(variant, kind, response) of the deep-research reward for one gold."""
    search = "<search>q</search> <result>\nPage 1\n</result>"
    python = "<python>print(1)</python> <result>\n1\n</result>"
    body = "<think>plan</think>{calls}<think>done</think><answer>So \\boxed{{{answer}}}</answer>"
    out = [("both_tools", "right", body.format(calls=search + python, answer=gold)),
           ("search_only", "right", body.format(calls=search, answer=gold)),
           ("no_tools", "right", body.format(calls="", answer=gold)),
           ("no_think", "right", f"{search}<answer>\\boxed{{{gold}}}</answer>"),
           ("answer_tag_in_result", "right", body.format(
               calls="<search>q</search> <result>a page: <answer>x</answer></result>", answer=gold)),
           ("quoted_python_tag", "right", body.format(
               calls="<search>q</search> <result>a page: </python></result>", answer=gold)),
           ("spaced_box", "right", f"<think>t</think><answer>$\\boxed {gold}$ and \\boxed{{{gold}}}</answer>"),
           ("other_gold", "wrong", body.format(calls=search + python, answer=other)),
           ("unclosed_result", "none", f"<think>t</think><search>q</search> <result>page <answer>\\boxed{{{gold}}}"
            "</answer>"),
           ("no_box", "none", f"<think>t</think><answer>{gold}</answer>")]
    if "{" not in gold and "}" not in gold:
        out.append(("text_box", "right", body.format(calls="", answer=f"\\text{{{gold}}}")))
    if _plain(gold):
        out.append(("negated", "wrong", body.format(calls=search, answer="not " + gold)))
    return out


# ---------------------------------------------------------------------------------------------
# The authors' own functions, imported from a checkout (optional).

def _load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Authors:
    """Their extraction + ``Evaluator.evaluate_sample`` (no judge) and their ``compute_score``."""

    def __init__(self, root: Path):
        sys.path.insert(0, str(root / "evaluation"))
        from src import evaluator, utils  # their package: evaluation/src

        self.extract = utils.extract_answer
        # the output path only names files their run() would write; evaluate_sample writes nothing
        self.evaluators = {task: evaluator.Evaluator(task, output_path="unused.json") for task in ("math", "qa")}
        self.reward = _load_module("arpo_deep_research",
                                   root / "ARPO/verl_arpo_entropy/verl/utils/reward_score/deep_research.py")

    def eval_scores(self, response: str, gold: Any, task: str) -> dict[str, Any]:
        item = {"input": "", "answer": gold, "output": response, "prediction": self.extract(response)}
        with contextlib.redirect_stdout(io.StringIO()):
            metrics = asyncio.run(self.evaluators[task].evaluate_sample(item))
        return {"em": metrics["em"], "f1": metrics["f1"], "acc": metrics["acc"], "math": metrics["math_equal"]}

    def reward_score(self, response: str, gold: Any) -> float:
        with contextlib.redirect_stdout(io.StringIO()):
            return float(self.reward.compute_score("bench", response, gold)["score"])


# ---------------------------------------------------------------------------------------------

def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(float(a) - float(b)) < 1e-9
    return (a or "").strip() == (b or "").strip() if isinstance(a, (str, type(None))) else a == b


def eval_cases(questions: int, authors: Authors | None) -> list[dict[str, Any]]:
    from aepo_engine.evaluation.benchmarks import BENCHMARKS, load_eval_source
    from aepo_engine.evaluation.authors import authors_task
    from aepo_engine.evaluation.scoring import score_response

    cases = []
    for name in BENCHMARKS:
        try:
            eval_set = load_eval_source(name, SHARED / "eval", questions)
        except FileNotFoundError:
            continue  # math: not in the shared data
        golds = [e.ground_truth[-1] for e in eval_set.examples]
        for i, e in enumerate(eval_set.examples):
            variants = eval_variants(golds[i], golds[(i + 1) % len(golds)], e.ground_truth, eval_set.check)
            for variant, kind, response in variants:
                engine = score_response(response, e.ground_truth, eval_set.check)
                reference = score_response(response, e.ground_truth, eval_set.check, scoring="authors",
                                           gold=e.meta["gold"])
                case = {"set": name, "variant": variant, "kind": kind, "engine": engine, "reference": reference}
                if authors is not None:
                    case["authors"] = authors.eval_scores(response, e.meta["gold"], authors_task(eval_set.check))
                cases.append(case)
    return cases


def reward_cases(rows_per_set: int, authors: Authors | None) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    from aepo_engine.rewards import get_reward

    deep_research = get_reward("deep_research")
    cases = []
    for name in RL_SETS:
        table = pq.read_table(SHARED / "rl_datasets" / f"{name}.parquet", columns=["reward_model"])
        golds = [row["ground_truth"] for row in table.column("reward_model").to_pylist()[:rows_per_set]]
        for i, gold in enumerate(golds):
            for variant, kind, response in reward_variants(gold, golds[(i + 1) % len(golds)]):
                case = {"set": name, "variant": variant, "kind": kind,
                        "engine": deep_research(response, gold).score,
                        "reference": deep_research(response, gold, rules="authors").score}
                if authors is not None:
                    case["authors"] = authors.reward_score(response, gold)
                cases.append(case)
    return cases


def _eval_row(group: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"cases": len(group)}
    for metric in METRICS:
        row[f"agree_{metric}"] = sum(_same(c["engine"][metric], c["reference"][metric]) for c in group) / len(group)
    row["engine_correct"] = sum(bool(c["engine"]["correct"]) for c in group)
    row["reference_correct"] = sum(bool(c["reference"]["correct"]) for c in group)
    if "authors" in group[0]:
        for metric in ("em", "f1", "acc", "math"):
            row[f"authors_agree_{metric}"] = sum(_same(c["reference"][metric], c["authors"][metric])
                                                 for c in group) / len(group)
    return row


def _reward_row(group: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"cases": len(group),
                           "agree_score": sum(_same(c["engine"], c["reference"]) for c in group) / len(group),
                           "engine_positive": sum(c["engine"] > 0 for c in group),
                           "reference_positive": sum(c["reference"] > 0 for c in group)}
    if "authors" in group[0]:
        row["authors_agree_score"] = sum(_same(c["reference"], c["authors"]) for c in group) / len(group)
    return row


def summarize(cases: list[dict[str, Any]], by: Callable[[dict[str, Any]], tuple], row_of: Callable,
              bench: str) -> list[dict[str, Any]]:
    """One row per group of ``by`` and one "all" row, from the per-case scores."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for case in cases:
        groups[by(case)].append(case)
        groups[("all", case["kind"])].append(case)
    groups[("all", "all")] = cases
    return [{"bench": bench, "group": group[0], "kind": group[1], **row_of(members)}
            for group, members in sorted(groups.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=10, help="questions per eval set")
    parser.add_argument("--reward-rows", type=int, default=20, help="ground truths per RL parquet set")
    parser.add_argument("--authors-code", type=Path, default=None, help="a checkout of RUC-NLPIR/ARPO")
    parser.add_argument("--name", default="scoring_agreement", help="rows go to bench/results/<name>.jsonl")
    args = parser.parse_args()
    if not SHARED.is_dir():
        raise SystemExit(f"the shared data is not at {SHARED}")
    authors = Authors(args.authors_code) if args.authors_code else None
    evals, rewards = eval_cases(args.questions, authors), reward_cases(args.reward_rows, authors)
    info = {"questions_per_set": args.questions, "reward_rows_per_set": args.reward_rows,
            "authors_code": str(args.authors_code) if args.authors_code else None}
    rows = (summarize(evals, lambda c: (c["variant"], c["kind"]), _eval_row, "eval_by_variant")
            + summarize(evals, lambda c: (c["set"], c["kind"]), _eval_row, "eval_by_set")
            + summarize(rewards, lambda c: (c["variant"], c["kind"]), _reward_row, "reward_by_variant"))
    rows = [{**info, **row} for row in rows]
    print(f"wrote {write_rows(args.name, rows)}")
    shown = ["bench", "group", "kind", "cases", "agree_answer", "agree_em", "agree_f1", "agree_correct",
             "engine_correct", "reference_correct", "agree_score", "engine_positive", "reference_positive"]
    if authors is not None:
        shown += [f"authors_agree_{m}" for m in ("em", "f1", "acc", "math", "score")]
    print_table([r for r in rows if r["group"] == "all" or r["kind"] == "wrong"], shown)


if __name__ == "__main__":
    main()
