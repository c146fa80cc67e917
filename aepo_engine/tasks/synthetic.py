"""A generated tool-use task small enough for a tiny model on two CPU cores.

A seeded fictional world of people and cities with short made-up names. A person has an age, a
score, a colour and a home city; a city has a size and a mayor (a person). Every fact is one
tiny document of a JSONL corpus ``{"id", "contents"}``, e.g. ``"Zorva age 34."``, so the search
query "subject attribute" (``<search> Zorva age</search>``) is the only document holding both
words and BM25 ranks it first.

Questions need tools and come in three kinds:
    lookup      "What is the age of Zorva?"                 <search> Zorva age</search> -> answer
    two_hop     "What is the size of the city of Zorva?"    search "Zorva city" -> Tarunu,
                                                            then "Tarunu size" -> answer
    arithmetic  "What is the age of Zorva plus the score of Kelmu?"
                                                            two searches, then <python>
Answers are short strings or integers. The intended response (docs/algorithm.md §3):
    <think></think>
    <search> Zorva age</search> <result>
    Page 1: Zorva age 34.
    </result>
    <answer> \\boxed{ 34} </answer>
(the spaces make every copied word the same BPE token as its source; see ``render_payload``).
The tiny policy never has to know a fact or do arithmetic: every query word is copied from the
question or from a result, every number in the python code is copied from a result and the answer
is copied from the last result. What it must learn is the format and *which* span to copy (two-hop
questions name the attributes in the opposite order of the searches). The warm-start
demonstrations can come from an imperfect teacher that sometimes guesses instead of searching
(``demo_guess_rate``); unlearning that is what RL measurably improves in the embedded default.

The namesake family (``--preset namesakes``; ``namesake_weight`` > 0) moves the headroom to a
decision taken *after* a tool result, where AEPO acts. Groups of people share a first name and
differ in surname, city and colour ("Zorva Tika", "Zorva Bemo", "Zorva Lusa"); a question names
one by a first name and a city or colour:
    namesake    "What is the age of the Zorva whose city is Tarunu?"
                <search> Zorva city</search> <result>
                Page 1: Zorva Bemo city Kelimo.
                Page 2: Zorva Tika city Tarunu.
                Page 3: Zorva Lusa city Posaru.
                </result>
                <search> Zorva Tika age</search> <result>
                Page 1: Zorva Tika age 34.
                Page 2: Zorva Tika score 51.
                ...
                </result>
                <answer> \\boxed{ 34} </answer>
The first search lists every namesake (the distractors; ``tools.search.topk`` >= the group size),
in an order that does not tell which one is asked for. The hard token is the surname of the second
query: the model must find the page whose city (or colour) is the question's and copy the surname
before it - everything else is copying the question or the top page, as in the other kinds, so a
~1M-parameter model can still learn each copy; the match itself (the question's city against the
listed ones) is the one step that is not a plain copy. The warm-start teacher never guesses here but picks
a wrong namesake in ``demo_wrong_pick_rate`` of its demonstrations and follows it through (searches
that person, copies its value): a grounded, well-formed response that is wrong because of one
post-tool decision. The warm-started policy is therefore uncertain exactly at the token after the
first result, and RL's headroom is there:
- entropy-balanced branching (AEPO, ARPO) forks trajectories at high-entropy steps after tool
  results, so the k samples of a prompt spend their budget on alternative picks of the namesake
  (which share the prefix and differ only in that decision) rather than on re-sampling the
  deterministic prefix, and the group's reward contrast lands on that choice;
- the entropy-aware advantage and the stop-gradient clip keep gradient on those high-entropy
  tokens, which are the ones that decide the reward here.
Whether that makes AEPO better than GRPO at an equal budget is the question the comparison
harness measures; the task does not assume it. Measured (docs/experiments.md, "The namesake task"): the
uncertainty does sit after the first result, but the 800-step warm start of the preset leaves the
pick near chance (it copies well-formed queries and answers but does not learn the match), and 30
AEPO steps did not change that on seed 0.

Why the match was not learned, and the variant that makes it a copy: in "Zorva Tika city Tarunu."
the surname comes *before* the value it must be matched by, so at the token that writes the
surname no single causal attention can select it by the value (the surname's position has not
seen the value yet); the model would have to move the surname forward onto the value's position
first. ``namesake_listing = "value_first"`` writes the namesakes' city and colour pages as
"Zorva city Tarunu Tika." (the surname right after its value), and ``namesake_note`` makes the
gold response note its pick right after the listing:
                <search> Zorva city</search> <result>
                Page 1: Zorva city Kelimo Bemo.
                Page 2: Zorva city Tarunu Tika.
                Page 3: Zorva city Posaru Lusa.
                </result>
                <think> Tarunu Tika</think>
                <search> Zorva Tika age</search> ...
Writing " Tarunu" copies the question's value; the surname after it is then an induction copy
(find the token just written earlier in the context, copy what followed it), the mechanism small
transformers learn first; the second query copies the surname from the note. The wrong-pick
teacher notes the question's value with another listed surname (it misreads the match) and
follows that one. The ``namesakes_easy`` preset sets both; the world, questions, plans and
answers are those of ``namesakes``. Measured (docs/experiments.md): it raises the warm start's pick from
chance to p ~0.55 of the teacher's 0.7 (2400 warm-start steps), yet 20 GRPO steps still moved
held-out accuracy by about one point only. Left out of the family: skipping the
disambiguating call (answering from the listing alone), chains of more than one disambiguation,
namesakes in the other question kinds, more than one template, and questions whose description
matches no one or several people.

Deliberately left out: natural-language variety (one template per kind), distractor documents
outside the namesake family, questions without tools. ``reference_tool_fn`` is an exact-lookup oracle for tests and benchmarks
that answers in the engine's search format (``Page 1: ...``); the engine's real tools (BM25 over
the same corpus, a python sandbox) live in ``aepo_engine.tools``.
"""
from __future__ import annotations

import ast
import json
import operator
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

from aepo_engine.seeding import section_seed
from aepo_engine.tasks.config import COLORS, NamesakeListing, SyntheticTaskConfig  # re-exported: their old home
from aepo_engine.tools.base import ToolCall  # a plan's calls are the tools' own call records
from aepo_engine.tools.framing import format_tool_result

QuestionKind = Literal["lookup", "two_hop", "arithmetic", "namesake"]
ToolFn = Callable[[str, str], str]

# Short on purpose: every prompt token costs compute in every SFT and RL step of a tiny model.
SYSTEM_PROMPT = ("Tools: <search> name attribute</search> and <python> print(...)</python>, "
                 "answered in <result>. End with <answer> \\boxed{answer} </answer>.")
# tools.format = "chat_template": the template lists the tools and writes their calls, so the
# prompt names them without the tags' syntax (which the model would then be told and not use).
CHAT_TEMPLATE_SYSTEM_PROMPT = "Use the search and python tools. End with <answer> \\boxed{answer} </answer>."


def system_prompt(tool_format: str = "tags") -> str:
    """The task's system prompt in ``tools.format`` ``tool_format``."""
    return CHAT_TEMPLATE_SYSTEM_PROMPT if tool_format == "chat_template" else SYSTEM_PROMPT

PERSON_ATTRIBUTES = ("age", "score", "color", "city")
DISAMBIGUATING_ATTRIBUTES = ("city", "color")  # differ within a namesake group
CITY_ATTRIBUTES = ("size", "mayor")
NUMERIC_ATTRIBUTES = ("age", "score")  # arithmetic combines two of these
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclass(frozen=True)
class Entity:
    """A person or a city: a name and its attributes (all rendered as strings)."""

    name: str
    attributes: dict[str, str]


def fact_document(name: str, attr: str, value: str) -> str:
    """One fact as a corpus document: ``"Zorva age 34."``."""
    return f"{name} {attr} {value}."


@dataclass(frozen=True)
class Question:
    """One question with its gold tool plan (the calls a correct response makes, in order)."""

    qid: str
    kind: QuestionKind
    text: str
    answer: str
    plan: tuple[ToolCall, ...]
    # Text the gold response thinks right after the first tool result ("Tarunu Tika": the
    # namesake pick, SyntheticTaskConfig.namesake_note); "" = none.
    note: str = ""

    def messages(self, tool_format: str = "tags") -> list[dict[str, str]]:
        """The chat prompt: the system message of ``tool_format`` (:func:`system_prompt`: the tags'
        syntax, or for the chat template's format the tools by name), user = the question."""
        return [{"role": "system", "content": system_prompt(tool_format)}, {"role": "user", "content": self.text}]

    def record(self) -> dict:
        """A JSON-able prompt record (chat prompt + ground truth) for RL datasets."""
        return {"id": self.qid, "kind": self.kind, "prompt": self.messages(),
                "ground_truth": [self.answer]}


@dataclass(frozen=True)
class SyntheticTask:
    entities: tuple[Entity, ...]  # people first, then cities, then namesakes ("Zorva Tika")
    train: tuple[Question, ...]
    heldout: tuple[Question, ...]
    namesake_listing: NamesakeListing = "name_first"  # SyntheticTaskConfig.namesake_listing

    def document(self, entity: Entity, attr: str) -> str:
        """The fact document of one attribute: ``fact_document``, except a namesake's city or
        colour under ``namesake_listing = "value_first"``: "Zorva city Tarunu Tika."."""
        value = entity.attributes[attr]
        if self.namesake_listing == "value_first" and " " in entity.name and attr in DISAMBIGUATING_ATTRIBUTES:
            first, surname = entity.name.split()
            return f"{first} {attr} {value} {surname}."
        return fact_document(entity.name, attr, value)

    @property
    def corpus(self) -> list[dict[str, str]]:
        """The knowledge base as search-corpus rows ``{"id", "contents"}``, one fact per row."""
        return [{"id": f"{e.name}-{attr}", "contents": self.document(e, attr)}
                for e in self.entities for attr in e.attributes]

    def write_corpus(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for row in self.corpus:
                f.write(json.dumps(row) + "\n")
        return path


# ---------------------------------------------------------------------------------------------
# World


def _make_names(rng: random.Random, count: int, syllables: int, taken: set[str]) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))
        name = name.capitalize()
        if name not in taken:
            taken.add(name)
            names.append(name)
    return names


def make_world(config: SyntheticTaskConfig, rng: random.Random) -> tuple[list[Entity], list[Entity]]:
    """People (two-syllable names, "Zorva") and cities (three syllables, "Tarunu")."""
    taken: set[str] = set()
    person_names = _make_names(rng, config.num_people, 2, taken)
    city_names = _make_names(rng, config.num_cities, 3, taken)
    people = [Entity(name, {"age": str(rng.randint(20, 79)), "score": str(rng.randint(10, 99)),
                            "color": rng.choice(COLORS), "city": rng.choice(city_names)})
              for name in person_names]
    cities = [Entity(name, {"size": str(rng.randint(100, 999)), "mayor": rng.choice(person_names)})
              for name in city_names]
    return people, cities


def make_namesakes(config: SyntheticTaskConfig, taken: set[str], city_names: Sequence[str],
                   rng: random.Random) -> list[list[Entity]]:
    """``namesake_groups`` groups of ``namesakes_per_group`` people who share a first name and
    differ in surname, city and colour: ``Entity("Zorva Tika", {age, score, color, city})``.

    Args:
        taken: names already used (first names and surnames are drawn outside it; updated).
        city_names: the world's cities (distinct ones within a group).
        rng: its own stream, so that the rest of the world does not depend on the namesakes.
    """
    size = config.namesakes_per_group
    groups = []
    for first in _make_names(rng, config.namesake_groups, 2, taken):
        surnames = _make_names(rng, size, 2, taken)
        cities, colors = rng.sample(list(city_names), size), rng.sample(COLORS, size)
        groups.append([Entity(f"{first} {surname}", {"age": str(rng.randint(20, 79)),
                                                     "score": str(rng.randint(10, 99)),
                                                     "color": color, "city": city})
                       for surname, city, color in zip(surnames, cities, colors)])
    return groups


# ---------------------------------------------------------------------------------------------
# Questions


_Draft = tuple[str, str, tuple[ToolCall, ...]]  # question text, answer, tool plan
# The namesake maker adds a fourth item: the gold note after the first result (Question.note).


@dataclass(frozen=True)
class _World:
    people: list[Entity]
    cities: dict[str, Entity]  # by name
    namesakes: list[list[Entity]]  # groups sharing a first name; empty unless namesake_weight > 0
    namesake_note: bool = False  # SyntheticTaskConfig.namesake_note


def _search(entity: Entity, attr: str) -> ToolCall:
    return ToolCall("search", f"{entity.name} {attr}")


def _lookup(world: _World, rng: random.Random) -> _Draft:
    people, cities = world.people, world.cities
    if rng.random() < len(cities) / (len(cities) + len(people)):
        entity, attr = rng.choice(list(cities.values())), rng.choice(CITY_ATTRIBUTES)
    else:
        entity, attr = rng.choice(people), rng.choice(PERSON_ATTRIBUTES)
    return (f"What is the {attr} of {entity.name}?", entity.attributes[attr], (_search(entity, attr),))


def _two_hop(world: _World, rng: random.Random) -> _Draft:
    """"<attr> of the city of <person>": the first search asks for "city", the second for attr."""
    person = rng.choice(world.people)
    city = world.cities[person.attributes["city"]]
    attr = rng.choice(CITY_ATTRIBUTES)
    return (f"What is the {attr} of the city of {person.name}?", city.attributes[attr],
            (_search(person, "city"), _search(city, attr)))


def _arithmetic(world: _World, rng: random.Random) -> _Draft:
    first, second = rng.sample(world.people, 2)
    attr1, attr2 = rng.choice(NUMERIC_ATTRIBUTES), rng.choice(NUMERIC_ATTRIBUTES)
    value1, value2 = int(first.attributes[attr1]), int(second.attributes[attr2])
    # Differences are never negative: "{-" would be one BPE pre-token, so "-39" could not be
    # copied token for token from the python output into \boxed{}.
    word, sign = rng.choice((("plus", "+"), ("minus", "-"))) if value1 >= value2 else ("plus", "+")
    answer = value1 + value2 if sign == "+" else value1 - value2
    text = f"What is the {attr1} of {first.name} {word} the {attr2} of {second.name}?"
    plan = (_search(first, attr1), _search(second, attr2),
            ToolCall("python", f"print( {value1} {sign} {value2})"))  # " 34" as in "age 34."
    return text, str(answer), plan


def _namesake(world: _World, rng: random.Random) -> _Draft:
    """"<attr> of the <first name> whose <city|color> is <value>": the first search lists every
    namesake with that attribute, the second searches the one whose value the question names."""
    target = rng.choice(rng.choice(world.namesakes))
    key = rng.choice(DISAMBIGUATING_ATTRIBUTES)
    attr = rng.choice([a for a in PERSON_ATTRIBUTES if a != key])
    first, surname = target.name.split()
    text = f"What is the {attr} of the {first} whose {key} is {target.attributes[key]}?"
    plan = (ToolCall("search", f"{first} {key}"), ToolCall("search", f"{target.name} {attr}"))
    note = f"{target.attributes[key]} {surname}" if world.namesake_note else ""
    return text, target.attributes[attr], plan, note


_MAKERS = {"lookup": _lookup, "two_hop": _two_hop, "arithmetic": _arithmetic, "namesake": _namesake}


def make_task(config: SyntheticTaskConfig = SyntheticTaskConfig()) -> SyntheticTask:
    """Generate the world, the corpus and a train / held-out split of distinct questions.

    Each kind gets its share of both splits (weights normalized, rounded). The split is by
    question text: a held-out question never appears among the train questions (so never in SFT
    demonstrations or RL prompts); the people and documents are shared.
    """
    seed = section_seed(config.seed, "task.synthetic.seed")
    rng = random.Random(seed)
    people, cities = make_world(config, rng)
    namesakes: list[list[Entity]] = []
    if config.namesake_weight > 0:
        taken = {e.name for e in people + cities}
        namesakes = make_namesakes(config, taken, [c.name for c in cities], random.Random(f"namesakes-{seed}"))
    world = _World(people, {c.name: c for c in cities}, namesakes, config.namesake_note)
    weights = {"lookup": config.lookup_weight, "two_hop": config.two_hop_weight,
               "arithmetic": config.arithmetic_weight, "namesake": config.namesake_weight}
    # A kind of weight 0 draws nothing (nor the rounding remainder of the last kind).
    weights = {kind: weight for kind, weight in weights.items() if weight > 0}
    total_weight = sum(weights.values())
    train: list[Question] = []
    heldout: list[Question] = []
    for position, (kind, weight) in enumerate(weights.items()):
        num_heldout = round(config.num_heldout * weight / total_weight)
        num_train = round(config.num_train * weight / total_weight)
        if position == len(weights) - 1:  # the last kind takes the rounding remainder
            num_heldout, num_train = config.num_heldout - len(heldout), config.num_train - len(train)
        questions = _distinct_questions(kind, num_heldout + num_train, world, rng)
        heldout += questions[:num_heldout]
        train += questions[num_heldout:]
    rng.shuffle(train)
    rng.shuffle(heldout)
    return SyntheticTask(entities=tuple(people + cities + [e for group in namesakes for e in group]),
                         train=tuple(_with_id(q, f"train-{i}") for i, q in enumerate(train)),
                         heldout=tuple(_with_id(q, f"heldout-{i}") for i, q in enumerate(heldout)),
                         namesake_listing=config.namesake_listing)


def _distinct_questions(kind: QuestionKind, count: int, world: _World,
                        rng: random.Random) -> list[Question]:
    seen: dict[str, Question] = {}
    for _ in range(50 * count):
        if len(seen) == count:
            break
        text, answer, plan, *note = _MAKERS[kind](world, rng)
        seen.setdefault(text, Question(qid="", kind=kind, text=text, answer=answer, plan=plan,
                                       note=note[0] if note else ""))
    if len(seen) < count:
        more = "namesake_groups" if kind == "namesake" else "num_people"
        raise ValueError(f"cannot draw {count} distinct {kind} questions from {len(world.people)} "
                         f"people and {len(world.namesakes)} namesake groups; raise {more} or "
                         "lower num_train/num_heldout")
    return list(seen.values())


def _with_id(question: Question, qid: str) -> Question:
    return Question(qid=qid, kind=question.kind, text=question.text, answer=question.answer,
                    plan=question.plan, note=question.note)


# ---------------------------------------------------------------------------------------------
# Demonstrations


def make_demonstrations(questions: Sequence[Question], tool_fn: ToolFn, guess_rate: float = 0.0,
                        seed: int = 0, wrong_pick_rate: float = 0.0) -> list[str]:
    """Write one response per question: the gold tool-using one, with tool results produced by
    ``tool_fn``, or (for a ``guess_rate`` share of the questions) a guess without tools, or (for
    a ``wrong_pick_rate`` share of the other namesake questions) a wrong pick.

    A guess is what an imperfect teacher does: it answers at once, from "memory", with the
    answer of a random other question of the same answer type (an age for an age, a city for a
    city, a sum for a sum), so it is wrong unless the values happen to coincide. The warm-started
    policy then guesses about as often as its teacher did; RL has to learn that the tool calls
    pay (the headroom of the embedded default, see ``SyntheticTaskConfig.demo_guess_rate``).

    A wrong pick is the imperfect teacher of the namesake family: it makes the first search,
    reads the namesakes it lists, picks one of the *other* candidates (uniformly), searches that
    person and copies the value found: a well-formed, grounded response that is wrong because of
    one decision taken after a tool result (see ``SyntheticTaskConfig.demo_wrong_pick_rate``).

    Args:
        questions: the questions (use train questions only: held-out ones must stay unseen).
        tool_fn: ``tool_fn(tool_name, payload) -> str`` with tool_name "search" or "python";
            at integration the engine's real tools, in tests ``reference_tool_fn``.
        guess_rate: share of questions, in [0, 1], whose demonstration is a guess; which ones is
            fixed by ``seed``.
        seed: seeds the choice of guessed questions and guessed values, and (in a stream of its
            own, so guesses do not depend on it) of wrong picks.
        wrong_pick_rate: share, in [0, 1], of the namesake questions not guessed whose
            demonstration follows a wrong candidate.

    Returns:
        Response texts (the assistant turn without the end-of-turn token), e.g.
        ``<think></think>\\n<search>Zorva</search> <result>\\n...\\n</result>\\n<answer> \\boxed{34} </answer>``.

    Raises:
        ValueError: a value the response must copy is missing from the tool results (the tool
            did not return the document the plan relies on), so the demonstration would teach
            the model to answer from nowhere; or a namesake search listed fewer than two
            candidates (no decision to learn: the search tool's topk is too small).
    """
    for name, rate in (("guess_rate", guess_rate), ("wrong_pick_rate", wrong_pick_rate)):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"{name}={rate} must be in [0, 1]")
    rng = random.Random(seed)
    guessed = set(rng.sample(range(len(questions)), round(guess_rate * len(questions))))
    picker = random.Random(f"wrong-pick-{seed}")
    namesakes = [i for i, q in enumerate(questions) if q.kind == "namesake" and i not in guessed]
    wrong = set(picker.sample(namesakes, round(wrong_pick_rate * len(namesakes))))
    pools: dict[str, list[str]] = {}
    for q in questions:
        pools.setdefault(answer_type(q), []).append(q.answer)
    responses = []
    for i, q in enumerate(questions):
        if i in guessed:
            responses.append(_guess(q, rng.choice(pools[answer_type(q)])))
            continue
        if q.kind == "namesake":
            candidates = _listed_candidates(q, tool_fn)
            q = _follow_candidate(q, tool_fn, picker.choice(candidates[1:])) if i in wrong else q
        responses.append(_demonstration(q, tool_fn))
    return responses


def namesake_candidates(listing: str, first_name: str, key: str) -> list[tuple[str, str]]:
    """The ``(surname, value)`` pairs a namesake search result lists, in page order: the pages
    ``"<first_name> <surname> <key> <value>."`` (name first) or ``"<first_name> <key> <value>
    <surname>."`` (value first) of ``listing``; other pages are ignored. The two forms cannot be
    confused: a surname is capitalized, a key ("city", "color") is not."""
    first, key = re.escape(first_name), re.escape(key)
    name_first = rf"^Page \d+: {first} ([A-Z]\w*) {key} ([^\s.]+)\.$"
    value_first = rf"^Page \d+: {first} {key} ([^\s.]+) ([A-Z]\w*)\.$"
    pairs = []
    for line in listing.splitlines():
        if match := re.match(name_first, line):
            pairs.append((match[1], match[2]))
        elif match := re.match(value_first, line):
            pairs.append((match[2], match[1]))
    return pairs


def _listed_candidates(question: Question, tool_fn: ToolFn) -> list[str]:
    """The surnames the first search of a namesake question lists, the right one first."""
    first, key = question.plan[0].payload.split()
    right = question.plan[1].payload.split()[1]
    listing = tool_fn("search", question.plan[0].payload)
    surnames = [surname for surname, _ in namesake_candidates(listing, first, key)]
    if right not in surnames or len(surnames) < 2:
        raise ValueError(f"{question.qid}: the search {question.plan[0].payload!r} must list the "
                         f"person asked for ({first} {right}) and another {first}, got {listing!r}; "
                         "set tools.search.topk >= task.synthetic.namesakes_per_group")
    return [right] + [s for s in surnames if s != right]


def _follow_candidate(question: Question, tool_fn: ToolFn, surname: str) -> Question:
    """The namesake question answered as if it asked for ``<first> <surname>``: second search
    on that person, answer = the value its top page gives."""
    first, attr = question.plan[0].payload.split()[0], question.plan[1].payload.split()[-1]
    call = ToolCall("search", f"{first} {surname} {attr}")
    found = namesake_candidates(tool_fn("search", call.payload), first, attr)
    values = [value for listed, value in found if listed == surname]
    if not values:
        raise ValueError(f"{question.qid}: the search {call.payload!r} did not return its fact")
    # The note keeps the question's value and names the wrong pick: the teacher misreads the match.
    note = f"{question.note.split()[0]} {surname}" if question.note else ""
    return Question(question.qid, question.kind, question.text, values[0], (question.plan[0], call), note)


def answer_type(question: Question) -> str:
    """What kind of value answers the question: the attribute asked for, or "number" for arithmetic."""
    if question.kind == "arithmetic":
        return "number"
    return question.plan[-1].payload.split()[-1]


def is_guess(response: str) -> bool:
    """A response that answers without any tool call."""
    return "<answer>" in response and not re.search(r"<(search|python)>", response)


def _guess(question: Question, value: str) -> str:
    space = "" if question.plan[-1].tool == "python" else " "  # as the tool-using answer would be
    return f"<think></think>\n<answer> \\boxed{{{space}{value}}} </answer>"


def _demonstration(question: Question, tool_fn: ToolFn) -> str:
    parts = ["<think></think>"]
    results = []
    for call in question.plan:
        # Unchanged tool text, wrapped exactly as the rollout wraps it (format_tool_result), so the
        # warm start sees the same token sequences as the RL rollouts.
        output = tool_fn(call.tool, call.payload)
        results.append(output)
        parts.append(f"\n<{call.tool}>{render_payload(call)}</{call.tool}>")
        parts.append(format_tool_result(output))
        if question.note and len(results) == 1:  # spaced like render_payload: copied tokens
            parts.append(f"\n<think> {question.note}</think>")
    _check_grounded(question, results)
    # Copy the answer with the spacing it has in the last result: " 34" after "age" in a search
    # result, "61" alone on the python output line (see render_payload).
    space = "" if question.plan[-1].tool == "python" else " "
    parts.append(f"\n<answer> \\boxed{{{space}{question.answer}}} </answer>")
    return "".join(parts)


def render_payload(call: ToolCall) -> str:
    """The text between the tool tags, spaced so every copied word is the same BPE token as
    its source: GPT-2/Qwen-style byte-level BPE makes " Zorva" (after a space) and "Zorva"
    (after "<search>" or "(") two different tokens, and a tiny model learns copying far faster
    when it copies a token than when it must map one token to another. Tools strip the spaces.
    """
    if call.tool == "search":
        return f" {call.payload}"
    return call.payload


def _check_grounded(question: Question, results: list[str]) -> None:
    """Every copied token (query, code number, answer) must be in the question or an earlier result."""
    needed = [(i, word) for i, call in enumerate(question.plan) if call.tool == "search"
              for word in call.payload.split()]
    needed += [(i, num) for i, call in enumerate(question.plan) if call.tool == "python"
               for num in re.findall(r"\d+", call.payload)]
    needed += [(1, word) for word in question.note.split()]  # written after the first result
    needed.append((len(question.plan), question.answer))
    for step, value in needed:
        if not any(_contains_token(text, value) for text in [question.text, *results[:step]]):
            raise ValueError(f"{question.qid}: {value!r} is in neither the question nor the tool "
                             f"results before step {step}; results={results[:step]}")


def _contains_token(text: str, value: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(value)}(?!\w)", text) is not None


# ---------------------------------------------------------------------------------------------
# Reference tools and scoring (oracles for tests and benchmarks)


def exact_search(task: SyntheticTask, query: str) -> str:
    """The fact document for the query "<name> <attribute>" (case-insensitive), else "".

    A query "<first name> <attribute>" naming namesakes ("Zorva city" for "Zorva Tika" and
    "Zorva Bemo") gets the fact of every one of them, one per line, in world order.
    """
    return "\n".join(exact_search_pages(task, query))


def exact_search_pages(task: SyntheticTask, query: str) -> list[str]:
    """The fact documents ``exact_search`` answers with, as a list."""
    words = query.lower().split()
    pages = []
    for entity in task.entities:
        name = entity.name.lower().split()
        for attr in entity.attributes:
            if words == [*name, attr] or (len(name) > 1 and words == [name[0], attr]):
                pages.append(task.document(entity, attr))
    return pages


_BINARY_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _eval_arithmetic(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval_arithmetic(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _eval_arithmetic(node.left), _eval_arithmetic(node.right)
        if max(abs(left), abs(right)) > 10**9:
            raise ValueError("number too large")
        return _BINARY_OPS[type(node.op)](left, right)
    raise ValueError("unsupported expression")


def safe_print_eval(code: str) -> str:
    """Run ``print(<integer + - * expression>)`` lines without exec; anything else is an error.

    The oracle for generated code in benchmarks: the engine's python sandbox runs real code.
    """
    try:
        lines = []
        for statement in ast.parse(code.strip()).body:
            call = statement.value if isinstance(statement, ast.Expr) else None
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and call.func.id == "print" and len(call.args) == 1 and not call.keywords):
                raise ValueError("only print(expression) is supported")
            lines.append(str(_eval_arithmetic(call.args[0])))
        return "\n".join(lines)
    except (SyntaxError, ValueError, RecursionError) as error:
        return f"Error: {error}"


def reference_tool_fn(task: SyntheticTask) -> ToolFn:
    """``tool_fn`` backed by exact lookup and ``safe_print_eval`` (not the engine's tools).

    Search answers like the engine's search tool: ``"Page 1: <document>"``, or one page per
    namesake for a namesake listing (``exact_search``), or ``""`` when nothing matches.
    """

    def tool_fn(tool: str, payload: str) -> str:
        if tool == "search":
            return "\n".join(f"Page {i}: {page}"
                             for i, page in enumerate(exact_search_pages(task, payload), start=1))
        if tool == "python":
            return safe_print_eval(payload)
        return f"Error: unknown tool {tool}"

    return tool_fn


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def boxed_answer(response: str) -> str | None:
    """The last ``\\boxed{...}`` inside ``<answer>...</answer>``, stripped; None if absent."""
    answers = re.findall(r"<answer>(.*?)</answer>", response, flags=re.DOTALL)
    if not answers:
        return None
    boxed = _BOXED.findall(answers[-1])
    return boxed[-1].strip() if boxed else None


def is_correct(response: str, question: Question) -> bool:
    """Exact match (case-insensitive) of the boxed answer with the gold answer."""
    answer = boxed_answer(response)
    return answer is not None and answer.lower() == question.answer.lower()
