"""pass@k (hand-worked and brute force), per-sample scores (CJK F1, maths, multiple choice, tool
results), and the per-dataset report."""
from __future__ import annotations

import csv
import itertools
import json
import random

import pytest

from aepo_engine.eval.report import format_table, summarize, write_reports
from aepo_engine.eval.scoring import final_answer, pass_at_k, score_response


def test_pass_at_k_hand_worked():
    # n=5 samples, c=2 correct: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10;
    # pass@3 = 1 - C(3,3)/C(5,3) = 1 - 1/10; pass@4: only 3 wrong samples, so any 4 hold a correct one.
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    assert pass_at_k(5, 2, 4) == 1.0 and pass_at_k(5, 0, 5) == 0.0 and pass_at_k(1, 1, 1) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_pass_at_k_equals_the_share_of_k_subsets_with_a_correct_sample():
    rng = random.Random(0)
    for _ in range(30):
        n = rng.randint(1, 9)
        c, k = rng.randint(0, n), rng.randint(1, n)
        outcomes = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(outcomes, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_cjk_f1_is_per_character():
    # "肖亮" vs "肖亮老师": 2 common characters, precision 1, recall 1/2 -> F1 = 2/3.
    s = score_response("<answer>\\boxed{肖亮}</answer>", ["肖亮老师"], "qa")
    assert s["f1"] == pytest.approx(2 / 3) and s["em"] == 0.0 and not s["correct"]
    assert score_response("<answer>\\boxed{肖亮。}</answer>", ["肖亮"], "qa")["correct"]  # full stop is punctuation


def test_answer_extraction_ignores_tool_results():
    response = ("<search>q</search> <result>\nPage 1: the value is \\boxed{99}\n</result>"
                "<answer>The final answer is \\[ \\boxed{42} \\]</answer>")
    assert final_answer(response) == "42"
    assert final_answer("<search>q</search> <result>\n\\boxed{99}") is None  # an unclosed result is not the model's
    assert final_answer("<answer>Paris</answer>") == "Paris"


def test_scores_by_check():
    half = "<answer>\\boxed{\\frac{1}{2}}</answer>"
    assert score_response(half, ["0.5"], "math")["correct"]
    assert not score_response(half, ["0.5"], "qa")["correct"]  # qa sets use exact match only
    assert score_response(half, ["0.5"], "mixed")["correct"]
    choice = score_response("<answer>\\boxed{D. Weak Non-Sadism}</answer>", ["D"], "mixed")
    assert choice["correct"] and choice["format_ok"]
    assert not score_response("<answer>\\boxed{Dog}</answer>", ["D"], "mixed")["correct"]
    aliases = score_response("<think>x</think><answer>\\boxed{NYC}</answer>", ["New York City", "NYC"], "qa")
    assert aliases["em"] == 1.0 and aliases["f1"] == 1.0
    empty = score_response("I do not know", ["x"], "qa")
    assert empty["answer"] is None and not empty["format_ok"] and empty["f1"] == 0.0
    with pytest.raises(ValueError, match="unknown answer check"):
        score_response("x", ["x"], "exact")


def _record(dataset, q, sample, correct, tools=(), answer="a", fmt=True, tokens=10, judge=None):
    calls = [{"tool": t, "payload": "p", "result": "r", "ok": True, "latency_s": lat} for t, lat in tools]
    return {"dataset": dataset, "question_index": q, "sample": sample, "correct": correct, "em": float(correct),
            "f1": 1.0 if correct else 0.5, "math": 0.0, "format_ok": fmt, "answer": answer, "tool_calls": calls,
            "response_tokens": tokens, **({"judge": judge} if judge is not None else {})}


def test_summary_hand_worked(tmp_path):
    # question 0: 2 of 3 samples correct; question 1: none. pass@1 = (2/3 + 0) / 2 = 1/3;
    # pass@2 = (1 - C(1,2)/C(3,2) + 1 - C(3,2)/C(3,2)) / 2 = (1 + 0) / 2; pass@3 = 1/2.
    records = [_record("a", 0, 0, True, [("search", 0.2), ("python", 1.0)], judge={"correct": True}),
               _record("a", 0, 1, True, [("search", 0.4)], judge={"correct": None}),
               _record("a", 0, 2, False, answer=None, fmt=False, judge={"correct": False}),
               _record("a", 1, 0, False, tokens=40, judge={"correct": False}),
               _record("a", 1, 1, False, judge={"correct": True}),
               _record("a", 1, 2, False, answer="", judge={"correct": False}),
               _record("b", 0, 0, True)]
    summary = summarize(records, [1, 2, 3])
    a = summary["a"]
    assert (a["questions"], a["samples"]) == (2, 3)
    assert a["pass@1"] == pytest.approx(1 / 3) and a["pass@2"] == pytest.approx(0.5) and a["pass@3"] == 0.5
    assert a["em"] == pytest.approx(2 / 6) and a["f1"] == pytest.approx((1 + 1 + 0.5 * 4) / 6)
    assert a["judge"] == pytest.approx(2 / 5) and a["judge_errors"] == 1  # one sample without a verdict
    assert a["calls/search"] == pytest.approx(2 / 6) and a["latency_s/search"] == pytest.approx(0.3)
    assert a["calls/python"] == pytest.approx(1 / 6) and a["latency_s/python"] == pytest.approx(1.0)
    assert a["response_tokens"] == pytest.approx(90 / 6)
    assert a["format_errors"] == pytest.approx(1 / 6) and a["no_answer"] == pytest.approx(2 / 6)
    assert summary["b"]["pass@1"] == 1.0 and "pass@2" not in summary["b"] and "judge" not in summary["b"]
    table = format_table(summary)
    assert table.splitlines()[0].split()[:4] == ["dataset", "questions", "samples", "pass@1"]
    md, csv_path, js = write_reports(summary, tmp_path, {"model": "m"})
    assert md.read_text().startswith("| dataset | questions |")
    rows = list(csv.DictReader(csv_path.open()))
    assert rows[0]["dataset"] == "a" and float(rows[0]["pass@2"]) == 0.5 and rows[1]["pass@2"] == ""
    assert json.loads(js.read_text())["datasets"]["a"]["pass@3"] == 0.5
    with pytest.raises(ValueError, match="different sample counts"):
        summarize(records[:-2], [1])
