"""``python -m aepo_engine.eval``: see :mod:`aepo_engine.eval.cli`."""
from aepo_engine.eval.cli import main

main()
