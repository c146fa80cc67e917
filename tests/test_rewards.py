"""Tests for the reward functions: hand-worked numbers per rule, then the real datasets."""
import json
from pathlib import Path

import pytest

from aepo_engine.rewards import (RewardResult, as_ground_truths, extract_answer, extract_boxed,
                                 get_reward, list_rewards, normalize_answer, register_reward,
                                 token_f1)
from aepo_engine.rewards.deep_research import check_format
from aepo_engine.rewards.math_answer import math_equal, normalize_math, parse_value

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "arpo"

deep_research = get_reward("deep_research")


def dr_response(answer: str, tools: tuple[str, ...] = ("search", "python")) -> str:
    """A well-formed response: think, one call per tool with its engine-inserted result."""
    calls = "".join(f"<{t}>q</{t}> <result>\nout\n</result>" for t in tools)
    return f"<think>plan</think>{calls}<think>done</think><answer>So \\boxed{{{answer}}}</answer>"


# ---------------------------------------------------------------------------------------------
# Registry and ground-truth parsing.


def test_registry_lists_names_on_unknown():
    assert {"deep_research", "qa_em", "qa_f1", "math"} <= set(list_rewards())
    with pytest.raises(KeyError, match="deep_research.*math.*qa_em"):
        get_reward("deep-research")


def test_register_twice_is_an_error():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("math")(lambda response, ground_truth: RewardResult(0.0, False))


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError):
        deep_research(dr_response("x"), "x", tool_bonnus=0.2)
    with pytest.raises(TypeError):
        get_reward("qa_em")("x", "x", strict=True)


@pytest.mark.parametrize("raw,expected", [
    ("Paris", ["Paris"]),
    (["NYC", "New York"], ["NYC", "New York"]),
    ('["NYC", "New York"]', ["NYC", "New York"]),  # JSON-encoded list of strings
    ("[1, 2]", ["[1, 2]"]),  # valid JSON but numbers: a maths interval, kept whole
    ("[-1, 0)", ["[-1, 0)"]),  # not JSON at all
    ('"Violetta"', ['"Violetta"']),  # a quoted title, not a list
    (70, ["70"]),  # AIME answers are ints
    (("a", 2), ["a", "2"]),
])
def test_as_references(raw, expected):
    assert as_ground_truths(raw) == expected


def test_as_references_rejects_empty():
    for raw in (None, [], ()):
        with pytest.raises(ValueError):
            as_ground_truths(raw)


# ---------------------------------------------------------------------------------------------
# Text normalisation, F1, extraction.


def test_normalize_answer_squad_rules():
    # lowercase, punctuation dropped (also Unicode: curly quote, Chinese comma), a/an/the dropped
    assert normalize_answer("The  U.S.A.’s  Army, an Élite") == "usas army élite"
    assert normalize_answer("北京，大学") == "北 京 大 学"  # one token per CJK character


def test_token_f1_hand_worked():
    # pred tokens [eiffel, tower]; ref [eiffel, tower, in, paris]; common 2.
    # P = 2/2 = 1, R = 2/4 = 0.5, F1 = 2 * 1 * 0.5 / 1.5 = 0.6667.
    assert token_f1("the eiffel tower", "Eiffel Tower in Paris") == pytest.approx(2 / 3)
    # Repeated tokens count once per occurrence: common = min(2, 1) = 1,
    # P = 1/2, R = 1/1, F1 = 2 * 0.5 * 1 / 1.5 = 0.6667.
    assert token_f1("paris paris", "Paris") == pytest.approx(2 / 3)
    # Chinese by character: [北, 京, 大, 学] vs [北, 京]: P = 2/4, R = 2/2, F1 = 2/3.
    assert token_f1("北京大学", "北京") == pytest.approx(2 / 3)
    assert token_f1("London", "Paris") == 0.0
    assert token_f1("", "Paris") == 0.0


def test_article_only_reference_keeps_articles():
    # "A" normalises to nothing under SQuAD; then articles are kept on both sides.
    assert token_f1("A", "A") == 1.0
    assert token_f1("(a)", "A") == 1.0
    assert token_f1("B", "A") == 0.0
    assert token_f1("", "A") == 0.0


@pytest.mark.parametrize("text,expected", [
    ("x \\boxed{1} y \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last, nested braces
    ("\\boxed{ {a}{b{c}} }", "{a}{b{c}}"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are not groups
    ("\\boxed{7} then truncated \\boxed{8", "7"),  # an unclosed last box is skipped
    ("\\fbox{3}", "3"),
    ("no box", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_extract_answer_precedence():
    assert extract_answer("<answer>Rome \\boxed{Paris}</answer>") == "Paris"  # the block's box first
    assert extract_answer("<answer>a</answer> <answer> Rome </answer>") == "Rome"  # last tag
    assert extract_answer("  just Rome \n") == "just Rome"  # else the whole text
    # the answer block beats a box in the reasoning or after the block
    assert extract_answer("<think>\\boxed{Wrong}</think><answer>Paris</answer> \\boxed{Late}") == "Paris"
    assert extract_answer("<result>\\boxed{Page}</result> \\boxed{Mine}") == "Mine"  # tool results never
    assert extract_answer("<answer>a<answer>b</answer>") == "b"  # the nearest opening tag


def test_math_reward_takes_the_box_of_the_answer_block():
    math_reward = get_reward("math")
    assert math_reward("<think>\\boxed{3}</think><answer>\\boxed{4}</answer> \\boxed{5}", "4").correct
    assert math_reward("<think>\\boxed{4}</think><answer>4</answer>", "4").details["format_error"] == "no \\boxed{}"


# ---------------------------------------------------------------------------------------------
# deep_research (docs/algorithm.md §3).


def test_deep_research_exact_with_both_tools():
    # F1 = 1 and both tools used: 1 + 0.1 = 1.1.
    result = deep_research(dr_response("Eiffel Tower"), "the Eiffel Tower")
    assert result.score == pytest.approx(1.1)
    assert result.correct and result.details["tools_used"] == ["python", "search"]


def test_deep_research_partial_f1_one_tool():
    # Only search: no bonus. F1 vs "Eiffel Tower in Paris" = 2/3 as hand-worked above.
    result = deep_research(dr_response("the eiffel tower", ("search",)), "Eiffel Tower in Paris")
    assert result.score == pytest.approx(2 / 3)
    assert not result.correct


def test_deep_research_bonus_needs_positive_f1():
    # F1 = 0 with both tools: score 0, the +0.1 needs F1 > 0.
    assert deep_research(dr_response("London"), "Paris").score == 0.0


def test_deep_research_max_over_references():
    # vs "NYC": 0. vs "New York City": common 2, P = 2/2, R = 2/3, F1 = 2 * (2/3) / (5/3) = 0.8.
    # vs JSON list form of the same: identical. No tools: no bonus.
    for gt in (["NYC", "New York City"], '["NYC", "New York City"]'):
        assert deep_research(dr_response("New York", ()), gt).score == pytest.approx(0.8)


def test_deep_research_no_tools_no_think_is_well_formed():
    assert deep_research("<answer>\\boxed{Paris}</answer>", "Paris").score == 1.0


@pytest.mark.parametrize("response,reason", [
    ("<think>a<answer>\\boxed{x}</answer>", "unpaired <think>"),
    ("</think><answer>\\boxed{x}</answer>", "unpaired <think>"),
    ("<think>a</think>", "not exactly one <answer>"),
    ("<answer>\\boxed{x}</answer><answer>\\boxed{x}</answer>", "not exactly one <answer>"),
    ("<answer>\\boxed{x}", "not exactly one <answer>"),
    ("<search>q</search><answer>\\boxed{x}</answer>", "not followed by <result>"),
    ("<search>q</search>", "not followed by <result>"),
    ("<result>r</result><answer>\\boxed{x}</answer>", "<result> without a preceding"),
    ("<search>q</search> <result>r</result> <result>r</result><answer>\\boxed{x}</answer>",
     "<result> without a preceding"),
    ("<search>q</search> <result>r<answer>\\boxed{x}</answer>", "unclosed <result>"),
    ("<search>q<python>c</python></search>", "<python> inside <search>"),
    ("<search>q</python>", "</python> inside <search>"),
    ("</search>", "</search> without <search>"),
    ("<search><search>q</search>", "<search> inside <search>"),
    ("<python>x = '<answer>\\boxed{1}</answer>'</python>", "<answer> inside <python>"),
    ("<answer><search>q</search></answer>", "<search> inside <answer>"),
    ("<answer>Paris</answer>", "no \\boxed{}"),
    ("\\boxed{x} <answer>x</answer>", "no \\boxed{}"),  # the box must be inside the answer
])
def test_deep_research_format_errors(response, reason):
    result = deep_research(response, "x")
    assert result.score == -1.0 and not result.correct
    assert reason in result.details["format_error"]


def test_deep_research_ignores_tags_inside_results():
    # A web page quoting "<answer>" or "<search>" is tool output, not model structure.
    page = "<answer>\\boxed{Lyon}</answer> <search>x"
    response = f"<search>q</search> <result>\n{page}\n</result><answer>\\boxed{{Paris}}</answer>"
    check = check_format(response)
    assert check.error is None and check.answer == "\\boxed{Paris}"
    assert deep_research(response, "Paris").score == 1.0


def test_deep_research_think_opened_in_prompt_and_options():
    response = "plan</think><answer>\\boxed{Paris}</answer>"
    assert deep_research(response, "Paris").score == -1.0
    assert deep_research(response, "Paris", think_opened_in_prompt=True).score == 1.0
    assert deep_research("<answer>x</answer>", "x", format_penalty=-0.5).score == -0.5
    assert deep_research(dr_response("x"), "x", tool_bonus=0.0).score == 1.0


# ---------------------------------------------------------------------------------------------
# qa_em / qa_f1.


def test_qa_rewards():
    qa_em, qa_f1 = get_reward("qa_em"), get_reward("qa_f1")
    # boxed answer "eiffel tower" vs "Eiffel Tower in Paris": EM 0, F1 2/3 (hand-worked above).
    response = "<answer>It is \\boxed{the eiffel tower}</answer>"
    assert qa_em(response, "Eiffel Tower in Paris").score == 0.0
    assert qa_f1(response, "Eiffel Tower in Paris").score == pytest.approx(2 / 3)
    # EM against any reference (max), JSON list form accepted; correct == EM for both.
    result = qa_f1("<answer>N.Y.C.</answer>", '["New York City", "NYC"]')
    assert result.score == 1.0 and result.correct and result.details["em"] == 1.0
    assert qa_em("Paris", ["paris"]).correct  # whole text when no box and no tag


# ---------------------------------------------------------------------------------------------
# math.

EQUIVALENT = [
    ("0.5", "\\frac{1}{2}"),  # 0.5 = 1/2 exactly as Fractions
    ("1/2", "\\dfrac12"),  # a/b, \dfrac and the \frac12 shorthand
    ("-0.75", "-\\frac{3}{4}"),
    ("-.75", "\\frac{-3}{4}"),
    ("1,000", "1000"),  # thousands separator
    ("1{,}000.5", "1000.50"),
    ("50\\%", "50"),  # percent read as a unit
    ("90^\\circ", "90"),
    ("90 degrees", "90"),
    ("5 \\text{ cm}", "5"),
    ("\\$18.00", "18"),
    ("x = 5", "5"),
    ("\\sqrt{8}", "2\\sqrt{2}"),  # 8 = 2^2 * 2
    ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}"),  # 1/sqrt2 = sqrt2/2
    ("\\sqrt{\\frac{3}{4}}", "\\frac{\\sqrt3}{2}"),  # sqrt(3/4) = sqrt(12)/4 = 2sqrt3/4
    ("-6 + 3\\sqrt{3}", "3\\sqrt{3} - 6"),  # sums of surds, reordered
    ("2^{10}", "1024"),
    ("2^{-1}", "0.5"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),  # tuple, item-wise
    ("[1, \\frac{4}{2})", "[1,2)"),  # interval, 4/2 = 2
    ("\\text{(C)}", "(C)"),
]
NOT_EQUIVALENT = [
    ("0.333", "\\frac{1}{3}"),  # exact: 333/1000 != 1/3
    ("[1,2]", "[1,2)"),  # open vs closed end
    ("(1,2)", "(2,1)"),  # ordered
    ("2x", "2"),  # a variable is not a unit
    ("\\sqrt{2}", "1.414"),
    ("-5", "5"),
]


@pytest.mark.parametrize("prediction,reference", EQUIVALENT)
def test_math_equal(prediction, reference):
    assert math_equal(prediction, reference)
    assert math_equal(reference, prediction)


@pytest.mark.parametrize("prediction,reference", NOT_EQUIVALENT)
def test_math_not_equal(prediction, reference):
    assert not math_equal(prediction, reference)


def test_math_rel_tol_and_values():
    assert math_equal("0.333", "\\frac{1}{3}", rel_tol=1e-2)  # |0.333 - 1/3| / (1/3) = 0.001
    assert parse_value(normalize_math("3\\sqrt{12} - 6")) == {1: -6, 3: 6}  # 3*2sqrt3 - 6
    assert parse_value("\\frac{1}{0}") is None and parse_value("2^{1000}") is None


@pytest.mark.parametrize("answer", ["(" * 3000 + "1" + ")" * 3000, "9" * 100_000, "1 " + "a" * 60 + "1",
                                    "((10^{64})^{64})^{64}", "\\sqrt{" * 500 + "2" + "}" * 500,
                                    "[" * 400 + "1,2" + "]" * 400, "\\frac{1}{0}", "{{{"])
def test_math_adversarial_answers_are_bounded(answer):
    # Deep nesting, 100k-digit numbers, huge powers: no exception, just "not equal".
    assert get_reward("math")(f"\\boxed{{{answer}}}", "2").score == 0.0


def test_math_reward():
    math_reward = get_reward("math")
    response = "First \\boxed{3} no, finally \\boxed{\\dfrac{\\sqrt{3}}{2}}."
    assert math_reward(response, "\\frac{\\sqrt 3}{2}").score == 1.0
    assert math_reward(response, ["0.5", "\\frac{\\sqrt{3}}{2}"]).correct
    assert math_reward("The answer is 3", "3").details["format_error"] == "no \\boxed{}"
    # GSM8K-style full solution as reference: the part after ####.
    assert math_reward("\\boxed{18}", "9 * 2 = 18\n#### 18").correct


# ---------------------------------------------------------------------------------------------
# Real data (skipped when ../shared is absent).

needs_data = pytest.mark.skipif(not (DATA / "rl_datasets").is_dir(),
                                reason=f"reference data not found at {DATA}")


def _balanced(text: str) -> bool:
    depth = 0
    for pos, ch in enumerate(text):
        if pos == 0 or text[pos - 1] != "\\":
            depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


@needs_data
@pytest.mark.parametrize("name", ["hard_search_1k", "train_10k", "valid", "gaia_test",
                                  "hle_test"])
def test_parquet_ground_truths_match_themselves(name):
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow not installed")
    table = pq.read_table(DATA / "rl_datasets" / f"{name}.parquet", columns=["reward_model"])
    rows = [row["ground_truth"] for row in table.column("reward_model").to_pylist()]
    checked = 0
    for gt in rows:
        ref = as_ground_truths(gt)[-1]
        # A few train_10k references are truncated LaTeX ("1}^N") or blank; they can't be boxed.
        if not ref.strip() or not _balanced(ref) or "\\boxed" in ref:
            continue
        dr = deep_research(dr_response(ref), gt)
        assert dr.correct and dr.score == pytest.approx(1.1), (gt, dr)
        assert get_reward("math")(f"\\boxed{{{ref}}}", gt).correct, gt
        checked += 1
    assert checked >= 0.99 * len(rows)


@needs_data
@pytest.mark.parametrize("name", ["hotpotqa", "2wiki", "bamboogle", "xbench"])
def test_eval_answer_lists_as_list_and_json(name):
    lines = (DATA / "eval" / name / "test.jsonl").read_text().splitlines()[:200]
    for line in lines:
        answers = json.loads(line)["answer"]
        response = f"<answer>\\boxed{{{answers[-1]}}}</answer>"
        for gt in (answers, json.dumps(answers)):
            assert get_reward("qa_em")(response, gt).correct, (answers, gt)


@needs_data
@pytest.mark.parametrize("name", ["math500", "gsm8k", "aime24", "aime25"])
def test_math_eval_answers_match_themselves(name):
    # gsm8k answers are full solutions ending in "#### 18"; aime25 answers are ints.
    for line in (DATA / "eval" / name / "test.jsonl").read_text().splitlines():
        answer = json.loads(line)["answer"]
        final = str(answer).rsplit("####", 1)[-1].strip()
        assert get_reward("math")(f"\\boxed{{{final}}}", answer).correct, answer


def test_a_reward_outside_the_package_named_by_path(tmp_path, monkeypatch, capsys):
    """reward.path: a file of the user's own is imported before reward.name is looked up, once per
    process (the dry run and the trainer both build the reward); a module on sys.path works too;
    a missing file, a failing import and a name the file does not register are clear errors."""
    from aepo_engine.config import load_train_config
    from aepo_engine.rewards import RewardConfig, build_reward_fn

    name = f"length_{tmp_path.name}"  # the registry is per process: one name per test run
    user = tmp_path / "my_rewards.py"
    user.write_text(
        "from aepo_engine.rewards import RewardResult\n"
        "from aepo_engine.rewards.base import register_reward\n\n"
        f"@register_reward({name!r})\n"
        "def shortness(response, ground_truth, *, scale=1.0):\n"
        "    return RewardResult(scale / (1 + len(response)), response == ground_truth)\n")
    cfg = load_train_config([f"--reward.path={user}", f"--reward.name={name}", "--reward.options={scale = 2.0}"])
    fn = build_reward_fn(cfg.reward)
    assert fn("abc", "abc").score == 0.5 and fn("abc", "abc").correct
    assert build_reward_fn(cfg.reward)("a", "b").score == 1.0  # imported once: no double registration
    monkeypatch.chdir(tmp_path)  # a relative path is read from the working directory
    assert build_reward_fn(RewardConfig(path="my_rewards.py", name=name))("", "").score == 1.0
    (tmp_path / "their_rewards.py").write_text(
        user.read_text().replace(repr(name), repr(name + "_m")).replace("scale / ", "3 * scale / "))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert build_reward_fn(RewardConfig(path="their_rewards", name=name + "_m"))("", "").score == 3.0  # a module
    assert build_reward_fn(RewardConfig(path="their_rewards", name="qa_em"))  # the built-ins are still there
    with pytest.raises(ValueError, match="reward.path = 'nope.py': no such file"):
        build_reward_fn(RewardConfig(path="nope.py", name=name))
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    with pytest.raises(ValueError, match="importing it failed: ModuleNotFoundError"):
        build_reward_fn(RewardConfig(path=str(tmp_path / "broken.py"), name=name))
    with pytest.raises(ValueError, match="unknown reward 'other'"):
        build_reward_fn(RewardConfig(path=str(user), name="other"))


def test_the_old_names_of_the_ground_truth_helpers_still_work():
    """``as_references`` / ``reference_answer`` were renamed (the gold answers are the ground truth;
    "reference" is the kernels' fp32 oracle); reward code of one's own that imports them still runs."""
    from aepo_engine.rewards import as_references
    from aepo_engine.rewards.text import ground_truth_answer, reference_answer
    assert as_references is as_ground_truths and reference_answer is ground_truth_answer
