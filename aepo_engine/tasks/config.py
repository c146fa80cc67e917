"""The ``task`` config section (with the generated task's ``task.synthetic``), and the sections the
synthetic task's set-up is built from.

Here, below the run config (``aepo_engine.config`` composes ``TaskConfig`` into ``TrainConfig``),
so that the task side never needs the whole run config: the synthetic set-up reads a
:class:`SyntheticSetupConfig` and nothing else.
"""
from __future__ import annotations

from typing import Literal

import msgspec

from aepo_engine.models.config import TinyModelConfig
from aepo_engine.sections import SFTConfig
from aepo_engine.tools.config import ToolsConfig

__all__ = ["COLORS", "NamesakeListing", "SyntheticSetupConfig", "SyntheticTaskConfig", "TaskConfig"]

NamesakeListing = Literal["name_first", "value_first"]
# The world's colours (``tasks.synthetic``); namesakes of one group differ in city or colour.
COLORS = ("red", "blue", "green", "gold", "gray", "pink", "black", "white")


class SyntheticTaskConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Size and mix of the generated task.

    Attributes:
        seed: fixes the world, the questions, the split and the demonstrations. none = derived from the run's root seed (``aepo_engine.seeding``).
        num_people: people in the world (4 fact documents each).
        num_cities: cities (2 fact documents each); every person lives in one.
        num_train: questions for warm-start demonstrations and RL prompts.
        num_heldout: evaluation questions, disjoint from the train questions.
        lookup_weight: relative frequency of one-search look-up questions.
        two_hop_weight: relative frequency of two-hop questions (the city of a person, then its size or mayor).
        arithmetic_weight: relative frequency of arithmetic questions (two searches, then python).
        demo_guess_rate: share of warm-start demonstrations in which the teacher answers at once
            with a guess instead of using tools (see ``make_demonstrations``): the imperfect cold
            start that RL has to improve on. 0 = a perfect teacher.
        namesake_weight: relative frequency of namesake questions ("the age of the Zorva whose
            city is Tarunu": a search lists every Zorva, the model picks one, then searches it;
            see the module docstring). 0 (the embedded default) = no namesakes in the world,
            corpus or questions at all.
        namesake_groups: groups of namesakes (people sharing a first name) when namesake_weight > 0;
            each person has 4 fact documents.
        namesakes_per_group: people per group, in [2, min(num_cities, 8)]: the candidates one
            search lists (set tools.search.topk to at least this, or the list is cut).
        demo_wrong_pick_rate: share of the (non-guessed) namesake demonstrations in which the
            teacher picks a wrong candidate from the search results and follows it through: the
            imperfect post-tool decision that RL has to improve on. 0 = a perfect teacher.
        namesake_listing: how a namesake's city and colour documents read, i.e. the pages the
            first search lists. "name_first" (the default, the ``namesakes`` preset):
            "Zorva Tika city Tarunu." - the surname to copy comes *before* the value to match,
            which a causal model cannot pick by one attention over the page. "value_first"
            (the ``namesakes_easy`` preset): "Zorva city Tarunu Tika." - the surname follows
            the value, so the pick is an induction copy (find the question's value in the
            listing, copy the token after it). See the module docstring.
        namesake_note: the gold response notes its pick right after the first result,
            "<think> Tarunu Tika</think>" (the question's value, then the surname picked), before
            the second search. With "value_first" this turns the pick into a plain induction
            copy right after the model wrote the value; the second query then copies the
            surname from the note. false (the default) = no note.
    """

    seed: int | None = None
    num_people: int = 200
    num_cities: int = 10
    num_train: int = 1000
    num_heldout: int = 200
    lookup_weight: float = 0.4
    two_hop_weight: float = 0.3
    arithmetic_weight: float = 0.3
    demo_guess_rate: float = 0.3
    namesake_weight: float = 0.0
    namesake_groups: int = 100
    namesakes_per_group: int = 3
    demo_wrong_pick_rate: float = 0.0
    namesake_listing: NamesakeListing = "name_first"
    namesake_note: bool = False

    def __post_init__(self) -> None:
        for name in ("demo_guess_rate", "demo_wrong_pick_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1]")
        weights = (self.lookup_weight, self.two_hop_weight, self.arithmetic_weight, self.namesake_weight)
        if min(weights) < 0 or sum(weights) <= 0:
            raise ValueError("question-kind weights must be >= 0 with a positive sum")
        if self.num_people < 2:
            raise ValueError("num_people must be >= 2 because arithmetic combines two people")
        if self.num_cities < 1:
            raise ValueError("num_cities must be >= 1")
        if self.namesake_listing not in ("name_first", "value_first"):
            raise ValueError(f"namesake_listing={self.namesake_listing!r} must be 'name_first' or 'value_first'")
        if self.namesake_weight > 0:
            if self.namesake_groups < 1:
                raise ValueError("namesake_groups must be >= 1 when namesake_weight > 0")
            if not 2 <= self.namesakes_per_group <= min(self.num_cities, len(COLORS)):
                raise ValueError(
                    f"namesakes_per_group={self.namesakes_per_group} must lie in [2, "
                    f"{min(self.num_cities, len(COLORS))}] because namesakes are told apart by their "
                    f"city or colour, which must differ within a group (num_cities={self.num_cities}, "
                    f"{len(COLORS)} colours), and one person is not a choice")



class TaskConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What the agent is trained on.

    Attributes:
        source: "files" (model.path and data.train_files / data.eval_files) or "synthetic" (the
            generated knowledge-base task of the embedded preset, with its own search corpus).
        synthetic: size and mix of the generated task (synthetic only).
        warm_start: supervised warm start on generated demonstrations before RL (synthetic only):
            of the tiny model, or with model.path set of that pretrained model (the cold start).
        warm_start_enabled: run the warm start (synthetic only).
    """

    source: Literal["files", "synthetic"] = "files"
    synthetic: SyntheticTaskConfig = msgspec.field(default_factory=SyntheticTaskConfig)
    warm_start: SFTConfig = msgspec.field(default_factory=SFTConfig)
    warm_start_enabled: bool = True

    def __post_init__(self) -> None:
        held_aside = self.warm_start.val_questions
        if self.source == "synthetic" and self.warm_start_enabled and held_aside >= self.synthetic.num_train:
            raise ValueError(f"warm_start.val_questions={held_aside} would leave none of synthetic.num_train="
                             f"{self.synthetic.num_train} questions to teach: a smaller task holds fewer aside "
                             f"(--task.warm_start.val_questions=N, 0: no score; decay_at_score needs N > 0)")


class SyntheticSetupConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What the synthetic task's set-up (task, corpus, tokenizer, tiny model, warm start) is built
    from: three sections of the run config, and nothing else of it.

    The root seed reaches the set-up through the sub-seeds the run config derives from it
    (``task.synthetic.seed``, ``task.warm_start.seed``, ``model.tiny.seed``; ``aepo_engine.seeding``);
    a sub-seed left at none here resolves as root seed 0 would.

    Attributes:
        task: the run's ``task`` section.
        tiny: the run's ``model.tiny`` section (the tiny Qwen3 the set-up builds).
        tools: the run's ``tools`` section (the demonstrations call the real tools; search is
            pointed at the generated corpus).
        model_path: a pretrained HF folder (the run's ``model.path``, a GGUF file already
            converted) that the warm start starts from (the paper's cold start); empty = build
            the tiny model.
    """

    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    tiny: TinyModelConfig = msgspec.field(default_factory=TinyModelConfig)
    tools: ToolsConfig = msgspec.field(default_factory=ToolsConfig)
    model_path: str = ""
