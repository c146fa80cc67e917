"""Every config field does something: some run code reads it.

A static check over the source of ``aepo_engine`` and ``aepo_kernels``: for each leaf field of
``TrainConfig`` there must be an attribute read ``<expr>.<field>`` outside the field's own class,
where ``<expr>`` is not ``self`` (a ``self.shuffle`` of some other class is not a read of
``data.shuffle``), or a ``self.<field>`` read in a method of its own class other than
``__post_init__`` (a property such as ``PolicyConfig.packs``; validation is no use). The config
machinery (``config_loader``), ``dry_run`` and ``config.config_problems`` do not count: a field
only they read changes no run. Name collisions can still hide an unread field (two sections
with a ``seed``), so each field's behaviour is tested where it acts; this test catches the field
nothing reads at all, as ``data.shuffle_seed``, ``data.max_prompt_tokens`` and ``logging.jsonl``
once were (it reports those three on that code).
"""
import ast
from pathlib import Path

import msgspec

from aepo_engine.config import TrainConfig
from aepo_engine.config_loader import _iter_fields

ROOT = Path(__file__).resolve().parents[1]
NOT_RUN_CODE = {ROOT / "aepo_engine" / name for name in ("config_loader.py", "dry_run.py")}
NOT_RUN_FUNCTIONS = {"config_problems"}


def _attribute_reads(node: ast.AST):
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Load):
            yield sub.attr, isinstance(sub.value, ast.Name) and sub.value.id == "self"


def _run_code() -> list[Path]:
    files = [p for p in (ROOT / "aepo_engine").rglob("*.py") if p not in NOT_RUN_CODE]
    return files + list((ROOT / "kernels").rglob("*.py"))


def _reads(files: list[Path]) -> set[tuple[str, str]]:
    """``(class, attribute)``: ``("", a)`` for a non-self read anywhere in ``files``, ``(C, a)``
    for a ``self.a`` read in a method of class ``C`` other than ``__post_init__``."""
    reads = set()
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        tree.body = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name in NOT_RUN_FUNCTIONS)]
        reads |= {("", attr) for attr, is_self in _attribute_reads(tree) if not is_self}
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for method in cls.body:
                if isinstance(method, ast.FunctionDef) and method.name != "__post_init__":
                    reads |= {(cls.name, attr) for attr, is_self in _attribute_reads(method) if is_self}
    return reads


def unread_fields(config_cls: type, files: list[Path]) -> list[str]:
    """Dotted keys of the leaf fields of ``config_cls`` that no code in ``files`` reads."""
    reads = _reads(files)
    return [dotted for dotted, owner, field in _iter_fields(config_cls)
            if ("", field.name) not in reads and (owner.__name__, field.name) not in reads]


def test_every_config_field_is_read_by_run_code():
    unread = unread_fields(TrainConfig, _run_code())
    assert not unread, f"config fields no run code reads (wire them or delete them): {unread}"


class Toy(msgspec.Struct):
    """Toy section.

    Attributes:
        used: read by the code below.
        validated: only checked in __post_init__.
        shadowed: only another class's self.shadowed is read.
        property_read: read by a property of its own class.
    """

    used: int = 0
    validated: int = 0
    shadowed: int = 0
    property_read: int = 0


def test_the_check_flags_fields_that_are_only_validated_or_shadowed(tmp_path):
    code = tmp_path / "code.py"
    code.write_text(
        "class Toy:\n"
        "    def __post_init__(self):\n        assert self.validated >= 0\n"
        "    @property\n    def doubled(self):\n        return 2 * self.property_read\n"
        "class Other:\n    def run(self, cfg):\n        return cfg.used + self.shadowed\n")
    assert unread_fields(Toy, [code]) == ["validated", "shadowed"]
