"""The namesake family of the generated task (``--preset namesakes``): the embedded default is
unchanged, the world and questions are deterministic, every answer is reachable by copying from
the real search results, the distractors are really listed, and the teacher errs exactly where
it is told to (after the first tool result)."""
import hashlib
import json
import re
from collections import Counter

import pytest

from aepo_engine.tasks.synthetic import (PERSON_ATTRIBUTES, SyntheticTaskConfig, boxed_answer, is_correct,
                                         is_guess, make_demonstrations, make_task, namesake_candidates,
                                         reference_tool_fn)

FAMILY = SyntheticTaskConfig(seed=11, num_people=30, num_cities=5, num_train=240, num_heldout=60,
                             lookup_weight=0.0, two_hop_weight=0.0, arithmetic_weight=0.0,
                             namesake_weight=1.0, namesake_groups=30, namesakes_per_group=3)


@pytest.fixture(scope="module")
def task():
    return make_task(FAMILY)


def _bm25_tool_fn(task, folder):
    """The engine's real BM25 search over the task's corpus, one page per namesake (as the preset
    sets; EASY has FAMILY's group size)."""
    search = pytest.importorskip("aepo_engine.tools.search")
    path = task.write_corpus(folder / "kb.jsonl")
    backend = search.CorpusBackend.from_jsonl(path, topk=FAMILY.namesakes_per_group)
    return lambda tool, payload: backend.search(f" {payload}")


@pytest.fixture(scope="module")
def bm25_tool_fn(task, tmp_path_factory):
    return _bm25_tool_fn(task, tmp_path_factory.mktemp("kb"))


def _digest(config):
    task = make_task(config)
    demos = make_demonstrations(task.train, reference_tool_fn(task), guess_rate=config.demo_guess_rate,
                                seed=config.seed or 0)
    blob = json.dumps([task.corpus, [q.record() for q in task.train], [q.record() for q in task.heldout],
                       [[c.tool, c.payload] for q in task.train + task.heldout for c in q.plan], demos])
    return hashlib.sha256(blob.encode()).hexdigest()


def test_the_embedded_default_task_is_byte_identical_to_before_the_family():
    # Digests of corpus, questions, plans and demonstrations computed at commit 17c2b6d, before the
    # namesake fields existed: the family must not move a single byte of the default task.
    assert _digest(SyntheticTaskConfig()) == "43ba05e9b442df00d88592f3dec85ec6f7d4f675b6b8f3564116b2b6d1371986"
    other = SyntheticTaskConfig(seed=5, num_people=40, num_cities=4, num_train=120, num_heldout=30,
                                lookup_weight=1, two_hop_weight=0, arithmetic_weight=2)
    assert _digest(other) == "5ca76928a3f302e19e821254a87cd422df21922cfc754398a33766d9130a9b73"


def test_adding_namesakes_keeps_the_rest_of_the_world():
    base = SyntheticTaskConfig(seed=2, num_people=40, num_cities=5, num_train=100, num_heldout=20)
    mixed = SyntheticTaskConfig(**{**_fields(base), "namesake_weight": 0.5, "namesake_groups": 10})
    base_task, mixed_task = make_task(base), make_task(mixed)
    assert mixed_task.entities[:45] == base_task.entities  # people and cities, then the namesakes
    assert len(mixed_task.entities) == 45 + 30
    kinds = Counter(q.kind for q in mixed_task.train + mixed_task.heldout)
    assert kinds["namesake"] == round(100 * 0.5 / 1.5) + round(20 * 0.5 / 1.5)
    assert (len(mixed_task.train), len(mixed_task.heldout)) == (100, 20)


def _fields(config):
    return {f: getattr(config, f) for f in config.__struct_fields__}


def test_same_seed_same_family_other_seed_other_family(task):
    assert make_task(FAMILY) == task
    other = make_task(SyntheticTaskConfig(**{**_fields(FAMILY), "seed": 12}))
    assert other.corpus != task.corpus and [q.text for q in other.train] != [q.text for q in task.train]


def _groups(task):
    groups = {}
    for entity in task.entities:
        if " " in entity.name:
            groups.setdefault(entity.name.split()[0], []).append(entity)
    return groups


def test_namesake_groups_share_a_first_name_and_differ_in_what_tells_them_apart(task):
    groups = _groups(task)
    assert len(groups) == 30 and all(len(g) == 3 for g in groups.values())
    single = {e.name for e in task.entities if " " not in e.name}
    surnames = [e.name.split()[1] for g in groups.values() for e in g]
    assert len(set(surnames)) == len(surnames) and not (set(surnames) | set(groups)) & single
    cities = {e.name for e in task.entities if "size" in e.attributes}
    for group in groups.values():
        assert len({e.attributes["city"] for e in group}) == 3 and {e.attributes["city"] for e in group} <= cities
        assert len({e.attributes["color"] for e in group}) == 3
        assert all(set(e.attributes) == set(PERSON_ATTRIBUTES) for e in group)


def test_split_is_disjoint_and_every_question_is_a_namesake_one(task):
    train, heldout = {q.text for q in task.train}, {q.text for q in task.heldout}
    assert len(train) == 240 and len(heldout) == 60 and not train & heldout
    assert {q.kind for q in task.train + task.heldout} == {"namesake"}


def _solve(task, text):
    """An independent solver: parse the question, find the one namesake it describes."""
    attr, first, key, value = re.fullmatch(r"What is the (\w+) of the (\w+) whose (\w+) is (\w+)\?", text).groups()
    (person,) = [e for e in _groups(task)[first] if e.attributes[key] == value]
    return person, attr, key


def test_every_answer_is_copied_from_real_search_results_after_a_choice(task, bm25_tool_fn):
    positions = Counter()
    for question in task.train + task.heldout:
        person, attr, key = _solve(task, question.text)
        first, surname = person.name.split()
        assert question.answer == person.attributes[attr] and attr != key
        assert [c.payload for c in question.plan] == [f"{first} {key}", f"{person.name} {attr}"]
        listing = bm25_tool_fn("search", question.plan[0].payload)
        listed = namesake_candidates(listing, first, key)
        # every namesake is listed (the distractors are really there), each with its own value
        assert sorted(listed) == sorted((e.name.split()[1], e.attributes[key]) for e in _groups(task)[first])
        assert len(listing.splitlines()) == 3
        positions[[s for s, _ in listed].index(surname)] += 1
        # the first result does not hold the answer: the second, disambiguated call is needed
        assert not re.search(rf"\b{re.escape(question.answer)}\b", listing), (question, listing)
        found = bm25_tool_fn("search", question.plan[1].payload)
        assert found.splitlines()[0] == f"Page 1: {person.name} {attr} {question.answer}."
    # the right namesake is not always at the same rank of the listing
    assert len(positions) == 3 and min(positions.values()) > 0.2 * sum(positions.values())


def test_reference_search_lists_namesakes_like_bm25(task, bm25_tool_fn):
    reference = reference_tool_fn(task)
    for question in task.train[:60]:
        listing = reference("search", question.plan[0].payload)
        first, key = question.plan[0].payload.split()
        assert sorted(namesake_candidates(listing, first, key)) == \
            sorted(namesake_candidates(bm25_tool_fn("search", question.plan[0].payload), first, key))
        assert reference("search", question.plan[1].payload) == \
            bm25_tool_fn("search", question.plan[1].payload).splitlines()[0]


def _calls(response):
    return re.findall(r"<search> (.*?)</search> <result>\n(.*?)\n</result>", response, flags=re.DOTALL)


def test_perfect_teacher_demonstrations_are_correct_with_real_results(task, bm25_tool_fn):
    questions = task.train[:80]
    for question, demo in zip(questions, make_demonstrations(questions, bm25_tool_fn)):
        calls = _calls(demo)
        assert [payload for payload, _ in calls] == [c.payload for c in question.plan]
        assert calls[0][1].count("Page ") == 3
        assert is_correct(demo, question) and demo.endswith(f"\\boxed{{ {question.answer}}} </answer>")


def test_the_teacher_picks_a_wrong_namesake_on_its_share_and_follows_it_through(task, bm25_tool_fn):
    questions = task.train[:120]
    gold = make_demonstrations(questions, bm25_tool_fn, seed=4)
    demos = make_demonstrations(questions, bm25_tool_fn, seed=4, wrong_pick_rate=0.25)
    assert demos == make_demonstrations(questions, bm25_tool_fn, seed=4, wrong_pick_rate=0.25)
    assert demos != make_demonstrations(questions, bm25_tool_fn, seed=5, wrong_pick_rate=0.25)
    wrong = [(q, d) for q, d, g in zip(questions, demos, gold) if d != g]
    assert len(wrong) == 30  # round(0.25 * 120), exactly
    picked_ranks = Counter()
    for question, demo in wrong:
        person, attr, key = _solve(task, question.text)
        first = person.name.split()[0]
        (query1, listing), (query2, found) = _calls(demo)
        assert query1 == question.plan[0].payload  # same first step as the gold response
        listed = [s for s, _ in namesake_candidates(listing, first, key)]
        picked = query2.split()[1]
        assert picked in listed and picked != person.name.split()[1] and query2 == f"{first} {picked} {attr}"
        (other,) = [e for e in _groups(task)[first] if e.name == f"{first} {picked}"]
        assert boxed_answer(demo) == other.attributes[attr] and f"{attr} {other.attributes[attr]}." in found
        assert not is_guess(demo)
        picked_ranks[listed.index(picked)] += 1
    assert len(picked_ranks) == 3  # picks come from every rank of the listing, not one position
    assert sum(is_correct(d, q) for q, d in wrong) < len(wrong) / 3  # wrong unless two values coincide


def test_guesses_and_wrong_picks_do_not_overlap_and_guesses_do_not_move(task, bm25_tool_fn):
    questions = task.train[:100]
    guesses_only = make_demonstrations(questions, bm25_tool_fn, guess_rate=0.2, seed=1)
    both = make_demonstrations(questions, bm25_tool_fn, guess_rate=0.2, seed=1, wrong_pick_rate=0.5)
    assert [d for d in both if is_guess(d)] == [d for d in guesses_only if is_guess(d)]
    assert sum(is_guess(d) for d in both) == 20
    assert sum(a != b for a, b in zip(both, guesses_only)) == 40  # half of the 80 not guessed


def test_a_search_that_lists_one_namesake_is_refused(task):
    search = pytest.importorskip("aepo_engine.tools.search")
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        backend = search.CorpusBackend.from_jsonl(task.write_corpus(f"{folder}/kb.jsonl"), topk=1)
        with pytest.raises(ValueError, match="topk"):
            make_demonstrations(task.train[:5], lambda tool, payload: backend.search(payload))
    with pytest.raises(ValueError, match="wrong_pick_rate"):
        make_demonstrations(task.train[:5], reference_tool_fn(task), wrong_pick_rate=2.0)


def test_config_rejects_bad_family_values():
    with pytest.raises(ValueError, match="namesakes_per_group"):
        SyntheticTaskConfig(num_cities=2, namesake_weight=1.0, namesakes_per_group=3)
    with pytest.raises(ValueError, match="namesakes_per_group"):
        SyntheticTaskConfig(namesake_weight=1.0, namesakes_per_group=1)
    with pytest.raises(ValueError, match="namesake_groups"):
        SyntheticTaskConfig(namesake_weight=1.0, namesake_groups=0)
    with pytest.raises(ValueError, match="demo_wrong_pick_rate"):
        SyntheticTaskConfig(demo_wrong_pick_rate=-0.5)
    SyntheticTaskConfig(num_cities=2, namesakes_per_group=3)  # irrelevant while the family is off
    with pytest.raises(ValueError, match="namesake_groups"):
        make_task(SyntheticTaskConfig(num_train=200, num_heldout=20, namesake_weight=1.0, namesake_groups=2))


def test_the_preset_stacks_on_embedded_and_refuses_a_search_that_cuts_the_listing(tmp_path):
    from aepo_engine.config import load_train_config
    from aepo_engine.tasks import SyntheticSetupConfig
    from aepo_engine.tasks.synthetic_setup import prepare_synthetic_run

    cfg = load_train_config(["--preset", "embedded", "--preset", "namesakes"])
    synthetic = cfg.task.synthetic
    assert (synthetic.namesake_weight, synthetic.lookup_weight, synthetic.demo_guess_rate) == (1.0, 0.0, 0.0)
    assert cfg.tools.search.topk == synthetic.namesakes_per_group and cfg.task.source == "synthetic"
    task = make_task(synthetic)
    assert {q.kind for q in task.train} == {"namesake"} and len(task.heldout) == cfg.eval.num_questions
    short = load_train_config(["--preset", "embedded", "--preset", "namesakes", "--tools.search.topk", "2"])
    with pytest.raises(ValueError, match="topk"):
        prepare_synthetic_run(SyntheticSetupConfig(task=short.task, tiny=short.model.tiny, tools=short.tools), tmp_path)
    assert not (tmp_path / "setup").exists()  # refused before building anything


def test_entropy_bench_finds_the_heads_of_the_segments_after_tool_results():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_task_entropy.py"
    spec = importlib.util.spec_from_file_location("bench_task_entropy", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # prompt (0-2), segment (3-6), tool result (7-8), segment (9-10), tool result (11), segment (12)
    mask = (0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 0, 1)
    assert bench.segment_heads(mask, 2) == [[3, 4], [9, 10], [12]]
    assert bench.segment_heads(mask, 9) == [[3, 4, 5, 6], [9, 10], [12]]


@pytest.mark.sandbox
@pytest.mark.slow
def test_a_tiny_namesake_run_goes_through_the_trainer(tmp_path):
    """``--preset embedded --preset namesakes`` end to end at toy size: real BM25 listings in the
    warm-start demonstrations, rollouts with two searches, per-kind evaluation."""
    from runs import train

    # the tiny preset, the namesake task on top; responses long enough for two searches
    proc = train(tmp_path, "--preset", "namesakes", "--task.synthetic.namesake_groups=8",
                 "--task.warm_start.steps=4", "--rollout.max_response_tokens=160",
                 "--rollout.max_tokens_per_segment=64", "--train.steps=1", "--checkpoint.every_n_steps=0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval_before"]["questions/synthetic/namesake"] == 2
    corpus = [json.loads(line) for line in (tmp_path / "setup" / "corpus.jsonl").read_text().splitlines()]
    assert sum(" " in row["id"] for row in corpus) == 8 * 3 * 4  # the namesakes' facts are searchable


# ---------------------------------------------------------------------------------------------
# The value-first listing and the pick note (the namesakes_easy preset)

EASY = SyntheticTaskConfig(**{**_fields(FAMILY), "namesake_listing": "value_first", "namesake_note": True})


@pytest.fixture(scope="module")
def easy_task():
    return make_task(EASY)


@pytest.fixture(scope="module")
def easy_bm25_tool_fn(easy_task, tmp_path_factory):
    return _bm25_tool_fn(easy_task, tmp_path_factory.mktemp("kb_easy"))


def test_value_first_documents_hand_worked():
    from aepo_engine.tasks.synthetic import Entity, SyntheticTask
    zorva = Entity("Zorva Tika", {"age": "34", "score": "51", "color": "red", "city": "Tarunu"})
    kelmu = Entity("Kelmu", {"age": "20", "score": "11", "color": "blue", "city": "Tarunu"})
    easy = SyntheticTask(entities=(kelmu, zorva), train=(), heldout=(), namesake_listing="value_first")
    assert [row["contents"] for row in easy.corpus] == [
        "Kelmu age 20.", "Kelmu score 11.", "Kelmu color blue.", "Kelmu city Tarunu.",  # not a namesake
        "Zorva Tika age 34.", "Zorva Tika score 51.", "Zorva color red Tika.", "Zorva city Tarunu Tika."]
    listing = "Page 1: Zorva city Tarunu Tika.\nPage 2: Zorva Bemo city Kelimo.\nPage 3: Zorva cityX Y."
    assert namesake_candidates(listing, "Zorva", "city") == [("Tika", "Tarunu"), ("Bemo", "Kelimo")]


def test_value_first_changes_only_the_namesakes_listing_pages(task, easy_task):
    assert [(q.text, q.answer, q.plan) for q in easy_task.train + easy_task.heldout] == \
        [(q.text, q.answer, q.plan) for q in task.train + task.heldout]
    changed = [(a, b) for a, b in zip(task.corpus, easy_task.corpus) if a != b]
    assert len(task.corpus) == len(easy_task.corpus) and len(changed) == 30 * 3 * 2  # city + colour pages
    for old, new in changed:
        first, surname, key, value = old["contents"].rstrip(".").split()
        assert key in ("city", "color") and new == {"id": old["id"], "contents": f"{first} {key} {value} {surname}."}


def test_value_first_listing_puts_each_surname_right_after_its_value(easy_task, easy_bm25_tool_fn, task,
                                                                     bm25_tool_fn):
    for question in easy_task.train[:80]:
        person, attr, key = _solve(easy_task, question.text)
        first, surname = person.name.split()
        listing = easy_bm25_tool_fn("search", question.plan[0].payload)
        assert sorted(namesake_candidates(listing, first, key)) == \
            sorted(namesake_candidates(bm25_tool_fn("search", question.plan[0].payload), first, key))
        value = person.attributes[key]
        # the induction copy: the question's value occurs once in the listing, the surname after it
        assert re.findall(rf"\b{value} (\w+)\.", listing) == [surname]
        found = easy_bm25_tool_fn("search", question.plan[1].payload).splitlines()[0]
        assert found == f"Page 1: {easy_task.document(person, attr)}" and question.answer in found.rstrip(".").split()[2:]
        assert easy_bm25_tool_fn("search", question.plan[1].payload).splitlines()[0] == \
            reference_tool_fn(easy_task)("search", question.plan[1].payload).splitlines()[0]


def test_the_note_names_the_pick_right_after_the_listing(easy_task, easy_bm25_tool_fn):
    from aepo_engine.rewards.deep_research import deep_research
    questions = easy_task.train[:120]
    gold = make_demonstrations(questions, easy_bm25_tool_fn, seed=4)
    demos = make_demonstrations(questions, easy_bm25_tool_fn, seed=4, wrong_pick_rate=0.25)
    assert sum(g != d for g, d in zip(gold, demos)) == 30
    for question, demo, right in zip(questions, demos, gold):
        person, attr, key = _solve(easy_task, question.text)
        first, surname = person.name.split()
        value = person.attributes[key]
        (note,) = re.findall(r"</result>\n<think> (\w+) (\w+)</think>\n<search> ", demo)
        assert demo.count("<think>") == 2 and note[0] == value  # the question's value, always
        (_, _), (query2, _) = _calls(demo)
        assert query2 == f"{first} {note[1]} {attr}"  # the second query copies the noted surname
        result = deep_research(demo, [question.answer])
        assert "format_error" not in result.details
        if demo == right:
            assert note[1] == surname and is_correct(demo, question) and result.correct
        else:  # a wrong pick: the teacher misreads the match, notes another listed surname, follows it
            assert note[1] != surname and note[1] in [s for s, _ in namesake_candidates(demo, first, key)]


def test_value_first_without_the_note_differs_from_the_preset_only_in_the_listing(task, bm25_tool_fn,
                                                                                  tmp_path):
    search = pytest.importorskip("aepo_engine.tools.search")
    plain = make_task(SyntheticTaskConfig(**{**_fields(FAMILY), "namesake_listing": "value_first"}))
    backend = search.CorpusBackend.from_jsonl(plain.write_corpus(tmp_path / "kb.jsonl"), topk=3)
    demos = make_demonstrations(plain.train[:40], lambda tool, payload: backend.search(f" {payload}"), seed=1,
                                wrong_pick_rate=0.3)
    before = make_demonstrations(task.train[:40], bm25_tool_fn, seed=1, wrong_pick_rate=0.3)
    swap = lambda text: re.sub(r"^Page (\d+): (\w+) (\w+) (\w+) (\w+)\.$",  # noqa: E731
                               lambda m: m.group(0) if m[3][0].isupper() else f"Page {m[1]}: {m[2]} {m[5]} {m[3]} {m[4]}.",
                               text, flags=re.MULTILINE)
    assert [swap(d) for d in demos] == before and demos != before and "<think> " not in "".join(demos)


def test_config_rejects_an_unknown_listing():
    with pytest.raises(ValueError, match="namesake_listing"):
        SyntheticTaskConfig(namesake_listing="surname_last")
