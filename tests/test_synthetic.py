"""The synthetic retrieval source: seeded documents of the requested lengths in the eval tasks'
formats, each answerable from its own text, never holding an eval prompt's key or pass key, and
written by the corpora stage like any other source."""

from __future__ import annotations

import re

import numpy as np
import pyarrow.parquet as pq
import pytest

from longctx.config import CorporaParams, EvalParams, SourceParams
from longctx.data import corpora
from longctx.data.sources import iter_docs
from longctx.data.synthetic import TRAIN_WORDS
from longctx.errors import ConfigError
from longctx.eval import tasks


def synthetic(n: int, seed: int = 0, **spec) -> list[str]:
    source = SourceParams(synthetic={"min_chars": 800, "max_chars": 6000, **spec}, max_docs=n)
    return [d.text for d in iter_docs(source, "long", seed, "replace")]


def test_documents_are_seeded_and_of_the_requested_lengths():
    docs = synthetic(60)
    assert docs == synthetic(60) and docs != synthetic(60, seed=1)
    assert all(800 - len(tasks.NOISE) <= len(d) <= 6000 + 200 for d in docs)
    lengths = np.log([len(d) for d in docs])
    assert lengths.std() > 0.35  # spread over the range (log-uniform: 0.52), not one size


def test_every_document_asks_what_its_own_text_holds():
    digits = set()
    for text in synthetic(40, formats=["passkey", "kv", "multikey", "multiquery"]):
        context, *qas = text.split("\n\n")
        asked = []
        for qa in qas:
            question, answer = qa.split("\n")
            if question == tasks.PASSKEY_ASK[0]:
                key = re.fullmatch(r"The pass key is (\d+)\.", answer).group(1)
                assert tasks.passkey_needle(key) in context
                digits.add(len(key))
            else:
                key = re.search(r"for (\S+) mentioned", question).group(1)
                value = re.search(r"are (\d{7})\.$", answer).group(1)
                assert tasks.niah_needle(key, value) in context
                assert (question, answer.rsplit(" ", 1)[0]) == tasks.niah_ask([key])
                asked.append(key)
        needles = context.count("special magic numbers for")
        if len(qas) > 1:  # multiquery: every needle asked once, several per document
            assert sorted(asked) == sorted(set(asked)) and len(asked) == needles >= 2
    assert digits == {4, 6, 7}  # pass keys of every length but eval's five


def test_no_document_holds_an_eval_prompts_key():
    corpus = "\n".join(synthetic(300))
    budget = tasks.Budget(lambda t: len(t) // 4, 2048)
    for i, name in enumerate(("passkey", "niah_single_noise", "niah_multikey", "niah_multiquery")):
        for sample in range(20):
            prompt = tasks.build(name, budget, np.random.default_rng([EvalParams().seed, 2048, i, sample]), 0.5, "x.")
            if name == "passkey":
                assert not re.search(rf"\b{prompt.gold[0]}\b", corpus)  # eval's keys have 5 digits, ours 4, 6, 7
            for key in re.findall(r"[a-z]+-[a-z]+", prompt.question):
                assert key not in corpus and not set(key.split("-")) & set(TRAIN_WORDS)


def test_bad_synthetic_sources_are_refused():
    with pytest.raises(ValueError, match="needs max_docs or max_bytes"):
        SourceParams(synthetic={})
    with pytest.raises(ValueError, match="min_chars 5000 is above max_chars 100"):
        SourceParams(synthetic={"min_chars": 5000, "max_chars": 100}, max_docs=1)
    with pytest.raises(ValueError, match="formats"):
        SourceParams(synthetic={"formats": ["riddle"]}, max_docs=1)
    with pytest.raises(ConfigError, match="synthetic"):
        from longctx import config

        config.resolve({"profile": "tiny", "corpora": {"domains": {"retrieval": {
            "kind": "long", "sources": [{"synthetic": {"max_chars": 0}, "max_docs": 5}]}}}})


def test_the_corpora_stage_writes_them_within_the_budget(tmp_path):
    cfg = CorporaParams(domains={"retrieval": {"kind": "long", "sources": [
        {"synthetic": {"formats": ["passkey", "kv"], "min_chars": 500, "max_chars": 2000}, "max_bytes": 20000}]}})
    manifest = corpora.build(cfg, tmp_path)
    texts = pq.read_table(tmp_path / "retrieval.parquet").column("text").to_pylist()
    assert manifest["domains"]["retrieval"]["docs"] == len(texts) >= 10
    assert 20000 <= sum(len(t.encode()) for t in texts) < 20000 + 2000  # stops at the first doc past the budget
    questions = {t.rsplit("\n\n", 1)[1].split("\n")[0] for t in texts}
    assert tasks.PASSKEY_ASK[0] in questions and any(q.startswith("What are all the special magic number for ")
                                                     for q in questions)


def test_in_an_sft_domain_they_are_chats_asked_as_eval_asks_a_chat_model():
    """The same documents as conversations: the context and the first question in the user's
    turn, each answer after eval's answer prefix in the assistant's; multiquery's further
    questions in further turns. The text is the plain document's, turn by turn."""
    spec = SourceParams(synthetic={"formats": ["passkey", "multiquery"], "min_chars": 800, "max_chars": 900},
                        max_docs=2)
    plain, chats = (list(iter_docs(spec, kind, 0, "replace")) for kind in ("whole", "sft"))
    assert [d.id for d in plain] == [d.id for d in chats]
    for doc, chat in zip(plain, chats, strict=True):
        turns = chat.messages
        assert [t["role"] for t in turns] == ["user", "assistant"] * (len(turns) // 2)
        pairs = zip(turns[::2], turns[1::2], strict=True)
        assert "\n\n".join(f"{u['content']}\n{a['content']}" for u, a in pairs) == doc.text
    passkey, multi = chats[0].messages, chats[1].messages
    question, prefix = tasks.PASSKEY_ASK
    assert len(passkey) == 2 and passkey[0]["content"].endswith("\n\n" + question)
    key = re.fullmatch(rf"{prefix} (\d{{4}}|\d{{6,7}})\.", passkey[1]["content"]).group(1)
    assert f"The pass key is {key}." in passkey[0]["content"]  # the needle is in the user's context
    assert len(multi) >= 4 and all(t["content"].startswith("What are all the special magic number for")
                                   for t in multi[2::2])
