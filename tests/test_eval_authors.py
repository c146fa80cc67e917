"""The authors' rules: the AEPO/ARPO authors' evaluator and reward as we read their code
(RUC-NLPIR/ARPO, commit a95cd08), checked on hand-worked cases, their known mistakes included,
and on the real gold answers of the shared eval sets."""
from __future__ import annotations

import json

import pytest

from aepo_engine.evaluation.benchmarks import BENCHMARKS, load_eval_source
from aepo_engine.evaluation.authors import (authors_metrics, authors_prediction, gsm8k_gold, is_equiv,
                                            strip_math_string)
from aepo_engine.evaluation.scoring import score_response
from aepo_engine.rewards import RewardConfig, build_reward_fn, get_reward

deep_research = get_reward("deep_research")


def ref(response: str, golds, check: str = "qa", gold=None) -> dict:
    return score_response(response, golds, check, scoring="authors", gold=gold)


# ---------------------------------------------------------------------------------------------
# The prediction.

@pytest.mark.parametrize("response,expected", [
    ("<answer>So \\boxed{Paris}</answer>", "Paris"),
    ("<answer>a</answer> <answer> \\boxed{1} then \\boxed{2} </answer>", "2"),  # last block, last box
    ("<answer>\\boxed{\\text{Frank Lowy}}</answer>", "Frank Lowy"),  # \text unwrapped when it is all
    ("<answer>\\boxed{\\text{A} and \\text{B}}</answer>", "A} and \\text{B"),  # ... even when it is not
    ("<answer>\\boxed{5\\text{ cm}}</answer>", "5\\text{ cm}"),
    ("<answer> Paris </answer>", " Paris "),  # no box: the block as it is
    ("<answer>\\boxed{}</answer>", "\\boxed{}"),  # an empty box: the block
    ("<answer>\\boxed{Paris</answer>", "\\boxed{Paris"),  # unclosed: runs to the end of the block
    ("<answer>\\fbox{3}</answer>", "\\fbox{3}"),  # only \boxed{...} is unwrapped
    ("<think>\\boxed{7}</think> no block", "7"),  # no block: the last box of the whole response
    ("<search>q</search><result><answer>\\boxed{Lyon}</answer></result>", "Lyon"),  # tool results count
])
def test_prediction(response, expected):
    assert authors_prediction(response) == expected


def test_empty_prediction_falls_back_to_the_last_five_lines():
    response = "l1\n\nl2\nl3\nl4\nl5\nl6\n<answer></answer>"
    assert authors_prediction(response) == "l3\nl4\nl5\nl6\n<answer></answer>"
    assert authors_prediction("   ") == ""


# ---------------------------------------------------------------------------------------------
# Maths equivalence (MATH's string clean-up) and their mistakes.

@pytest.mark.parametrize("a,b", [
    ("\\frac12", "\\frac{1}{2}"), ("\\dfrac{1}{2}", "0.5"), ("3/4", "\\frac{3}{4}"), ("x = 5", "5"),
    ("10\\%", "10"), ("5 \\text{ cm}", "5"), ("90^\\circ", "90"), ("\\left( 1, 2 \\right)", "(1,2)"),
    ("\\sqrt2", "\\sqrt{2}"), (".5", "0.5"), ("\\$18", "18"),
])
def test_is_equiv_true(a, b):
    assert is_equiv(a, b) and is_equiv(b, a)


@pytest.mark.parametrize("a,b", [
    ("025", "25"),  # their mistake: no numeric reading, so AIME24's gold "025" rejects 25
    ("10%", "10"),  # only "\%" is removed
    ("1,000", "1000"), ("0.50", "0.5"), ("-50", "50"), ("(3,4]", "[3,4]"), ("\\frac{14}{3}", "\\frac{1}{43}"),
    ("2x", "2"),
])
def test_is_equiv_false(a, b):
    assert not is_equiv(a, b)


def test_clean_up_failures_compare_the_raw_strings():
    with pytest.raises(ValueError):
        strip_math_string("5\\text{ m}\\text{ s}")  # two units
    assert is_equiv("\\sqrt", "\\sqrt") and not is_equiv("\\sqrt", "\\sqrt ")  # a dangling \sqrt
    assert is_equiv(None, None) and not is_equiv("1", None) and not is_equiv("70", 70)
    assert strip_math_string("k = \\frac1{72}") == "\\frac{1}{72}"


# ---------------------------------------------------------------------------------------------
# Metrics.

def test_qa_metrics_hand_worked():
    # Punctuation is kept: "frank lowy." vs "frank lowy": em 0; acc 1 (substring);
    # tokens [frank, lowy.] vs [frank, lowy]: common 1, P = R = 1/2, F1 = 0.5.
    m = authors_metrics("Frank Lowy.", ["Frank Lowy"], "qa")
    assert (m["em"], m["acc"], m["f1"]) == (0.0, 1.0, 0.5)
    # articles dropped, case folded: exact
    assert authors_metrics("The Frank Lowy", ["frank lowy"], "qa")["em"] == 1.0
    # no yes/no rule in their eval F1: [not, yes] vs [yes] -> P = 1/2, R = 1, F1 = 2/3
    assert authors_metrics("not yes", ["yes"], "qa")["f1"] == pytest.approx(2 / 3)
    # whitespace tokens only: a Chinese answer is one token
    assert authors_metrics("肖亮", ["肖亮老师"], "qa")["f1"] == 0.0
    # an empty gold is in every prediction
    assert authors_metrics("anything", [""], "qa")["acc"] == 1.0
    assert authors_metrics("", ["x"], "qa") == {"em": 0.0, "acc": 0.0, "f1": 0.0, "math": 0.0}


def test_bracketed_string_gold_is_split_on_commas():
    # HLE's gold "[11,19,22]" (a string) becomes three golds: "19" is an exact match.
    assert authors_metrics("19", "[11,19,22]", "qa")["em"] == 1.0
    assert authors_metrics("19", ["[11,19,22]"], "qa")["em"] == 0.0  # a list is not split
    assert authors_metrics("'a'", "['a', 'b']", "qa")["em"] == 1.0  # quotes are kept


def test_math_metrics_and_correct():
    m = authors_metrics("x = 5", 5, "math")  # an int gold is read as "5"
    assert (m["em"], m["acc"], m["math"]) == (0.0, 1.0, 1.0)
    s = ref("<answer>\\boxed{x = 5}</answer>", ["5"], "math", gold=5)
    assert s["correct"] and s["em"] == 0.0  # "correct" on maths sets is math_equal
    s = ref("<answer>\\boxed{Paris, France}</answer>", ["Paris"], "qa")
    assert not s["correct"] and s["acc"] == 1.0  # ... and em on QA sets
    with pytest.raises(ValueError, match="unknown authors' task"):
        authors_metrics("x", "x", "mixed")


def test_mixed_sets_are_qa_sets_for_them():
    # HLE is "qa" in their task map: "0.5" is not "\frac{1}{2}" there (no maths equivalence of golds)
    assert not ref("<answer>\\boxed{0.5}</answer>", ["\\frac{1}{2}"], "mixed")["correct"]
    assert ref("<answer>\\boxed{0.5}</answer>", ["\\frac{1}{2}"], "math")["correct"]


def test_gsm8k_gold_loses_its_commas_but_the_prediction_keeps_them(tmp_path):
    assert gsm8k_gold("so 1000 + 25 = 1,025\n#### 1,025") == "1025" and gsm8k_gold("no answer") is None
    (tmp_path / "gsm8k").mkdir()
    row = {"question": "How many?", "answer": "500 * 2 = <<500*2=1000>>1,000\n#### 1,000"}
    (tmp_path / "gsm8k" / "test.jsonl").write_text(json.dumps(row) + "\n")
    (example,) = load_eval_source("gsm8k", tmp_path).examples
    assert example.ground_truth == ["1,000"] and example.meta["gold"] == "1000"
    for answer, engine_ok, authors_ok in (("1000", True, True), ("1,000", True, False)):
        response = f"<answer>\\boxed{{{answer}}}</answer>"
        assert score_response(response, example.ground_truth, "math")["correct"] == engine_ok
        assert ref(response, example.ground_truth, "math", gold=example.meta["gold"])["correct"] == authors_ok


def test_real_golds_against_themselves(shared_data):
    """Each gold boxed in an answer block: the engine accepts all of them (but one HLE gold with
    unbalanced braces, which cannot be boxed); the authors' rules reject exactly their own mistakes:
    HLE golds split on commas (4), MATH500 golds whose \\text{} is unwrapped on the prediction side
    only (8), GSM8K golds with thousands commas, which only the gold loses (14)."""
    expected_authors_misses = {"hle": 4, "math500": 8, "gsm8k": 14}
    for name in BENCHMARKS:
        if name == "math":
            continue  # not in the shared data
        s = load_eval_source(name, shared_data / "eval")
        engine = authors = 0
        for e in s.examples:
            answer = e.ground_truth[-1]
            if answer.count("{") != answer.count("}"):
                continue
            response = f"<think>t</think><answer>\\boxed{{{answer}}}</answer>"
            engine += not score_response(response, e.ground_truth, s.check)["correct"]
            authors += not ref(response, e.ground_truth, s.check, gold=e.meta["gold"])["correct"]
        assert engine == 0, name
        assert authors == expected_authors_misses.get(name, 0), name


# ---------------------------------------------------------------------------------------------
# The reward (reward.rules = "authors").

def dr(answer: str, tools=("search", "python"), think: str = "<think>plan</think>") -> str:
    calls = "".join(f"<{t}>q</{t}> <result>\nout\n</result>" for t in tools)
    return f"{think}{calls}<think>done</think><answer>So \\boxed{{{answer}}}</answer>"


def rr(response: str, gt, **options):
    return deep_research(response, gt, rules="authors", **options)


def test_authors_reward_agrees_on_plain_responses():
    cases = ((dr("Eiffel Tower"), "the Eiffel Tower"), (dr("the eiffel tower", ("search",)), "Eiffel Tower in Paris"),
             (dr("London"), "Paris"), (dr("New York", ()), ["NYC", "New York City"]))
    for response, gt in cases:
        engine, authors = deep_research(response, gt), rr(response, gt)
        assert engine.score == pytest.approx(authors.score) and engine.correct == authors.correct


@pytest.mark.parametrize("response,reason", [
    ("<answer>\\boxed{Paris}</answer>", "<think> or </think> not found"),  # a think pair is required
    ("<think>a<think>b</think><answer>\\boxed{Paris}</answer>", "not paired"),
    ("<think>t</think><search>q</search> <result>a page quoting <answer> here</result>"
     "<answer>\\boxed{Paris}</answer>", "<answer> or </answer> not found"),  # tags counted anywhere
    ("<think>t</think><search>q</search><answer>\\boxed{Paris}</answer>", "search/result tags are incomplete"),
    ("<think>t</think><python>c<result>r</result></python><answer>\\boxed{Paris}</answer>",
     "python/result tags are nested in the wrong order"),
    ("<think>t</think></answer><answer>\\boxed{Paris}", "must be before"),
    ("<think>t</think><answer>Paris</answer>", "missing \\boxed{}"),
    ("<think>t</think><answer>{a} \\boxed{Paris</answer>", "find box error"),  # unclosed box
    ("<think>t</think><answer>\\boxed{a} \\boxed</answer>", "find box error"),  # the last \boxed has no brace
])
def test_authors_reward_format_errors(response, reason):
    result = rr(response, "Paris")
    assert result.score == -1.0 and not result.correct and reason in result.details["format_error"]


def test_authors_reward_rules_hand_worked():
    # the bonus counts closing tags anywhere, a page quoting "</python>" too: F1 1 + 0.1; the engine
    # counts completed calls (search only here): 1.0
    quoted = "<think>t</think><search>q</search> <result>page: </python></result><answer>\\boxed{Paris}</answer>"
    assert rr(quoted, "Paris").score == pytest.approx(1.1) and deep_research(quoted, "Paris").score == 1.0
    # "\boxed " with a space wins over any \boxed{}: everything after its last occurrence up to "$"
    # (the format check still wants a "\boxed{" in the block)
    spaced = "<think>t</think><answer>$\\boxed Paris$ is my guess, not \\boxed{Rome}</answer>"
    assert rr(spaced, "Paris").details["answer"] == "Paris" and deep_research(spaced, "Paris").score == 0.0
    # no \text{} unwrapping: "textfrank lowy" vs "frank lowy": common 1, P = R = 1/2, F1 = 0.5
    boxed_text = "<think>t</think><answer>\\boxed{\\text{Frank Lowy}}</answer>"
    assert rr(boxed_text, "Frank Lowy").score == pytest.approx(0.5)
    assert deep_research(boxed_text, "Frank Lowy").score == 1.0  # the engine unwraps it
    # the yes/no rule, in both
    for rules in ("project", "authors"):
        assert deep_research(dr("not yes", ()), "yes", rules=rules).score == 0.0
        assert deep_research(dr("yes", ()), "yes", rules=rules).score == 1.0
    # integer ground truth, options and the think opened by the chat template
    assert rr(dr("70", ()), 70).correct
    assert rr("<think>t</think><answer>x</answer>", "x", format_penalty=-0.5).score == -0.5
    assert rr(dr("x"), "x", tool_bonus=0.0).score == 1.0
    assert rr("plan</think><answer>\\boxed{Paris}</answer>", "Paris", think_opened_in_prompt=True).score == 1.0
    with pytest.raises(ValueError, match="unknown reward rules"):
        deep_research(dr("x"), "x", rules="paper")


def test_reward_rules_config():
    fn = build_reward_fn(RewardConfig(rules="authors"))
    assert fn("<answer>\\boxed{Paris}</answer>", ["Paris"]).score == -1.0  # no <think>: theirs is malformed
    assert build_reward_fn(RewardConfig())("<answer>\\boxed{Paris}</answer>", ["Paris"]).score == 1.0
    with pytest.raises(ValueError, match="reward.rules must be one of project, authors"):
        RewardConfig(rules="paper")
    with pytest.raises(ValueError, match="reward.options.rules"):
        RewardConfig(options={"rules": "authors"})
    with pytest.raises(ValueError, match="deep_research"):
        build_reward_fn(RewardConfig(name="qa_f1", rules="authors"))
    assert build_reward_fn(RewardConfig(name="qa_f1"))("<answer>Paris</answer>", "Paris").score == 1.0


def test_config_fields_load_dump_and_reject():
    from aepo_engine.config import TrainConfig, load_train_config
    from aepo_engine.config_loader import ConfigError, dump_config, loads_config
    from aepo_engine.eval import expand_aliases

    default = load_train_config([])
    assert (default.reward.rules, default.eval.scoring, default.eval.judge.prompt) == ("project",) * 3
    cfg = load_train_config(["--reward.rules=authors", "--eval.scoring=authors", "--eval.judge.prompt=authors"])
    assert (cfg.reward.rules, cfg.eval.scoring, cfg.eval.judge.prompt) == ("authors",) * 3
    assert loads_config(TrainConfig, dump_config(cfg)) == cfg  # the run's config.toml round trip
    for override, message in (("--reward.rules=paper", "reward.rules must be one of project, authors"),
                              ("--eval.scoring=paper", "eval.scoring must be one of project, authors"),
                              ("--eval.judge.prompt=paper", "judge.prompt must be one of project, authors")):
        with pytest.raises(ConfigError, match=message):
            load_train_config([override])
    assert expand_aliases(["--scoring", "authors", "--judge-prompt=authors"]) == [
        "--eval.scoring=authors", "--eval.judge.prompt=authors"]


def test_old_name_reference_still_loads_with_a_warning_naming_authors(tmp_path, capsys):
    """The authors' rules were once named "reference" (that word now means the kernels' fp32
    oracle): a config, a saved run's config.toml or an override with the old value loads as
    "authors", and stderr says the new name once per setting."""
    from aepo_engine import config_loader
    from aepo_engine.config import TrainConfig, load_train_config
    from aepo_engine.config_loader import ConfigError, load_config, loads_config

    config_loader._SAID.clear()
    path = tmp_path / "old.toml"
    path.write_text('[reward]\nrules = "reference"\n[eval]\nscoring = "reference"\nsystem_prompt = "reference"\n'
                    '[eval.judge]\nprompt = "reference"\n')
    cfg = load_config(TrainConfig, path)
    assert (cfg.reward.rules, cfg.eval.scoring, cfg.eval.judge.prompt, cfg.eval.system_prompt) == ("authors",) * 4
    err = capsys.readouterr().err
    for setting in ("reward.rules", "eval.scoring", "eval.judge.prompt", "eval.system_prompt"):
        assert err.count(f"warning: {setting} = 'reference' is now called 'authors'") == 1, err
    assert loads_config(TrainConfig, path.read_text()) == cfg  # a saved run's config.toml
    assert capsys.readouterr().err == ""  # said once per process
    assert load_train_config(["--eval.scoring=reference"]).eval.scoring == "authors"  # an override too
    with pytest.raises(ConfigError, match="eval.scoring must be one of project, authors, got 'paper'"):
        load_train_config(["--eval.scoring=paper"])
    # Python callers get the new name only: the old one is a config file's courtesy.
    with pytest.raises(ValueError, match="unknown reward rules"):
        deep_research("<think>t</think><answer>\\boxed{x}</answer>", "x", rules="reference")


def test_old_name_engine_still_loads_as_project_with_a_warning(tmp_path, capsys):
    """The project's own rules were named "engine" until the glossary gave that word one meaning (a
    running sampler of the policy; docs/glossary.md, issue 51): "engine" in a config file, a saved
    run's config.toml or an override of any of the three settings loads as "project", with one
    warning line per setting; the configs are then equal, so every score is the same."""
    from aepo_engine import config_loader
    from aepo_engine.config import TrainConfig, load_train_config
    from aepo_engine.config_loader import ConfigError, dump_config, load_config, loads_config
    from aepo_engine.eval import EvalCommandConfig, expand_aliases

    settings = ("reward.rules", "eval.scoring", "eval.judge.prompt")

    def rules(cfg):
        return cfg.reward.rules, cfg.eval.scoring, cfg.eval.judge.prompt

    def said(err, setting):
        return err.count(f"warning: {setting} = 'engine' is now called 'project'; the old name still works")

    default = load_train_config([])
    config_loader._SAID.clear()
    path = tmp_path / "old.toml"
    path.write_text('[reward]\nrules = "engine"\n[eval]\nscoring = "engine"\n[eval.judge]\nprompt = "engine"\n')
    cfg = load_config(TrainConfig, path)
    assert rules(cfg) == ("project",) * 3 and cfg == load_config(TrainConfig)
    err = capsys.readouterr().err
    assert all(said(err, setting) == 1 for setting in settings), err
    assert loads_config(TrainConfig, path.read_text()) == cfg  # a saved run's config.toml
    assert capsys.readouterr().err == ""  # said once per process
    assert 'rules = "project"' in dump_config(cfg) and 'rules = "engine"' not in dump_config(cfg)

    for setting in settings:  # each command-line override
        config_loader._SAID.clear()
        assert load_train_config([f"--{setting}=engine"]) == default
        err = capsys.readouterr().err
        assert said(err, setting) == 1 and err.count("'engine' is now called") == 1, err
    config_loader._SAID.clear()
    ev = load_config(EvalCommandConfig, overrides=expand_aliases(["--scoring", "engine", "--judge-prompt=engine"]))
    assert (ev.eval.scoring, ev.eval.judge.prompt) == ("project", "project")
    assert said(capsys.readouterr().err, "eval.scoring") == 1
    # the new name is silent, and "authors" is untouched
    assert rules(load_train_config([f"--{s}=project" for s in settings])) == ("project",) * 3
    assert rules(load_train_config([f"--{s}=authors" for s in settings])) == ("authors",) * 3
    assert capsys.readouterr().err == ""
    # eval.system_prompt is not a rules setting: "engine" there is the prompt's text
    assert load_train_config(["--eval.system_prompt=engine"]).eval.system_prompt == "engine"
    with pytest.raises(ConfigError, match="reward.rules must be one of project, authors, got 'paper'"):
        load_train_config(["--reward.rules=paper"])

    # the same scores under both spellings: the reward, the evaluation's scores
    old = load_train_config([f"--{s}=engine" for s in settings])
    responses = ["<think>t</think><answer>\\boxed{Paris}</answer>", "<answer>\\boxed{Paris}</answer>",
                 "<think>t</think><search>q</search><result>\\boxed{Rome}</result><answer>\\boxed{Rome}</answer>",
                 "<think>t</think><answer>\\boxed{\\text{Paris}}.</answer>", "no answer", "<answer>\\boxed{70}</answer>"]
    old_reward, new_reward = build_reward_fn(old.reward), build_reward_fn(RewardConfig(rules="project"))
    for response in responses:
        assert old_reward(response, ["Paris"]) == new_reward(response, ["Paris"])
        for check in ("qa", "math", "mixed"):
            assert (score_response(response, ["Paris", "70"], check, scoring=old.eval.scoring)
                    == score_response(response, ["Paris", "70"], check, scoring="project")
                    == score_response(response, ["Paris", "70"], check))
    # Python callers get the new name only: the old one is a config file's courtesy.
    with pytest.raises(ValueError, match="unknown scoring 'engine'"):
        score_response("x", ["x"], "qa", scoring="engine")
    with pytest.raises(ValueError, match="unknown reward rules 'engine'"):
        deep_research("<think>t</think><answer>\\boxed{x}</answer>", "x", rules="engine")
    with pytest.raises(ValueError, match="reward.rules must be one of project, authors, got 'engine'"):
        RewardConfig(rules="engine")
