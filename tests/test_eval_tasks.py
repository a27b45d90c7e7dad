"""The task generators: prompts reach their token length, hold their gold answers where the task
says, are seeded, and score as their sources do."""

from __future__ import annotations

import json
import re
from concurrent.futures import CancelledError

import numpy as np
import pytest

from longctx.config import EvalParams
from longctx.data.tokenizer import TextTokenizer
from longctx.eval import tasks
from longctx.eval.suite import Encoder, PromptBank, Stopped, build_prompts


@pytest.fixture(scope="module")
def enc(small_project) -> Encoder:
    return Encoder(TextTokenizer.load(small_project / "data/tokens/tokenizer"), chat=False)


@pytest.fixture(scope="module")
def haystack(small_project, enc) -> str:
    from longctx.data.loader import PackedDataset
    from longctx.eval.needle import long_documents

    data = PackedDataset(small_project / "data/packed/stage1/val")
    first = data[long_documents(data, 1)[0]]
    return enc.tok.tok.decode(first.input_ids[:first.doc_lens[0]].tolist())


def test_a_length_too_short_for_a_tasks_fixed_text_is_an_eval_lengths_error(enc, haystack):
    """Where the question, needles and answer prefix alone overflow the length (JSON KV's raw
    IndexError before): the task, the length and the tokens it needs, as a config error."""
    from longctx.errors import ConfigError

    for task in ("json_kv", "passkey"):
        with pytest.raises(ConfigError, match=rf"eval\.lengths: 16 tokens cannot hold a {task} prompt: its "
                                              r"question, needles and answer prefix take \d+ tokens"):
            tasks.build(task, tasks.Budget(enc.count, 16), np.random.default_rng(0), 0.5, haystack)


@pytest.mark.parametrize("task", tasks.TASKS)
@pytest.mark.parametrize("length", [512, 2048])
def test_every_task_fills_its_length_and_holds_its_answer(enc, haystack, task, length):
    budget = tasks.Budget(enc.count, length)
    p = tasks.build(task, budget, np.random.default_rng(0), 0.5, haystack)
    n = len(enc.prompt(p))
    assert 0.85 * length <= n <= length, f"{task}: {n} tokens for {length}"
    assert p.gold and all(isinstance(g, str) and g for g in p.gold)
    if task in ("common_words", "frequent_words"):
        words = re.findall(r"[a-z]+", p.context)
        counts = {w: words.count(w) for w in set(words)}
        least_gold = min(counts[g] for g in p.gold)
        assert all(c <= least_gold for w, c in counts.items() if w not in p.gold)  # gold = the most frequent
    elif task == "icl":
        assert p.gold[0] in re.findall(r"label: (\d+)", p.context)  # the test's class has demonstrations
    else:
        assert all(g in p.context for g in p.gold)
    again = tasks.build(task, budget, np.random.default_rng(0), 0.5, haystack)
    assert again == p  # seeded


def test_needle_depth_places_the_needle(enc):
    budget = tasks.Budget(enc.count, 1024)
    first = tasks.niah(budget, np.random.default_rng(1), 0.0, tasks.NOISE)
    last = tasks.niah(budget, np.random.default_rng(1), 1.0, tasks.NOISE)
    assert first.context.index(first.gold[0]) < 0.05 * len(first.context)
    assert last.context.index(last.gold[0]) > 0.9 * len(last.context)


def test_multi_needle_variants(enc, haystack):
    budget = tasks.Budget(enc.count, 1024)
    rng = np.random.default_rng(2)
    mk = tasks.niah(budget, rng, 0.5, haystack, distractors=3)
    assert len(mk.gold) == 1 and mk.context.count("special magic numbers for") == 4
    mv = tasks.niah(budget, rng, 0.5, haystack, values=4)
    assert len(mv.gold) == 4 and len({re.search(r"for (\S+)", mv.question).group(1)}) == 1
    mq = tasks.niah(budget, rng, 0.5, haystack, queries=4)
    assert len(mq.gold) == 4 and mq.question.count(",") == 3


def test_json_kv_and_variable_tracking_formats(enc):
    budget = tasks.Budget(enc.count, 1024)
    kv = tasks.json_kv(budget, np.random.default_rng(3), 0.5)
    obj = json.loads(kv.context.split("JSON data:\n", 1)[1])
    key = kv.question.split('"')[1]
    assert obj[key] == kv.gold[0] and len(obj) == kv.meta["pairs"] > 3
    vt = tasks.variable_tracking(budget, np.random.default_rng(4))
    value = re.search(r"value (\d+)", vt.question).group(1)
    assert f"VAR {vt.gold[0]} = {value}." in vt.context
    for a, b in zip(vt.gold, vt.gold[1:], strict=False):
        assert f"VAR {b} = VAR {a}." in vt.context


def test_scores_follow_the_sources():
    p = tasks.Prompt("x", 10, "", "", "", ["123", "456"], "all", 8)
    assert tasks.score(p, "it is 123 and 456") == 1.0 and tasks.score(p, "123 only") == 0.5
    s = tasks.Prompt("x", 10, "", "", "", ["abc"], "substring", 8)
    assert tasks.score(s, "xx abc yy") == 1.0 and tasks.score(s, "ab c") == 0.0
    a = tasks.Prompt("x", 10, "", "", "", ["42"], "accuracy", 4)
    assert tasks.score(a, " 42\n") == 1.0 and tasks.score(a, " 4 2") == 0.0 and tasks.score(a, "142") == 0.0


def test_prompt_set_is_the_same_for_every_run(enc, haystack):
    a = build_prompts(enc, ["niah_single_noise", "passkey"], [512, 1024], 2, [0.1, 0.9], 0, haystack)
    b = build_prompts(enc, ["niah_single_noise", "passkey"], [512, 1024], 2, [0.1, 0.9], 0, haystack)
    assert a == b and len(a) == 2 * (2 + 2)
    assert {(p.task, p.meta["depth"]) for p in a if p.task == "niah_single_noise"} == {
        ("niah_single_noise", 0.1), ("niah_single_noise", 0.9)}


@pytest.mark.parametrize("length", [4096, 65536])
def test_fill_takes_the_most_pieces_that_fit_in_a_few_counts(enc, haystack, length):
    text = (haystack + "\n") * (4 * length // max(enc.count(haystack), 1) + 2)  # enough to pass the length
    pieces = [s for s in re.split(r"(?<=[.!?\n])", text) if s]
    calls = []

    def count(s: str) -> int:
        calls.append(len(s))
        return enc.count(s)

    budget = tasks.Budget(count, length)
    got = budget.fill("Question?", lambda n: pieces[:n])
    room = length - budget.reserve - enc.count("Question?")
    assert enc.count("".join(got)) <= room < enc.count("".join(pieces[:len(got) + 1]))  # the most that fit
    assert len(calls) <= 12, f"{len(calls)} tokenizer calls"  # doubling then bisection: ~20 at 64K
    before = len(calls)
    again = budget.fill("Question!", lambda n: pieces[:n])  # the same filler again (another prompt of the length)
    assert again == got and len(calls) == before + 1, "the filler's counts are remembered: only the new question"


def test_prompts_built_side_by_side_are_those_built_one_by_one(enc, haystack):
    """build_prompts fills its prompts on threads, sharing a length's remembered counts: the
    prompts (and their ids from the batch encoder) are those of one Budget each, built in turn."""
    names, lengths, depths = ["passkey", "niah_multikey", "json_kv"], [512, 1024], [0.0, 0.5, 1.0]
    built = build_prompts(enc, names, lengths, 3, depths, 7, haystack)
    wrap = len(enc.prompt(tasks.Prompt("", 0, "", "", "", [""], "all", 0)))
    alone = [tasks.build(name, tasks.Budget(enc.count, n, reserve=wrap + 8),
                         np.random.default_rng([7, n, tasks.TASKS.index(name), i]), depths[i % 3], haystack)
             for n in lengths for name in names for i in range(3)]
    assert built == alone
    assert enc.prompts(built) == [enc.prompt(p) for p in built]


def test_the_prompt_bank_makes_each_length_as_built_alone_and_stops_when_closed(enc, haystack):
    """The bank's prompts of a length are build_prompts' for that length alone (the same seed, the
    same prompts, whatever else is asked), its ids the encoder's, its order theirs sorted (prompts
    that begin alike side by side); closed while building, the lengths not yet made are cancelled."""
    ec = EvalParams(tasks=["passkey", "niah_single_noise", "json_kv"], lengths=[1024, 512], samples=3,
                    depths=[0.1, 0.5, 0.9])
    with PromptBank((enc,), ec, haystack) as bank:
        for n in (512, 1024):
            alone = build_prompts(enc, ec.tasks, [n], 3, ec.depths, ec.seed, haystack)
            assert bank.prompts(n) == alone and bank.ids(enc, n) == enc.prompts(alone)
            ids = bank.ids(enc, n)
            assert [ids[i] for i in bank.order(enc, n)] == sorted(ids) and sorted(bank.order(enc, n)) == list(range(9))
    early = PromptBank((enc,), ec.model_copy(update={"lengths": [512, 1024, 2048, 4096]}), haystack)
    early.close()
    with pytest.raises((Stopped, CancelledError)):
        early.prompts(4096)



def test_held_out_tasks_are_those_no_synthetic_document_asks_like(enc, haystack):
    """tasks.TAUGHT_BY read against the documents themselves: a task taught by a format opens its
    question as that format's documents do; a held-out task's question opens as no document's."""
    from longctx.config import resolve
    from longctx.data import synthetic

    docs = {f: next(synthetic.documents(0, [f], 800, 1600))[1] for f in synthetic.FORMATS}
    for task in tasks.TASKS:
        p = tasks.build(task, tasks.Budget(enc.count, 2048), np.random.default_rng(0), 0.5, haystack)
        asked = " ".join(p.question.split()[:5])  # (before the keys asked for)
        in_docs = {f for f, text in docs.items() if asked in text}
        assert in_docs == set(tasks.TAUGHT_BY.get(task, ())), task
        assert tasks.held_out(task, list(synthetic.FORMATS)) == (not in_docs), task
    assert {t for t in tasks.TASKS if tasks.held_out(t, list(synthetic.FORMATS))} == {
        "json_kv", "variable_tracking", "common_words", "frequent_words", "icl"}
    gpu = resolve({"profile": "gpu-64k"})
    assert tasks.trained_formats(gpu) == ["kv", "multikey", "multiquery", "passkey"]
    tiny = resolve({"profile": "tiny"})  # (its splits mix groups of domains)
    synthetic_domains = [tiny.corpora.domains[d] for d in ("retrieval", "retrieval_long")]
    assert tasks.trained_formats(tiny) == sorted({f for d in synthetic_domains for s in d.sources
                                                  for f in s.synthetic.formats})
    # a synthetic domain no split mixes in trains nothing
    split = gpu.pack.splits["base_short"].model_copy(update={"mix": {"modules": 1.0, "retrieval_short": 0.0}})
    cut = gpu.model_copy(update={"pack": gpu.pack.model_copy(update={"splits": {"base_short": split}})})
    assert tasks.trained_formats(cut) == [] and tasks.held_out("passkey", [])
    assert not tasks.held_out("niah_multikey", ["multiquery"])
