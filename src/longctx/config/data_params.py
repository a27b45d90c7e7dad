"""The data sections of the params: corpora (domains and their sources), tokenize, pack (splits
and their mixes)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from .base import Strict

# ---------------------------------------------------------------- corpora

BuiltinName = Literal["stdlib_repos", "stdlib_books", "stdlib_short", "stdlib_sft"]


class SyntheticParams(Strict):
    """Generated retrieval documents (data/synthetic.py), each ending with its question and
    answer; lengths log-uniform between the bounds, in characters (the tokenizer is trained
    after the corpora)."""

    formats: list[Literal["passkey", "kv", "multikey", "multiquery"]] = Field(
        default_factory=lambda: ["passkey", "kv", "multikey"], min_length=1)
    min_chars: PositiveInt = 1000
    max_chars: PositiveInt = 30000

    @model_validator(mode="after")
    def _ordered(self) -> SyntheticParams:
        if self.min_chars > self.max_chars:
            raise ValueError(f"min_chars {self.min_chars} is above max_chars {self.max_chars}")
        return self


class SourceParams(Strict):
    """Where one stream of documents comes from: exactly one of path, hub, builtin, synthetic."""

    path: str | None = None
    """Local file or directory of .txt/.md (one document per file), .jsonl or .parquet."""
    hub: str | None = None
    """A `datasets` hub id (or a local dataset directory), read with streaming."""
    builtin: BuiltinName | None = None
    """Real text every Python install has (the offline `tiny` profile)."""
    synthetic: SyntheticParams | None = None
    """Generated retrieval documents (needs max_docs or max_bytes: the stream does not end)."""
    name: str | None = None
    split: str = "train"
    text_field: str = "text"
    messages_field: str = "messages"
    """Column with UltraChat-style messages: kept for sft domains, rendered as text otherwise."""
    filter: dict[str, str] = Field(default_factory=dict)
    """Hub rows are kept only where each dotted field equals the value."""
    group_by: str | None = None
    """Concatenate consecutive rows sharing this field into one document (repo-level code)."""
    header_field: str | None = None
    """With group_by: a field (e.g. the file path) written as a header before each row."""
    part: str | None = None
    """Builtin only: which slice of the builtin text (e.g. stdlib_short: docstrings|modules|topics)."""
    max_docs: PositiveInt | None = None
    max_bytes: PositiveInt | None = None
    doc_max_bytes: PositiveInt | None = None
    """Each text document cut to its first this many bytes: one huge document (site-packages'
    torch, ~90 MB) would otherwise hold up the tokenize stage alone. A repository's files are
    shuffled, so the cut keeps a random sample of them."""
    site_packages: bool = False
    """stdlib_repos: also read installed third-party packages as repositories."""

    @model_validator(mode="after")
    def _one_origin(self) -> SourceParams:
        given = [k for k in ("path", "hub", "builtin", "synthetic") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of path, hub, builtin, synthetic (got {given or 'none'})")
        if self.synthetic is not None and self.max_docs is None and self.max_bytes is None:
            raise ValueError("a synthetic source needs max_docs or max_bytes (it generates without end)")
        if self.header_field and not self.group_by:
            raise ValueError("header_field needs group_by")
        if self.hub is None and (self.filter or self.group_by or self.name):
            raise ValueError("filter, group_by and name apply to hub sources only")
        if self.builtin is None and (self.part or self.site_packages):
            raise ValueError("part and site_packages apply to builtin sources only")
        return self


class DomainParams(Strict):
    kind: Literal["long", "short", "whole", "sft"]
    """long: filtered by length and cut into single-document chunks; short: packed with
    carry-over; whole: packed without cutting a document across chunks (retrieval documents keep
    their questions with their needles); sft: conversations packed with an assistant-only loss
    mask."""
    sources: list[SourceParams] = Field(min_length=1)


class CorporaParams(Strict):
    seed: int = 0
    invalid_utf8: Literal["replace", "reject"] = "replace"
    """Local files with bytes that are not UTF-8: replace them with U+FFFD (counted in the
    manifest) or reject the file."""
    domains: dict[str, DomainParams] = Field(min_length=1)
    num_workers: NonNegativeInt = 1
    """Domains collected side by side in worker processes (1: one after another in the stage's
    process). The output does not depend on it: each domain's documents are seeded on their own."""


# ---------------------------------------------------------------- tokenize


class BPEParams(Strict):
    vocab_size: int = Field(ge=300, le=1 << 20)
    min_frequency: PositiveInt = 2
    sample_bytes: PositiveInt = 20_000_000
    """Bytes of text (spread over domains) the tokenizer is trained on."""
    split_digits: bool = False
    """Every digit its own token, as Llama's tokenizer has them: a BPE trained on retrieval
    documents otherwise learns thousands of digit groups, and a model must learn to copy each."""


class TokenizerParams(Strict):
    path: str | None = None
    """A tokenizer directory (tokenizer.json [+ tokenizer_config.json]) or a hub model id."""
    train: BPEParams | None = None
    """Train a byte-level BPE on the corpus instead."""
    chat_template: str | None = None
    """Jinja chat template; overrides the tokenizer's own."""

    @model_validator(mode="after")
    def _one(self) -> TokenizerParams:
        if (self.path is None) == (self.train is None):
            raise ValueError("give exactly one of path, train")
        return self


class TokenizeParams(Strict):
    tokenizer: TokenizerParams
    dtype: Literal["auto", "uint16", "uint32"] = "auto"
    add_bos: bool = True
    add_eos: bool = True
    long_min_tokens: PositiveInt
    """Documents of long-data domains shorter than this are dropped."""
    batch_size: PositiveInt = 512
    num_workers: NonNegativeInt = 2
    """Encoding processes; 0 encodes in the stage's own process."""
    shard_tokens: PositiveInt = 1 << 28


# ---------------------------------------------------------------- pack


class SplitParams(Strict):
    seq_len: PositiveInt
    chunk_len: PositiveInt | None = None
    """Length at which short and SFT data are packed and long documents are cut, unless
    `lengths` says otherwise; several chunks fill one sequence. Default: seq_len."""
    tokens: PositiveInt | None = None
    """Training tokens; null takes as many as the data allows at the requested mix."""
    mix: dict[str, float] = Field(min_length=1)
    """Domain or group name -> share of tokens."""
    lengths: dict[str, dict[int, float]] = Field(default_factory=dict)
    """Long domain -> {chunk length: share of that domain's tokens} (ProLong's stage 2)."""

    @property
    def base_len(self) -> int:
        return self.chunk_len or self.seq_len


class PackParams(Strict):
    seed: int = 0
    val_fraction: float = Field(default=0.05, gt=0, lt=1)
    """Share of each domain's documents held out (chosen by a hash of the document id)."""
    tolerance: float = Field(default=0.05, gt=0, lt=1)
    """Largest allowed gap between achieved and requested share of any domain."""
    groups: dict[str, dict[str, float]] = Field(default_factory=dict)
    """Named sub-mixes (ProLong's ShortMix): group -> {domain: share}."""
    splits: dict[str, SplitParams] = Field(min_length=1)
