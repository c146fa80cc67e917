"""Eval data: every benchmark file of the paper's table (real files), parquet sets, bad rows, names."""
from __future__ import annotations

import json

import pytest

from aepo_engine.evaluation.benchmarks import (AUTHORS_SYSTEM_PROMPT, BENCHMARKS, eval_messages, load_eval_source,
                                               resolve_source)

# name -> (usable questions, answer check) in ../shared/data/arpo/eval
EXPECTED = {"gaia": (103, "qa"), "hle": (500, "mixed"), "webwalker": (200, "qa"), "xbench": (100, "qa"),
            "hotpotqa": (200, "qa"), "2wiki": (200, "qa"), "musique": (200, "qa"), "bamboogle": (125, "qa"),
            "simpleqa": (500, "qa"), "aime24": (30, "math"), "aime25": (30, "math"), "math500": (500, "math"),
            "gsm8k": (1319, "math")}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_benchmark_loads(shared_data, name):
    s = load_eval_source(name, shared_data / "eval")
    count, check = EXPECTED[name]
    assert (len(s.examples), s.check, s.skipped) == (count, check, [])
    assert [e.index for e in s.examples] == list(range(count))
    assert all(e.data_source == name and e.question.strip() and e.ground_truth for e in s.examples)


def test_formats_hand_checked(shared_data):
    root = shared_data / "eval"
    gaia = load_eval_source("gaia", root).examples[0]
    assert gaia.question.startswith("I\u2019m researching species") and gaia.ground_truth == ["34689"]
    assert gaia.meta["Level"] == 2 and gaia.meta["row"] == 1
    aime25 = load_eval_source("aime25", root).examples[0]  # the answer is the JSON int 70
    assert aime25.ground_truth == ["70"] and aime25.question.startswith("Find the sum of all integer bases")
    assert load_eval_source("gsm8k", root).examples[0].ground_truth == ["18"]  # "... #### 18"
    assert load_eval_source("2wiki", root).examples[0].ground_truth[:3] == ["the five boroughs", "City of New York",
                                                                           "New York"]
    hle = load_eval_source("hle", root).examples
    assert hle[0].ground_truth == ["D"] and hle[0].meta["answer_type"] == "multipleChoice"
    assert {e.meta["answer_type"] for e in hle} == {"multipleChoice", "exactMatch"}
    assert load_eval_source("webwalker", root).examples[1].ground_truth == ["肖亮"]
    assert load_eval_source("xbench", root).examples[0].ground_truth == ["161.27元"]
    assert len(load_eval_source("math500", root, max_examples=7).examples) == 7


def test_reference_parquet_sets_keep_their_prompt(shared_data):
    valid = load_eval_source(str(shared_data / "rl_datasets" / "valid.parquet"), shared_data / "eval")
    assert (valid.name, len(valid.examples), valid.check) == ("DR_grpo_mix", 180, "mixed")  # 100 math + 80 qa rows
    first = valid.examples[0]
    assert eval_messages(first, "none") == first.prompt_messages  # a row's own prompt wins
    # Question-only sets get the very system prompt the parquet rows carry (typo included).
    assert first.prompt_messages[0] == {"role": "system", "content": AUTHORS_SYSTEM_PROMPT}
    gaia = load_eval_source(str(shared_data / "rl_datasets" / "gaia_test.parquet"), "")
    assert (gaia.name, len(gaia.examples), gaia.check) == ("DR_gaia", 103, "qa")


def test_question_only_rows_get_the_configured_system_prompt(shared_data):
    e = load_eval_source("bamboogle", shared_data / "eval").examples[0]
    assert eval_messages(e, "authors") == [{"role": "system", "content": AUTHORS_SYSTEM_PROMPT},
                                             {"role": "user", "content": e.question}]
    assert eval_messages(e, "none") == [{"role": "user", "content": e.question}]
    assert eval_messages(e, "Be brief.")[0] == {"role": "system", "content": "Be brief."}


def test_bad_rows_are_reported_with_file_and_row_and_skipped(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [json.dumps({"question": "q1", "answer": ["a"]}), "{not json", json.dumps({"question": "q3"}),
            json.dumps({"question": "  ", "answer": "x"}), json.dumps({"question": "q5", "answer": 5})]
    path.write_text("\n".join(rows) + "\n")
    s = load_eval_source(str(path), tmp_path)
    assert [e.question for e in s.examples] == ["q1", "q5"] and s.examples[1].ground_truth == ["5"]
    assert [(b.source, b.row) for b in s.skipped] == [(str(path), 2), (str(path), 3), (str(path), 4)]
    assert "unparseable JSON" in s.skipped[0].reason and "no ground truth" in s.skipped[1].reason
    assert s.skipped[2].reason == "empty question"


def test_hle_image_rows_are_skipped_with_a_count(tmp_path):
    (tmp_path / "hle").mkdir()
    rows = [{"question": f"q{i}", "answer": "A", "answer_type": "multipleChoice", "has_image": i % 2 == 1}
            for i in range(5)]
    (tmp_path / "hle" / "top.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = load_eval_source("hle", tmp_path)
    assert [e.question for e in s.examples] == ["q0", "q2", "q4"]
    assert [b.row for b in s.skipped] == [2, 4] and all("has_image" in b.reason for b in s.skipped)


def test_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark or missing file 'gaiaa'.*gaia, hle, webwalker"):
        resolve_source("gaiaa", tmp_path)
    with pytest.raises(FileNotFoundError, match="benchmark 'aime24'.*data_root"):
        resolve_source("AIME24", tmp_path)  # known name (any case), but no file under this root
    with pytest.raises(FileNotFoundError, match="eval.data_root is not set; pass --data-root DIR"):
        resolve_source("gaia", "")  # the default: no data root outside the repository is assumed
    assert set(BENCHMARKS) == set(EXPECTED) | {"math"}  # MATH: the paper's 14th set, not in the shared data


def test_math_is_named_and_read_in_the_reference_format(tmp_path, shared_data):
    with pytest.raises(FileNotFoundError, match="ARPO eval data has no MATH set.*math/test.jsonl"):
        resolve_source("math", shared_data / "eval")
    # the reference's evaluation/data/math/test.jsonl rows: problem, solution, answer, ...
    rows = [{"problem": "What is $1+1$?", "solution": "So $\\boxed{2}$.", "answer": "2", "level": "Level 1",
             "type": "Prealgebra", "unique_id": "test/prealgebra/1.json"},
            {"problem": "Simplify $\\frac{2}{4}$.", "solution": "...", "answer": "\\frac{1}{2}", "level": "Level 2"}]
    (tmp_path / "math").mkdir()
    path = tmp_path / "math" / "test.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for spec, root in (("math", tmp_path), (str(path), "")):  # by name under a data root, or the file itself
        s = load_eval_source(spec, root)
        assert (s.name, s.check, len(s.examples)) == ("math", "math", 2)
        assert s.examples[0].question == "What is $1+1$?" and s.examples[1].ground_truth == ["\\frac{1}{2}"]
        assert [e.meta["gold"] for e in s.examples] == ["2", "\\frac{1}{2}"]


def test_golds_as_the_reference_loader_reads_them(shared_data):
    root = shared_data / "eval"
    assert load_eval_source("hotpotqa", root).examples[0].meta["gold"] == ["Frank Lowy"]  # a list stays a list
    assert load_eval_source("aime25", root).examples[0].meta["gold"] == 70  # an int stays an int
    assert load_eval_source("aime24", root).examples[7].meta["gold"] == "025"
    gsm8k = load_eval_source("gsm8k", root).examples
    with_commas = [e for e in gsm8k if "," in e.ground_truth[0]]
    assert len(with_commas) == 14 and all(e.meta["gold"] == e.ground_truth[0].replace(",", "") for e in with_commas)
    assert "gold" not in load_eval_source(str(shared_data / "rl_datasets" / "valid.parquet"), root).examples[0].meta


def test_engine_jsonl_with_golden_answers_and_chat_prompts(tmp_path):
    rows = [{"question": "Who wrote Hamlet?", "golden_answers": ["Shakespeare", "William Shakespeare"],
             "data_source": "mine"},
            {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "2+2?"}], "answer": 4,
             "ability": "math"}]
    path = tmp_path / "engine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = load_eval_source(str(path), tmp_path)
    assert s.name == "mine" and [e.ground_truth for e in s.examples] == [["Shakespeare", "William Shakespeare"], ["4"]]
    assert s.examples[1].question == "2+2?" and eval_messages(s.examples[1], "authors")[0]["content"] == "S"
    assert s.check == "mixed"  # one maths row among QA rows: either check counts
