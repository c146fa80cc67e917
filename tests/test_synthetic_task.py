"""The generated tool-use task: determinism, split, answerability, demonstration format."""
import re

import pytest

from aepo_engine.tasks.synthetic import (Question, SyntheticTaskConfig, ToolCall, answer_type, boxed_answer,
                                         exact_search, is_correct, is_guess,
                                         make_demonstrations, make_task, reference_tool_fn,
                                         safe_print_eval)

CONFIG = SyntheticTaskConfig(seed=3, num_people=60, num_cities=5, num_train=300, num_heldout=60)


@pytest.fixture(scope="module")
def task():
    return make_task(CONFIG)


def test_same_seed_same_task_other_seed_other_task(task):
    again = make_task(CONFIG)
    assert again == task and again.corpus == task.corpus
    other = make_task(SyntheticTaskConfig(**{**_fields(CONFIG), "seed": 4}))
    assert other.corpus != task.corpus
    assert [q.text for q in other.train] != [q.text for q in task.train]


def _fields(config):
    return {f: getattr(config, f) for f in config.__struct_fields__}


def test_split_is_disjoint_and_follows_the_kind_weights(task):
    train, heldout = {q.text for q in task.train}, {q.text for q in task.heldout}
    assert len(train) == len(task.train) == 300 and len(heldout) == len(task.heldout) == 60
    assert not train & heldout
    assert len({q.qid for q in task.train + task.heldout}) == 360
    kinds = [q.kind for q in task.heldout]
    assert (kinds.count("lookup"), kinds.count("two_hop"), kinds.count("arithmetic")) == (24, 18, 18)


def test_corpus_rows_are_unique_short_facts(task):
    ids = [row["id"] for row in task.corpus]
    assert len(ids) == len(set(ids)) == 60 * 4 + 5 * 2
    assert all(len(row["contents"].split()) == 3 for row in task.corpus)


def _resolve(task, text):
    """An independent solver: parse the question, answer from the entities' attributes."""
    facts = {e.name: e.attributes for e in task.entities}
    if match := re.fullmatch(r"What is the (\w+) of the city of (\w+)\?", text):
        return facts[facts[match[2]]["city"]][match[1]]
    if match := re.fullmatch(r"What is the (\w+) of (\w+) (plus|minus) the (\w+) of (\w+)\?", text):
        first, second = int(facts[match[2]][match[1]]), int(facts[match[5]][match[4]])
        return str(first + second if match[3] == "plus" else first - second)
    match = re.fullmatch(r"What is the (\w+) of (\w+)\?", text)
    return facts[match[2]][match[1]]


def test_every_question_is_answerable_from_the_corpus_by_its_plan(task):
    tool_fn = reference_tool_fn(task)
    for question in task.train + task.heldout:
        assert _resolve(task, question.text) == question.answer, question
        outputs = [tool_fn(call.tool, call.payload) for call in question.plan]
        assert all(out and not out.startswith("Error") for out in outputs), (question, outputs)
        if question.kind == "arithmetic":
            assert outputs[-1] == question.answer and int(question.answer) >= 0
        else:
            assert outputs[-1] == f"Page 1: {question.plan[-1].payload} {question.answer}."


def test_search_is_exact_and_case_insensitive(task):
    person = task.entities[0]
    assert exact_search(task, f"  {person.name.lower()}   age ") == f"{person.name} age {person.attributes['age']}."
    assert exact_search(task, person.name) == "" and exact_search(task, "Nobody age") == ""


def _parse(response):
    """(tool, payload, result) triples and the rest, failing on any order violation."""
    calls = re.findall(r"<(search|python)>(.*?)</\1> <result>\n(.*?)\n</result>", response, flags=re.DOTALL)
    for tag in ("think", "search", "python", "result", "answer"):
        assert response.count(f"<{tag}>") == response.count(f"</{tag}>"), tag
    assert response.count("<result>") == len(calls)
    assert response.startswith("<think></think>\n") and response.endswith(" </answer>")
    assert response.count("<answer>") == 1 and response.index("<answer>") > response.rindex("</result>")
    return calls


def test_demonstrations_follow_the_format_with_results_in_order(task):
    questions = task.train[:50]
    tool_fn = reference_tool_fn(task)
    for question, response in zip(questions, make_demonstrations(questions, tool_fn)):
        calls = _parse(response)
        assert [(tool, payload.strip()) for tool, payload, _ in calls] == \
            [(c.tool, c.payload) for c in question.plan]
        assert [result for *_, result in calls] == [tool_fn(c.tool, c.payload) for c in question.plan]
        assert boxed_answer(response) == question.answer and is_correct(response, question)


def test_demonstration_spacing_keeps_copied_words_identical():
    question = Question("q", "arithmetic", "What is the age of Bo plus the score of Ka?", "30",
                        (ToolCall("search", "Bo age"), ToolCall("search", "Ka score"),
                         ToolCall("python", "print( 20 + 10)")))
    # Tool text goes in unchanged (a python tool's trailing newline included), as the rollout does.
    results = {"Bo age": "Page 1: Bo age 20.", "Ka score": "Page 1: Ka score 10.", "print( 20 + 10)": "30\n"}
    (response,) = make_demonstrations([question], lambda tool, payload: results[payload])
    assert response == ("<think></think>\n<search> Bo age</search> <result>\nPage 1: Bo age 20.\n</result>\n"
                        "<search> Ka score</search> <result>\nPage 1: Ka score 10.\n</result>\n"
                        "<python>print( 20 + 10)</python> <result>\n30\n\n</result>\n"
                        "<answer> \\boxed{30} </answer>")


def test_guessing_teacher_skips_tools_on_its_share_with_a_same_type_answer(task):
    questions = task.train[:200]
    tool_fn = reference_tool_fn(task)
    demos = make_demonstrations(questions, tool_fn, guess_rate=0.3, seed=7)
    guesses = [(q, d) for q, d in zip(questions, demos) if is_guess(d)]
    assert len(guesses) == 60  # round(0.3 * 200), exactly
    answers_by_type = {}
    for q in questions:
        answers_by_type.setdefault(answer_type(q), set()).add(q.answer)
    for question, demo in guesses:
        assert demo.startswith("<think></think>\n<answer> \\boxed{") and demo.endswith("} </answer>")
        assert boxed_answer(demo) in answers_by_type[answer_type(question)]
    # most guesses are wrong (a guess is right only when two answers coincide, e.g. a colour)
    assert sum(is_correct(d, q) for q, d in guesses) < len(guesses) / 2
    # the other demonstrations are the gold tool-using ones, unchanged
    gold = make_demonstrations(questions, tool_fn)
    assert all(d == g for d, g in zip(demos, gold) if not is_guess(d))
    assert make_demonstrations(questions, tool_fn, guess_rate=0.3, seed=7) == demos
    assert make_demonstrations(questions, tool_fn, guess_rate=0.3, seed=8) != demos
    assert answer_type(next(q for q in questions if q.kind == "arithmetic")) == "number"
    with pytest.raises(ValueError, match="guess_rate"):
        make_demonstrations(questions, tool_fn, guess_rate=1.5)
    with pytest.raises(ValueError, match="demo_guess_rate"):
        SyntheticTaskConfig(demo_guess_rate=-0.1)


def test_demonstrations_refuse_results_that_do_not_hold_the_copied_value(task):
    question = next(q for q in task.train if q.kind == "lookup")
    with pytest.raises(ValueError, match="neither the question nor"):
        make_demonstrations([question], lambda tool, payload: "Page 1: something else.")


def test_safe_print_eval_runs_arithmetic_only():
    assert safe_print_eval("print( 20 + 10)") == "30"
    assert safe_print_eval("print(7 * 6)\nprint(1 - 2)") == "42\n-1"
    for code in ("import os", "print(open('x'))", "print(2 ** 99999)", "x = 1", "print(1/0)", "print("):
        assert safe_print_eval(code).startswith("Error")


def test_boxed_answer_takes_the_last_boxed_inside_answer():
    assert boxed_answer("<answer> \\boxed{ 1} \\boxed{ 2 } </answer>") == "2"
    assert boxed_answer("\\boxed{3}") is None and boxed_answer("<answer>3</answer>") is None


def test_split_sizes_are_exact_despite_rounding():
    task = make_task(SyntheticTaskConfig(num_people=24, num_cities=4, num_train=32, num_heldout=5))
    assert (len(task.train), len(task.heldout)) == (32, 5)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError):
        SyntheticTaskConfig(lookup_weight=-1)
    with pytest.raises(ValueError, match="distinct"):
        make_task(SyntheticTaskConfig(num_people=5, num_cities=2, num_train=200, num_heldout=10))


def test_bm25_search_tool_finds_the_planned_document(task, tmp_path):
    search = pytest.importorskip("aepo_engine.tools.search")
    backend = search.CorpusBackend.from_jsonl(task.write_corpus(tmp_path / "kb.jsonl"), topk=1)
    tool_fn = reference_tool_fn(task)
    for question in task.train + task.heldout:
        for call in question.plan:
            if call.tool == "search":
                assert backend.search(f" {call.payload}") == tool_fn("search", call.payload)
