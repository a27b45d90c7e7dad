"""The eval library the eval stage calls, on the small project's real data and a small model: what
each measurement of a checkpoint puts into the results, what it skips and why, and the score
tables read back from them (in memory and from metrics/eval.json)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import yaml

from longctx.config import EvalParams
from longctx.data.loader import PackedDataset
from longctx.data.tokenizer import TextTokenizer
from longctx.errors import ConfigError, DataError
from longctx.eval import helmet, lm_harness, needle, report, suite
from longctx.model.config import FoxConfig, ModelConfig, RopeConfig
from longctx.model.hf import save_native
from longctx.model.transformer import Transformer

TOKENIZER = "data/tokens/tokenizer"


def small_model(window: int = 256, vocab: int = 1024, rope: bool = True) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab, d_model=64, n_layers=2, n_heads=4, ffn_dim=128, max_position_embeddings=window,
                      rope=RopeConfig(theta=10000.0) if rope else None)
    return Transformer(cfg, attention_backend="sdpa").eval()


@pytest.fixture(scope="module")
def tok(small_project) -> TextTokenizer:
    return TextTokenizer.load(small_project / TOKENIZER)


@pytest.fixture(scope="module")
def long_val(small_project) -> PackedDataset:
    return PackedDataset(small_project / "data/packed/stage2/val")  # 2048-token sequences


def test_score_tables_read_memory_and_json_alike():
    tasks = {"base": {"passkey": {256: 1.0, 512: 0.5}, "icl": {256: 0.0, 512: 0.25}},
             "sft": {"passkey": {256: 0.75}, "icl": {256: 0.25}}}
    from_json = json.loads(json.dumps(tasks))  # lengths become strings
    rows = report.score_rows(tasks)
    assert len(rows) == 6 and rows[1] == {"checkpoint": "base", "task": "passkey", "length": 512, "score": 0.5}
    assert report.score_rows(from_json) == rows
    assert report.length_means(from_json) == report.length_means(tasks) == (
        [256, 512], {"base": {256: 0.5, 512: 0.375}, "sft": {256: 0.5}})
    results = {**report.empty_results(), "tasks": tasks, "retention_ppl": {"base": 12.5},
               "throughput": {"base": {"prompts_per_s": 2.0}, "sft": {"prompts_per_s": 0.5}}}
    assert report.comparison(results).splitlines() == [
        "| checkpoint | tasks@256 | tasks@512 | retention ppl |", "|---|---|---|---|",
        "| base | 0.500 | 0.375 | 12.50 |", "| sft | 0.500 | skipped | n/a |"]
    results["means"] = {"base": {"256": {"mean": 0.5, "n": 20, "lo": 0.3, "hi": 0.7}}}  # as read back from JSON
    assert report.comparison(results).splitlines()[2] == "| base | 0.50 [0.30-0.70] (20) | 0.375 | 12.50 |"
    results["position_loss"] = {"base": {"documents": 3, "bands": {"0-256": 3.25, "256-512": 2.5}},
                                "sft": {"positions": 256, "mean": 3.0}}  # (a result of older runs: no bands)
    assert report.comparison(results).splitlines()[-4:] == [
        "| checkpoint | documents | 0-256 | 256-512 |", "|---|---|---|---|",
        "| base | 3 | 3.250 | 2.500 |", "| sft | - | - | - |"]


def test_near_misses_count_wrong_answers_that_copied_the_needles_number_almost():
    def row(task, n, gold, output, score=0.0, ckpt="sft"):
        return {"task": task, "length": n, "gold": gold, "output": output, "score": score, "checkpoint": ckpt}

    rows = [row("niah_single_noise", 4096, ["1214510"], " 8214510."),  # first chunk wrong: 1 edit of 7
            row("niah_single_noise", 4096, ["6863952"], " 68639."),  # stopped 2 digits early: 2 edits
            row("niah_single_noise", 4096, ["9445109"], " 9445."),  # 3 edits: more than a third
            row("niah_single_noise", 4096, ["1112999"], " 741834. 5 and 1112"),  # another number
            row("passkey", 4096, ["38423"], " 38424."),  # 1 edit of 5
            row("passkey", 4096, ["38423"], " 38424.", score=1.0),  # right: not a miss
            row("passkey", 65536, ["55169"], " 55196."),  # 2 edits of 5: more than max(1, 5 // 3)
            row("niah_multivalue", 4096, ["1234567", "7654321"], " 1234568"),  # several golds: not counted
            row("variable_tracking", 4096, ["XQZ"], " XQY"),  # not a number
            row("passkey", 4096, ["38423"], "", ckpt="base")]  # nothing written
    misses = report.near_misses(rows)
    assert misses == {"sft": {4096: {"wrong": 5, "near": 3}, 65536: {"wrong": 1, "near": 0}},
                      "base": {4096: {"wrong": 1, "near": 0}}}
    results = report.empty_results()
    results["tasks"] = {"sft": {"passkey": {4096: 0.5, 65536: 0.0}}}
    results["near_misses"] = misses
    assert "| sft | 3 of 5 | 0 of 1 |" in report.comparison(results)


def test_mean_scores_average_the_prompts_of_a_task_at_a_length():
    rows = [{"task": "passkey", "length": 256, "score": 1.0}, {"task": "passkey", "length": 256, "score": 0.0},
            {"task": "passkey", "length": 512, "score": 1.0}, {"task": "icl", "length": 256, "score": 0.5}]
    assert report.mean_scores(rows) == {"passkey": {256: 0.5, 512: 1.0}, "icl": {256: 0.5}}


def test_windows_refuse_bad_checkpoints_and_lengths(small_project, tok, tmp_path):
    for name, m in {"short": small_model(256), "long": small_model(512), "nope": small_model(rope=False),
                    "small_vocab": small_model(vocab=64)}.items():
        save_native(m, tmp_path / name)
    folders = {n: tmp_path / n for n in ("short", "long")}
    tok_folder = small_project / TOKENIZER
    assert suite.windows(folders, tok, tok_folder, [256, 512]) == {"short": (256, False), "long": (512, False)}
    # no RoPE, no limit
    assert suite.windows({"nope": tmp_path / "nope"}, tok, tok_folder, [4096]) == {"nope": (None, False)}
    with pytest.raises(ConfigError,
                       match=r"eval.lengths: \[1024\] exceed every checkpoint's window \(the longest is 512"):
        suite.windows(folders, tok, tok_folder, [256, 1024])
    with pytest.raises(DataError, match=r"1024 tokens but checkpoint .*small_vocab has a vocabulary of 64"):
        suite.windows({**folders, "small_vocab": tmp_path / "small_vocab"}, tok, tok_folder, [256])


def test_perplexities_at_every_length_documents_reach(small_project, tok, long_val):
    model = small_model(256)
    results = report.empty_results()
    curve = suite.perplexities(results, "m", model, long_val, tok,
                               EvalParams(lengths=[32, 256, 4096], position_sequences=2, needle_sequences=2))
    assert list(results["ppl_by_length"]["m"]) == [32, 256, 2048]  # 4096: no document that long; 2048: packed length
    docs = [torch.from_numpy(long_val[i].input_ids[:256].astype(np.int64))
            for i in needle.long_documents(long_val, 256)[:2]]
    with torch.no_grad():
        nll = sum(torch.nn.functional.cross_entropy(model(d)[:-1], d[1:], reduction="sum") for d in docs) / (2 * 255)
    assert results["ppl_by_length"]["m"][256] == pytest.approx(math.exp(float(nll)), rel=1e-4)
    assert results["position_loss"]["m"]["positions"] == 2048
    top = needle.long_documents(long_val, 2048)[:2]
    losses = needle.position_loss(model, [long_val[i].input_ids[:2048] for i in top])
    bands = results["position_loss"]["m"]["bands"]
    assert list(bands) == ["0-32", "32-256", "256-2048"]  # between the lengths documents reach
    assert bands["32-256"] == pytest.approx(float(losses[32:256].mean()))
    assert bands["0-32"] > bands["256-2048"]  # more context, a lower loss (a trained model)
    positions = [r["position"] for r in curve]
    assert positions == sorted(positions) and positions[-1] == 2047  # 2047 next-token losses in 2048 tokens
    assert {r["checkpoint"] for r in curve} == {"m"}
    assert np.mean([r["loss"] for r in curve]) == pytest.approx(results["position_loss"]["m"]["mean"], rel=0.02)
    assert set(results["needle_ppl"]["m"]) == {256, 2048}  # a needle and its question do not fit in 32 tokens
    [skip] = results["skipped"]
    assert skip["task"] == "needle_ppl" and skip["length"] == 32 and "need a document" in skip["reason"]

    chats = PackedDataset(small_project / "data/packed/sft/val")  # no 512-token document starts a sequence
    results = report.empty_results()
    assert suite.perplexities(results, "m", model, chats, tok, EvalParams(lengths=[512])) == []
    assert results["skipped"] == [{"checkpoint": "m", "task": "perplexity", "reason": "no long validation documents"}]
    assert results["ppl_by_length"] == results["needle_ppl"] == results["position_loss"] == {}


def test_helmet_prompts_skip_a_dataset_that_cannot_be_loaded(tok, tmp_path):
    ctxs = [{"id": f"p{i}", "title": f"T{i}", "text": f"Passage {i} is about the number {i}." * 8
             + (" The answer is zebra42." if i == 3 else ""), "has_answer": i == 3} for i in range(40)]
    (tmp_path / "nq.jsonl").write_text(json.dumps({"question": "what?", "answers": ["zebra42"], "ctxs": ctxs}) + "\n")
    (tmp_path / "story.jsonl").write_text(json.dumps({"document": "the old sailor went to sea " * 400,
                                                      "question": "who?", "answers": ["the old sailor"]}) + "\n")
    ec = EvalParams(samples=2, depths=[0.0, 1.0], helmet={
        "nq": {"kind": "rag", "path": str(tmp_path / "nq.jsonl")},
        "gone": {"kind": "rag", "path": str(tmp_path / "missing.jsonl")},
        "story": {"kind": "narrativeqa", "path": str(tmp_path / "story.jsonl")}})
    enc = suite.Encoder(tok, chat=False)
    results = report.empty_results()
    prompts = helmet.prompts(results, "m", enc.count, ec, [512, 1024])
    assert [(p.task, p.length) for p in prompts] == [(t, n) for t in ("rag_nq", "narrativeqa_story")
                                                     for n in (512, 1024) for _ in range(2)]
    assert [p.meta["depth"] for p in prompts[:2]] == [0.0, 1.0]  # depths cycle over the samples
    assert all(len(enc.prompt(p)) <= p.length for p in prompts)
    [skip] = results["skipped"]
    assert skip["checkpoint"] == "m" and skip["task"] == "helmet:gone" and "cannot load split" in skip["reason"]
    assert "helmet:story" in results["not_computed"] and "helmet:nq" not in results["not_computed"]
    assert helmet.prompts(report.empty_results(), "m", enc.count, ec, [512, 1024]) == prompts  # seeded


def test_lm_eval_scores_what_it_can_and_skips_the_rest(tok, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": [" Paris", " seven"], "answer": 0}) + "\n"
                            for q in ("The capital of France is", "Paris is in", "A city:")))
    task = {"task": "tiny_choice", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{question}}",
            "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}", "target_delimiter": "",
            "metric_list": [{"metric": "acc"}]}
    (tmp_path / "tiny_choice.yaml").write_text(yaml.safe_dump(task))
    results = report.empty_results()
    ec = EvalParams(lm_eval_tasks=[str(tmp_path / "tiny_choice.yaml"), "no_such_task"], lm_eval_limit=2)
    lm_harness.retention(results, "m", small_model(), tok, ec)
    scores = results["lm_eval"]["m"]["tiny_choice"]
    assert scores["sample_len"] == 2 and 0.0 <= scores["acc,none"] <= 1.0  # the limit holds
    assert list(results["lm_eval"]["m"]) == ["tiny_choice"]  # a task that fails has no score...
    [skip] = results["skipped"]  # ...but a reason
    assert skip["checkpoint"] == "m" and skip["task"] == "lm_eval:no_such_task" and "no_such_task" in skip["reason"]


def test_a_fox_checkpoint_scores_with_acp_and_records_what_it_skipped(small_project, tok, long_val, tmp_path):
    """eval.acp_eps: FoX through the 'fox' kernel (Triton's interpreter here) with ACP, the share of
    the prefill's tiles it skipped in the checkpoint's throughput; refused, naming the checkpoint,
    for a model ACP cannot prune."""
    with pytest.raises(ConfigError, match="eval.acp_eps: checkpoint base is not a FoX model"):
        suite.pruned(small_model(), 4.54e-5, "base")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=1024, d_model=64, n_layers=2, n_heads=4, ffn_dim=128, max_position_embeddings=256,
                      rope=None, fox=FoxConfig())
    fox = Transformer(cfg, attention_backend="reference").eval()
    with pytest.raises(ConfigError, match="checkpoint stage2 attends with 'reference' on cpu; ACP needs the 'fox'"):
        suite.pruned(fox, 4.54e-5, "stage2")
    assert suite.pruned(fox, None, "stage2").acp is None
    fox.attention_backend = "fox"
    assert suite.pruned(fox, 4.54e-5, "stage2").acp.eps == 4.54e-5
    ec = EvalParams(tasks=["passkey"], lengths=[256], samples=2, depths=[0.5], position_sequences=1,
                    needle_sequences=1, retention_sequences=1)
    results, plain = report.empty_results(), suite.Encoder(tok, chat=False)
    with suite.PromptBank((plain,), ec, tok.tok.decode(long_val[0].input_ids.tolist())) as bank:
        suite.evaluate(results, "stage2", fox, tmp_path, plain, ec, long_val, suite.Window(None), None, bank)
    assert 0 <= results["throughput"]["stage2"]["acp_pruned"] < 1


def test_evaluate_one_checkpoint(small_project, tok, long_val, tmp_path):
    model = small_model(256)
    short = PackedDataset(small_project / "data/packed/base/val")
    haystack = tok.tok.decode(long_val[0].input_ids.tolist())
    ec = EvalParams(tasks=["passkey", "niah_single_noise"], lengths=[256, 512], samples=1, depths=[0.5],
                    position_sequences=2, needle_sequences=2, retention_sequences=4)
    results = report.empty_results()
    plain, chat = suite.Encoder(tok, chat=False), suite.Encoder(tok, chat=True)
    with suite.PromptBank((plain, chat), ec, haystack) as bank:
        rows, curve = suite.evaluate(results, "base", model, tmp_path, plain, ec, long_val, suite.Window(256), short,
                                     bank)
        # an SFT checkpoint reads the same prompts (built once) through the chat template, still within each length
        chat_rows, _ = suite.evaluate(results, "sft", model, tmp_path, chat, ec, long_val, suite.Window(256), short,
                                      bank)
        assert [p.text() for p in bank.prompts(256)] == [p.text() for p in suite.build_prompts(
            plain, ec.tasks, [256], 1, [0.5], ec.seed, haystack, (chat,))]  # a length's alone, the same
    assert results["skipped"] == [] and results["windows"] == {"base": 256, "sft": 256}
    # also beyond the window (RoPE runs there), marked in the table
    assert [(r["task"], r["length"]) for r in rows] == [("passkey", 256), ("niah_single_noise", 256),
                                                         ("passkey", 512), ("niah_single_noise", 512)]
    assert [c.endswith(report.BEYOND) for c in report.comparison(results).splitlines()[2].split(" | ")[1:3]] == [
        False, True]
    assert "\n\\* beyond the checkpoint's window" in report.comparison(results)  # Markdown's *, not a bullet
    assert results["tasks"]["base"] == report.mean_scores(rows)
    assert results["throughput"]["base"]["prompts_per_s"] > 0 and results["throughput"]["base"]["tokens_per_s"] > 0
    assert list(results["ppl_by_length"]["base"]) == [256, 512, 2048]  # perplexity goes beyond the window
    assert curve[-1]["checkpoint"] == "base" and curve[-1]["position"] == 2047
    retention = suite.mean_loss(model, [short[i].input_ids for i in range(4)])
    assert results["retention_ppl"]["base"] == pytest.approx(needle.perplexity(retention))
    assert "lm_eval" not in results  # none asked for
    assert tok.chat_template
    assert [r["gold"] for r in chat_rows] == [r["gold"] for r in rows]
    assert all(r["prompt_tokens"] <= r["length"] for r in rows + chat_rows)
    assert [r["prompt_tokens"] for r in chat_rows] != [r["prompt_tokens"] for r in rows]
