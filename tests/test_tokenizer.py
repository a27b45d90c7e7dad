"""Tokenizers: training, HF-compatible directories, chat masks, id dtypes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from longctx.config import BPEParams, TokenizeParams, TokenizerParams
from longctx.data import builtin
from longctx.data.shards import ShardReader
from longctx.data.tokenize import tokenize_domains
from longctx.data.tokenizer import TextTokenizer
from longctx.errors import ConfigError, DataError

LLAMA3_STYLE = (
    "{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What does `json.dumps` do?"},
    {"role": "assistant", "content": "Serialize ``obj`` to a JSON formatted ``str``."},
    {"role": "user", "content": "And its signature?"},
    {"role": "assistant", "content": "`json.dumps(obj, *, skipkeys=False)`"},
]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return [text for _, (_, text) in zip(range(40), builtin.short_modules(), strict=False)]


@pytest.fixture(scope="module")
def trained(corpus) -> TextTokenizer:
    return TextTokenizer.train(corpus, BPEParams(vocab_size=1000, min_frequency=2))


def test_training_is_deterministic_and_round_trips(corpus, trained):
    again = TextTokenizer.train(corpus, BPEParams(vocab_size=1000, min_frequency=2))
    assert again.tok.to_str() == trained.tok.to_str() and again.fingerprint == trained.fingerprint
    assert trained.vocab_size == 1000
    text = corpus[3][:2000]
    ids = trained.encode_texts([text], add_bos=True, add_eos=True)[0]
    assert ids[0] == trained.tok.token_to_id("<|bos|>") and ids[-1] == trained.tok.token_to_id("<|eos|>")
    assert trained.tok.decode(ids[1:-1].tolist()) == text


def test_saved_directory_loads_in_transformers(tmp_path, trained):
    from transformers import AutoTokenizer

    trained.save(tmp_path / "tok")
    hf = AutoTokenizer.from_pretrained(tmp_path / "tok")
    text = "def add(a, b):\n    return a + b\n"
    assert hf(text, add_special_tokens=False)["input_ids"] == trained.encode_texts([text], False, False)[0].tolist()
    rendered, _ = trained.render_chat(CHAT)
    assert hf.apply_chat_template(CHAT, tokenize=False) == rendered
    assert TextTokenizer.load(tmp_path / "tok").fingerprint == trained.fingerprint


def test_split_digits_gives_every_digit_its_own_token(tmp_path, corpus):
    """Numbers copy digit by digit (the retrieval tasks' answers); without the switch the same
    corpus, numbers added, merges digit groups. Saved, transformers splits them alike."""
    from transformers import AutoTokenizer

    numbers = [" ".join(str(n) for n in range(i * 997, i * 997 + 3000, 7)) for i in range(20)]
    grouped = TextTokenizer.train(corpus + numbers, BPEParams(vocab_size=1000))
    split = TextTokenizer.train(corpus + numbers, BPEParams(vocab_size=1000, split_digits=True))
    text = "The pass key is 4475102. Remember it: 4475102 in 2026."
    digits = sum(c.isdigit() for c in text)
    pieces = [split.tok.decode([i]) for i in split.encode_texts([text], False, False)[0].tolist()]
    assert sum(p.strip().isdigit() for p in pieces) == digits and all(len(p.strip()) <= 1 or not
                                                                       p.strip().isdigit() for p in pieces)
    assert split.tok.decode(split.encode_texts([text], False, False)[0].tolist()) == text
    assert len(grouped.encode_texts([text], False, False)[0]) < len(pieces)
    split.save(tmp_path / "tok")
    hf = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert hf(text, add_special_tokens=False)["input_ids"] == split.encode_texts([text], False, False)[0].tolist()


def _mask_text(tt: TextTokenizer, messages) -> str:
    ids, mask = tt.encode_chats([messages])[0]
    return tt.tok.decode(ids[mask.astype(bool)].tolist(), skip_special_tokens=False)


def test_masks_cover_exactly_the_assistant_turns(trained):
    assert _mask_text(trained, CHAT) == "".join(f"{m['content']}<|end|>\n" for m in CHAT if m["role"] == "assistant")


def test_masks_with_a_llama3_style_template(corpus):
    cfg = BPEParams(vocab_size=1000, min_frequency=2)
    tt = TextTokenizer.train(corpus, cfg)
    tt.tok.add_special_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    tt.bos_token, tt.chat_template = "<|begin_of_text|>", LLAMA3_STYLE
    assert _mask_text(tt, CHAT) == "".join(f"{m['content']}<|eot_id|>" for m in CHAT if m["role"] == "assistant")
    ids, mask = tt.encode_chats([CHAT])[0]
    assert ids[0] == tt.tok.token_to_id("<|begin_of_text|>") and mask[0] == 0


def test_a_template_that_rewrites_history_is_refused(trained):
    trained_copy = TextTokenizer(trained.tok, trained.bos_token, trained.eos_token,
                                 "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ messages | length }}")
    with pytest.raises(DataError, match="renders prefixes inconsistently"):
        trained_copy.render_chat(CHAT)


def test_broken_tokenizer_directories(tmp_path):
    with pytest.raises(DataError, match="tokenizer.json: not found"):
        TextTokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="not a valid tokenizers file"):
        TextTokenizer.load(tmp_path)
    with pytest.raises(ConfigError, match="is not a tokenizer directory"):
        TextTokenizer.from_spec(TokenizerParams(path=str(tmp_path / "a" / "b" / "c")))


def _wordlevel_dir(folder: Path, size: int) -> Path:
    vocab = {f"w{i}": i for i in range(size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "w1", "eos_token": "w2"}))
    return folder


def test_vocab_too_large_for_uint16(tmp_path):
    tt = TextTokenizer.from_spec(TokenizerParams(path=str(_wordlevel_dir(tmp_path / "big", 70_000))))
    corpora_dir = tmp_path / "corpora"
    corpora_dir.mkdir()
    texts = ["w5 w69999 w123 " * 20, "w65536 w3"]
    pq.write_table(pa.table({"id": ["a", "b"], "text": texts}), corpora_dir / "web.parquet")
    tt.save(tmp_path / "out" / "tokenizer")
    spec = {"tokenizer": {"path": "x"}, "long_min_tokens": 1, "num_workers": 0}
    with pytest.raises(ConfigError, match="tokenize.dtype: uint16 cannot hold ids of a vocabulary of 70000"):
        tokenize_domains(TokenizeParams(**spec, dtype="uint16"), {"web": "short"}, corpora_dir, tmp_path / "out", tt)
    report, _ = tokenize_domains(TokenizeParams(**spec), {"web": "short"}, corpora_dir, tmp_path / "out", tt)
    reader = ShardReader(tmp_path / "out" / "web")
    assert reader.dtype == np.uint32
    assert reader.tokens(1).tolist() == [1, 65536, 3, 2]
    assert 69999 in reader.tokens(0).tolist()
    assert report["web"]["kept_docs"] == 2


def test_worker_processes_give_the_same_shards(tmp_path, trained):
    corpora_dir = tmp_path / "corpora"
    corpora_dir.mkdir()
    texts = [text for _, (_, text) in zip(range(30), builtin.short_modules(), strict=False)]
    pq.write_table(pa.table({"id": [str(i) for i in range(30)], "text": texts}), corpora_dir / "web.parquet")
    outs = {}
    for workers in (0, 2):
        out = tmp_path / f"out{workers}"
        trained.save(out / "tokenizer")
        cfg = TokenizeParams(tokenizer={"path": "x"}, long_min_tokens=1000, num_workers=workers, batch_size=4,
                             shard_tokens=20_000)
        tokenize_domains(cfg, {"web": "long"}, corpora_dir, out, trained)
        outs[workers] = {p.name: p.read_bytes() for p in (out / "web").iterdir() if p.name != "index.json"}
        reader = ShardReader(out / "web")
        assert (reader.docs["length"] >= 1000).all()  # the long-data length filter
        assert len(reader.index["shards"]) > 1
    assert outs[0] == outs[2]
