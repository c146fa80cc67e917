"""The search tool: offline cache (hit, normalized hit, BM25 fallback), local corpus, HTTP server."""
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aepo_engine.tools import build_tool
import msgspec

from aepo_engine.tools.search import (CacheBackend, CorpusBackend, HttpBackend, RetrieveResponse,
                                      SearchBackendError, format_pages, split_pages)

CACHE = {
    "capital of France": "Page 1: Paris is the capital and largest city of France.\n"
                         "Page 2: France is a country in Western Europe.",
    "search query: boiling point of water": "Page 1: Water boils at 100 degrees Celsius at sea "
                                            "level.\nPage 2: Altitude lowers the boiling point.",
    "who painted the Mona Lisa": "Page 1: The Mona Lisa was painted by Leonardo da Vinci.",
    "tallest mountain": "Page 1: Mount Everest is Earth's highest mountain above sea level.",
    "nothing": "No search results found.",
}

DOCS = [
    {"id": "0", "contents": '"Python (programming language)"\nPython is a high-level language '
                            "created by Guido van Rossum."},
    {"id": "1", "contents": '"Photosynthesis"\nPlants convert light energy into chemical energy.'},
    {"id": "2", "contents": '"Great Wall of China"\nA series of fortifications in northern China.'},
    {"id": "3", "contents": '"Jupiter"\nJupiter is the largest planet in the Solar System.'},
]


@pytest.fixture
def cache_file(tmp_path) -> Path:
    path = tmp_path / "cache.json"
    path.write_text(json.dumps(CACHE))
    return path


@pytest.fixture
def corpus_file(tmp_path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    return path


# ---------------------------------------------------------------------------------------------
# Cache backend


def test_cache_hit_returns_cached_text_verbatim(cache_file):
    tool = build_tool("search", backend="cache", cache_path=str(cache_file))
    result = tool("capital of France")
    assert result.ok and result.text == CACHE["capital of France"]
    assert tool("nothing").text == "No search results found."


@pytest.mark.parametrize("query", ["  Capital   of FRANCE ", '"capital of france"',
                                   "search query: capital of France"])
def test_cache_hit_after_normalization(cache_file, query):
    tool = build_tool("search", backend="cache", cache_path=str(cache_file))
    assert tool(query).text == CACHE["capital of France"]


def test_cache_key_prefix_is_normalized_too(cache_file):
    tool = build_tool("search", backend="cache", cache_path=str(cache_file))
    assert tool("boiling point of water").text == CACHE["search query: boiling point of water"]


def test_cache_miss_falls_back_to_bm25_pages(cache_file):
    tool = build_tool("search", backend="cache", cache_path=str(cache_file), topk=2)
    result = tool("who was Leonardo da Vinci")
    assert result.ok
    assert result.text.startswith("Page 1: The Mona Lisa was painted by Leonardo da Vinci.")
    assert len(split_pages(result.text)) <= 2


def test_cache_miss_without_fallback_or_match(cache_file):
    strict = build_tool("search", backend="cache", cache_path=str(cache_file),
                        cache_bm25_fallback=False)
    assert strict("who was Leonardo da Vinci").text == "No results found."
    tool = build_tool("search", backend="cache", cache_path=str(cache_file))
    assert tool("zyzzyva quux").text == "No results found."  # no word in common: no pages


def test_search_result_is_truncated(cache_file):
    tool = build_tool("search", backend="cache", cache_path=str(cache_file), max_result_chars=40)
    text = tool("capital of France").text
    assert len(text) <= 40 and "truncated" in text


def test_empty_query_is_an_error(cache_file):
    tool = build_tool("search", backend="cache", cache_path=str(cache_file))
    result = tool("   ")
    assert not result.ok and "empty" in result.error


def test_bad_cache_file_is_rejected(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(["not", "a", "mapping"]))
    with pytest.raises(ValueError, match="JSON object"):
        build_tool("search", backend="cache", cache_path=str(path))


def test_reference_cache(shared_data):
    raw = json.loads((shared_data / "search_cache.json").read_text())
    backend = CacheBackend(raw, topk=3)
    query, text = next(iter(raw.items()))
    assert backend.search(query) == text
    # every well-formed cached entry renders back to itself through split/format
    paged = [v for v in raw.values() if v.startswith("Page 1: ")]
    assert sum(format_pages(split_pages(v)) == v for v in paged) == len(paged)
    # a miss (not a key) still finds the relevant cached page by BM25
    assert backend.lookup("Campfire Tales 1997 horror anthology directors") is None
    pages = split_pages(backend.search("Campfire Tales 1997 horror anthology directors"))
    assert 1 <= len(pages) <= 3 and "Campfire Tales" in pages[0]


# ---------------------------------------------------------------------------------------------
# Local corpus


def test_corpus_bm25_ranks_relevant_passage_first(corpus_file):
    backend = CorpusBackend.from_jsonl(corpus_file, topk=2)
    hits = backend.retrieve("largest planet in the solar system")
    assert hits[0].document.id == "3" and hits[0].score > 0
    assert len(hits) <= 2
    tool = build_tool("search", backend="corpus", corpus_path=str(corpus_file), topk=1)
    text = tool("who created the Python language").text
    assert text.startswith('Page 1: "Python (programming language)" Python is a high-level')
    assert "Page 2" not in text


def test_corpus_bad_line_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(DOCS[0]) + "\n" + '{"id": "1"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        CorpusBackend.from_jsonl(path)


# ---------------------------------------------------------------------------------------------
# HTTP server + client


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    cmd = [sys.executable, "-m", "aepo_engine.tools.retrieval_server", "--corpus", str(corpus),
           "--port", "0", "--topk", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), line
        yield line.split()[2] + "/retrieve"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_http_round_trip(server_url):
    client = HttpBackend(server_url, topk=2, timeout_s=5)
    results = client.retrieve(["largest planet", "fortifications in China"])
    assert [hits[0].document.id for hits in results] == ["3", "2"]
    assert all(len(hits) <= 2 for hits in results)
    tool = build_tool("search", backend="http", url=server_url, topk=1)
    result = tool("light energy plants")
    assert result.ok and result.text.startswith('Page 1: "Photosynthesis" Plants convert')


def test_http_server_rejects_bad_requests(server_url):
    client = HttpBackend(server_url, topk=1000, timeout_s=5)
    with pytest.raises(SearchBackendError, match="HTTP 400.*topk"):
        client.retrieve(["x"])


def test_http_unreachable_server_is_a_clean_error():
    with socket.socket() as s:  # a free port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tool = build_tool("search", backend="http", url=f"http://127.0.0.1:{port}/retrieve")
    result = tool("anything")
    assert not result.ok and "unreachable" in result.error


def test_http_timeout_is_a_clean_error():
    with socket.socket() as listener:  # accepts connections (backlog) but never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/retrieve"
        tool = build_tool("search", backend="http", url=url, timeout_s=0.5)
        start = time.monotonic()
        result = tool("anything")
    assert not result.ok and "timed out" in result.error
    assert time.monotonic() - start < 5


def test_response_schema_accepts_search_r1_documents():
    # Search-R1 servers may send integer ids and extra document fields; scores are required.
    raw = b'{"result": [[{"document": {"id": 7, "contents": "c", "title": "t"}, "score": 1.5}]]}'
    hit = msgspec.json.decode(raw, type=RetrieveResponse).result[0][0]
    assert (hit.document.id, hit.document.contents, hit.score) == (7, "c", 1.5)
    with pytest.raises(msgspec.ValidationError, match="score"):
        msgspec.json.decode(b'{"result": [[{"document": {"id": 1, "contents": "c"}}]]}',
                            type=RetrieveResponse)
