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

from aepo_engine.config import TrainConfig
from aepo_engine.config_loader import _iter_fields

ROOT = Path(__file__).resolve().parents[1]
NOT_RUN_CODE = {ROOT / "aepo_engine" / name for name in ("config_loader.py", "dry_run.py")}
NOT_RUN_FUNCTIONS = {"config_problems"}


def _attribute_reads(node: ast.AST):
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Load):
            yield sub.attr, isinstance(sub.value, ast.Name) and sub.value.id == "self"


def _reads() -> set[tuple[str, str]]:
    """``(class, attribute)``: ``("", a)`` for a non-self read anywhere in run code, ``(C, a)``
    for a ``self.a`` read in a method of class ``C`` other than ``__post_init__``."""
    reads = set()
    files = [p for p in (ROOT / "aepo_engine").rglob("*.py") if p not in NOT_RUN_CODE]
    files += list((ROOT / "kernels").rglob("*.py"))
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        tree.body = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name in NOT_RUN_FUNCTIONS)]
        reads |= {("", attr) for attr, is_self in _attribute_reads(tree) if not is_self}
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for method in cls.body:
                if isinstance(method, ast.FunctionDef) and method.name != "__post_init__":
                    reads |= {(cls.name, attr) for attr, is_self in _attribute_reads(method) if is_self}
    return reads


def test_every_config_field_is_read_by_run_code():
    reads = _reads()
    unread = []
    for dotted, owner, field in _iter_fields(TrainConfig):
        if ("", field.name) not in reads and (owner.__name__, field.name) not in reads:
            unread.append(dotted)
    assert not unread, f"config fields no run code reads (wire them or delete them): {unread}"


def test_the_check_can_fail():
    # a field name nothing reads is reported
    reads = _reads()
    assert not any(attr == "no_such_field_anywhere" for _, attr in reads)
    assert any(attr == "overlong_prompts" for _, attr in reads)
