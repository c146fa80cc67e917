"""data: reference parquet / JSONL / JSON / HF sources, bad rows, long-prompt filter, resumable sampler."""
from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aepo_engine.data import (
    BadRowError,
    Example,
    PromptSampler,
    detect_format,
    drop_long_prompts,
    load_examples,
)
from aepo_engine.data import DataConfig

ARPO = Path(__file__).resolve().parents[2] / "shared" / "data" / "arpo"
needs_arpo = pytest.mark.skipif(not (ARPO / "rl_datasets").is_dir(),
                                reason=f"reference data not found at {ARPO} (not shipped with the repo)")

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def chat(question: str) -> list[dict[str, str]]:
    return [SYSTEM, {"role": "user", "content": f"Question: {question}"}]


def reference_row(i: int, question: str, ground_truth: str) -> dict:
    return {"data_source": "toy", "prompt": chat(question), "ability": "qa",
            "reward_model": {"ground_truth": ground_truth, "style": "rule"},
            "extra_info": {"index": i, "question": question, "split": "train"}, "metadata": None}


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


# --- reference parquet ----------------------------------------------------------------------------

def test_reference_parquet_schema_and_ground_truth_forms(tmp_path):
    rows = [reference_row(0, "Who wrote Hamlet?", "Shakespeare"),
            reference_row(1, "Two answers?", json.dumps(["yes", "Yes indeed"])),
            reference_row(2, "An interval?", "[0, 1)")]  # starts with "[" but is not JSON
    path = tmp_path / "toy.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    examples = load_examples([str(path)], DataConfig())
    assert [e.ground_truth for e in examples] == [["Shakespeare"], ["yes", "Yes indeed"], ["[0, 1)"]]
    first = examples[0]
    assert first.question == "Who wrote Hamlet?" and first.prompt_messages == chat("Who wrote Hamlet?")
    assert first.data_source == "toy" and first.index == 0
    assert first.meta["row"] == 0 and first.meta["extra_info"]["split"] == "train"
    assert first.meta["ability"] == "qa" and "metadata" not in first.meta  # None columns dropped
    assert first.meta["reward_model"]["style"] == "rule" and "prompt" not in first.meta


def test_parquet_list_ground_truth_column(tmp_path):
    table = pa.table({"prompt": [chat("q1")], "reward_model": [{"ground_truth": ["a", "b"]}]})
    pq.write_table(table, tmp_path / "lists.parquet")
    (example,) = load_examples([str(tmp_path / "lists.parquet")], DataConfig())
    assert example.ground_truth == ["a", "b"] and example.question == "Question: q1"  # from the user turn
    assert example.data_source == "lists"


@needs_arpo
@pytest.mark.parametrize("name, rows", [("hard_search_1k", 1071), ("valid", 180), ("gaia_test", 103),
                                        ("hle_test", 100)])
def test_real_reference_parquet(name, rows):
    examples = load_examples([str(ARPO / "rl_datasets" / f"{name}.parquet")], DataConfig())
    assert len(examples) == rows
    for example in examples:
        assert example.question.strip() and example.ground_truth and all(g.strip() for g in example.ground_truth)
        assert [m["role"] for m in example.prompt_messages] == ["system", "user"]
        assert example.meta["extra_info"]["question"] == example.question


@needs_arpo
def test_real_train_10k_skips_its_blank_ground_truth(caplog):
    with caplog.at_level(logging.WARNING, logger="aepo_engine.data"):
        examples = load_examples([str(ARPO / "rl_datasets" / "train_10k.parquet")], DataConfig())
    assert len(examples) == 9999  # row 5274 has ground_truth " "
    assert "skipped 1 of 10000 rows" in caplog.text and "rows 5274" in caplog.text
    with pytest.raises(BadRowError, match="row 5274: ground truth is empty"):
        load_examples([str(ARPO / "rl_datasets" / "train_10k.parquet")], DataConfig(bad_rows="error"))


@needs_arpo
@pytest.mark.parametrize("name", ["hotpotqa", "2wiki", "gaia", "aime25", "math500", "xbench"])
def test_real_eval_jsonl(name):
    examples = load_examples([str(ARPO / "eval" / name / "test.jsonl")], DataConfig())
    assert examples and all(e.question.strip() and e.ground_truth for e in examples)
    assert examples[0].prompt_messages is None and examples[0].data_source == name


# --- JSONL / JSON ---------------------------------------------------------------------------------

def test_jsonl_keys_golden_answers_numbers(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [
        {"question": "q0", "golden_answers": ["a", "b"]},
        {"question": "q1", "answer": 70},
        "",  # blank lines are not rows
        {"Question": "q2", "answer": "x", "Level": 2},
    ])
    examples = load_examples([str(path)], DataConfig())
    assert [e.ground_truth for e in examples] == [["a", "b"], ["70"], ["x"]]
    assert [e.meta["row"] for e in examples] == [1, 2, 4]  # JSONL rows are line numbers
    assert examples[2].meta["Level"] == 2 and "Question" not in examples[2].meta


def test_configurable_keys_and_dotted_paths(tmp_path):
    path = write_jsonl(tmp_path / "custom.jsonl", [{"q": {"text": "hi"}, "refs": ["r"]}])
    cfg = DataConfig(question_keys=["q.text"], answer_keys=["refs"])
    (example,) = load_examples([str(path)], cfg)
    assert example.question == "hi" and example.ground_truth == ["r"]


def test_json_array_and_json_lines_in_dot_json(tmp_path):
    (tmp_path / "arr.json").write_text(json.dumps([{"question": "a", "answer": "1"}]))
    (tmp_path / "lines.json").write_text('{"question": "b", "answer": "2"}\n{"question": "c", "answer": "3"}\n')
    examples = load_examples([str(tmp_path / "arr.json"), str(tmp_path / "lines.json")], DataConfig())
    assert [e.question for e in examples] == ["a", "b", "c"]
    assert [e.index for e in examples] == [0, 1, 2]


def test_max_examples_per_source(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": f"q{i}", "answer": "a"} for i in range(10)])
    assert len(load_examples([str(path)], DataConfig(max_examples=4))) == 4


# --- bad rows -------------------------------------------------------------------------------------

BROKEN = [
    {"question": "fine", "answer": "ok"},               # line 1
    "{not json",                                        # line 2: unparseable
    {"answer": "no question"},                          # line 3: missing question
    {"question": "   ", "answer": "x"},                 # line 4: empty question
    {"question": 5, "answer": "x"},                     # line 5: wrong type
    {"question": "no answer"},                          # line 6: missing answer
    {"question": "bad answer", "answer": {"a": 1}},     # line 7: wrong answer type
    {"question": "empty list", "answer": []},           # line 8: empty ground truth
    ["not", "an", "object"],                            # line 9
    {"question": "bad prompt", "answer": "x", "prompt": [{"role": "user"}]},  # line 10
    {"question": "fine too", "answer": ["y"]},          # line 11
]


def test_bad_rows_skipped_with_counted_warning(tmp_path, caplog):
    path = write_jsonl(tmp_path / "broken.jsonl", BROKEN)
    with caplog.at_level(logging.WARNING, logger="aepo_engine.data"):
        examples = load_examples([str(path)], DataConfig(bad_rows="skip"))
    assert [e.question for e in examples] == ["fine", "fine too"] and [e.index for e in examples] == [0, 1]
    text = caplog.text
    assert f"skipped 9 of 11 rows in {path}" in text
    for reason in ("unparseable JSON line", "no question", "empty question", "question must be a string",
                   "no ground truth", "ground truth items must be strings", "ground truth is empty",
                   "expected a JSON object", "prompt message 0 must be"):
        assert reason in text, reason


@pytest.mark.parametrize("line, message", [
    ("{not json", "broken.jsonl row 1: unparseable JSON line"),
    ({"question": "", "answer": "a"}, "broken.jsonl row 1: empty question"),
    ({"question": "q", "answer": None}, "broken.jsonl row 1: no ground truth"),
])
def test_bad_rows_error_names_file_and_row(tmp_path, line, message):
    path = write_jsonl(tmp_path / "broken.jsonl", [line])
    with pytest.raises(BadRowError, match=message) as err:
        load_examples([str(path)], DataConfig(bad_rows="error"))
    assert err.value.bad.row == 1 and err.value.bad.source == str(path)


def test_parquet_bad_rows_use_row_index(tmp_path):
    rows = [reference_row(0, "good", "a"), reference_row(1, "", "a"), reference_row(2, "good2", "")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "b.parquet")
    with pytest.raises(BadRowError, match="b.parquet row 1: empty question"):
        load_examples([str(tmp_path / "b.parquet")], DataConfig(bad_rows="error"))
    assert len(load_examples([str(tmp_path / "b.parquet")], DataConfig())) == 1


def test_source_with_no_usable_rows_or_missing_file(tmp_path):
    path = write_jsonl(tmp_path / "all_bad.jsonl", ["{", "{"])
    with pytest.raises(ValueError, match="no usable rows"):
        load_examples([str(path)], DataConfig())
    with pytest.raises(FileNotFoundError):
        load_examples([str(tmp_path / "missing.jsonl")], DataConfig())


def test_detect_format():
    assert detect_format("a/b.parquet") == "parquet" and detect_format("x.JSONL") == "jsonl"
    assert detect_format("hf:org/name:train") == "hf" and detect_format("x.txt", "jsonl") == "jsonl"
    with pytest.raises(ValueError, match="suffix"):
        detect_format("x.txt")


def test_hf_datasets_source_real(tmp_path):
    if importlib.util.find_spec("datasets") is None:
        pytest.skip("the `datasets` package is not installed (optional, not a dependency)")
    folder = tmp_path / "local_dataset"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"question": "q", "golden_answers": ["a", "b"]}])
    (example,) = load_examples([f"hf:{folder}:train"], DataConfig())  # a local folder: no download
    assert example.question == "q" and example.ground_truth == ["a", "b"] and example.data_source == str(folder)


def test_hf_source_path_with_a_stand_in_module(monkeypatch):
    import sys
    import types

    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        return [{"question": "q", "answer": "a"}, {"question": ""}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    (example,) = load_examples(["hf:org/set:main:test"], DataConfig())
    assert calls == [("org/set", "main", "test")]
    assert example.data_source == "org/set" and example.meta == {"source": "hf:org/set:main:test", "row": 0}


def test_hf_source_without_datasets_says_how_to_fix(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("no datasets")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(ImportError, match="pip install datasets"):
        load_examples(["hf:some/name:train"], DataConfig())


# --- long prompts ---------------------------------------------------------------------------------

def test_drop_long_prompts_reindexes(caplog):
    examples = [Example(index=i, question="w " * n, prompt_messages=None, ground_truth=["a"], data_source="t")
                for i, n in enumerate([3, 50, 4, 60])]
    with caplog.at_level(logging.WARNING, logger="aepo_engine.data"):
        kept = drop_long_prompts(examples, lambda e: len(e.question.split()), max_tokens=10)
    assert [len(e.question.split()) for e in kept] == [3, 4] and [e.index for e in kept] == [0, 1]
    assert "dropped 2 of 4 prompts longer than 10 tokens" in caplog.text


# --- sampler --------------------------------------------------------------------------------------

def toy_examples(n: int) -> list[Example]:
    return [Example(index=i, question=f"q{i}", prompt_messages=None, ground_truth=["a"], data_source="t")
            for i in range(n)]


def ids(batch) -> list[int]:
    return [e.index for e in batch]


def test_sampler_epochs_are_permutations_and_deterministic():
    sampler = PromptSampler(toy_examples(10), batch_size=3, seed=1)
    batches = [ids(sampler.next_batch()) for _ in range(6)]
    assert all(len(b) == 3 for b in batches)  # drop_last: the 10th example waits for the next epoch
    epoch0 = sum(batches[:3], [])
    assert len(set(epoch0)) == 9 and sampler.epoch == 1
    assert sum(batches[3:], []) != epoch0  # a fresh permutation per epoch
    again = PromptSampler(toy_examples(10), batch_size=3, seed=1)
    assert [ids(again.next_batch()) for _ in range(6)] == batches
    other = PromptSampler(toy_examples(10), batch_size=3, seed=2)
    assert [ids(other.next_batch()) for _ in range(6)] != batches


def test_sampler_without_shuffle_or_drop_last():
    sampler = PromptSampler(toy_examples(5), batch_size=2, shuffle=False, drop_last=False)
    assert [ids(sampler.next_batch()) for _ in range(4)] == [[0, 1], [2, 3], [4], [0, 1]]
    assert sampler.batches_per_epoch == 3


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4, 7])
def test_sampler_resume_continues_exactly(stop_after):
    reference = PromptSampler(toy_examples(11), batch_size=4, seed=7)
    expected = [ids(reference.next_batch()) for _ in range(10)]
    first = PromptSampler(toy_examples(11), batch_size=4, seed=7)
    seen = [ids(first.next_batch()) for _ in range(stop_after)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a plain-JSON trip
    resumed = PromptSampler(toy_examples(11), batch_size=4, seed=999)  # saved seed wins
    resumed.load_state_dict(state)
    seen += [ids(resumed.next_batch()) for _ in range(10 - stop_after)]
    assert seen == expected


def test_sampler_rejects_changed_data_and_bad_sizes():
    state = PromptSampler(toy_examples(8), batch_size=2).state_dict()
    with pytest.raises(ValueError, match="data or its filters changed"):
        PromptSampler(toy_examples(9), batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="no full batch"):
        PromptSampler(toy_examples(3), batch_size=4)
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(toy_examples(3), batch_size=0)


def test_json_list_ground_truth_of_numbers_stays_one_answer():
    """'[1, 2]' is a maths interval, not two references (scoring would accept '1' alone)."""
    from aepo_engine.data.rows import _parse_ground_truth

    assert _parse_ground_truth("[1, 2]") == ["[1, 2]"]
    assert _parse_ground_truth('["New York", "NYC"]') == ["New York", "NYC"]
    assert _parse_ground_truth(["a", 3]) == ["a", "3"]


def test_fit_prompts_drops_or_refuses_overlong_prompts():
    from aepo_engine.data import Example, fit_prompts

    examples = [Example(index=i, question="q" * n, prompt_messages=None, ground_truth=["a"], data_source="t")
                for i, n in enumerate((3, 9, 5, 12))]
    kept = fit_prompts(examples, lambda e: len(e.question), DataConfig(max_prompt_tokens=5))
    assert [len(e.question) for e in kept] == [3, 5] and [e.index for e in kept] == [0, 1]
    with pytest.raises(ValueError, match="2 of 4 eval prompts are longer than data.max_prompt_tokens=5"):
        fit_prompts(examples, lambda e: len(e.question), DataConfig(max_prompt_tokens=5, overlong_prompts="error"),
                    "eval")
    with pytest.raises(ValueError, match="no train prompt fits"):
        fit_prompts(examples, lambda e: len(e.question), DataConfig(max_prompt_tokens=2))
    assert fit_prompts([], len, DataConfig()) == []
