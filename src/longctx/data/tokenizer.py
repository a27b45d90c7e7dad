"""HF `tokenizers` tokenizers: load the base model's, or train a byte-level BPE; chat rendering
with assistant-token masks.

A tokenizer lives in a directory in HF's layout (tokenizer.json + tokenizer_config.json with
bos/eos tokens and the chat template), so `transformers.AutoTokenizer` loads what we write.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..config import BPEParams, TokenizerParams
from ..errors import ConfigError, DataError

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


@dataclass
class TextTokenizer:
    tok: Tokenizer
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None
    source: Path | None = None
    """The directory it was loaded from, whose files `save` copies verbatim."""

    # ------------------------------------------------------------ construction

    @classmethod
    def load(cls, folder: str | Path) -> TextTokenizer:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"{path}: not found (a tokenizer directory needs tokenizer.json)")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:
            raise DataError(f"{path}: not a valid tokenizers file: {e}") from None
        cfg = {}
        if (folder / "tokenizer_config.json").is_file():
            try:
                cfg = json.loads((folder / "tokenizer_config.json").read_text())
            except json.JSONDecodeError as e:
                raise DataError(f"{folder / 'tokenizer_config.json'}: corrupt JSON: {e}") from None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        return cls(tok, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")), template, folder)

    @classmethod
    def from_spec(cls, spec: TokenizerParams, corpus: Iterable[str] | None = None) -> TextTokenizer:
        if spec.train is not None:
            if corpus is None:
                raise ValueError("training a tokenizer needs a corpus")
            tt = cls.train(corpus, spec.train)
        else:
            tt = cls.load(_fetch(spec.path))
        if spec.chat_template is not None:
            tt.chat_template = spec.chat_template
        return tt

    @classmethod
    def train(cls, corpus: Iterable[str], cfg: BPEParams) -> TextTokenizer:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        if cfg.split_digits:
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         tok.pre_tokenizer])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=cfg.vocab_size,
            min_frequency=cfg.min_frequency,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(corpus, trainer)
        return cls(tok, "<|bos|>", "<|eos|>", TINY_CHAT_TEMPLATE)

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if self.source is not None:
            for name in FILES:
                if (self.source / name).is_file():
                    shutil.copy2(self.source / name, folder / name)
            if self.chat_template != TextTokenizer.load(folder).chat_template:
                (folder / "chat_template.jinja").unlink(missing_ok=True)
                cfg = json.loads((folder / "tokenizer_config.json").read_text()) if (
                    folder / "tokenizer_config.json").is_file() else {}
                cfg["chat_template"] = self.chat_template
                (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            return
        self.tok.save(str(folder / "tokenizer.json"))
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": "<|pad|>" if self.tok.token_to_id("<|pad|>") is not None else self.eos_token,
            "chat_template": self.chat_template,
            "clean_up_tokenization_spaces": False,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    # ------------------------------------------------------------ facts

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        i = self.tok.token_to_id(token)
        if i is None:
            raise DataError(f"tokenizer: {what} token {token!r} is not in the vocabulary")
        return i

    @property
    def fingerprint(self) -> str:
        """Changes whenever anything that decides token ids changes."""
        h = hashlib.sha256(self.tok.to_str().encode())
        for part in (self.bos_token, self.eos_token, self.chat_template):
            h.update(b"\0" + (part or "").encode())
        return h.hexdigest()[:16]

    # ------------------------------------------------------------ encoding

    def encode_texts(self, texts: list[str], add_bos: bool, add_eos: bool) -> list[np.ndarray]:
        bos = self.token_id(self.bos_token, "bos") if add_bos else None
        eos = self.token_id(self.eos_token, "eos") if add_eos else None
        out = []
        for enc in self.tok.encode_batch_fast(texts, add_special_tokens=False):
            ids = enc.ids
            if bos is not None:
                ids = [bos, *ids]
            if eos is not None:
                ids.append(eos)
            out.append(np.asarray(ids, dtype=np.uint32))
        return out

    def render_chat(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation as text, and the character spans of the assistant turns.

        Each assistant span runs from the end of the prompt that asks for it (the template with
        add_generation_prompt) to the end of the template with the turn included, so it holds the
        reply and its end-of-turn marker: what the model must learn to produce.
        """
        if not self.chat_template:
            raise DataError("tokenizer has no chat template (set tokenize.tokenizer.chat_template)")
        full = self._render(messages, False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(self._render(messages[:i], True))
            after = self._render(messages[: i + 1], False)
            if not full.startswith(after) or start > len(after):
                raise DataError("chat template renders prefixes inconsistently; cannot locate assistant turns")
            spans.append((start, len(after)))
        return full, spans

    def chat_prompt(self, user: str) -> str:
        """One user turn rendered with the template, ending where the assistant's reply starts."""
        if not self.chat_template:
            raise DataError("tokenizer has no chat template (set tokenize.tokenizer.chat_template)")
        return self._render([{"role": "user", "content": user}], True)

    def encode_chats(self, conversations: list[list[dict[str, str]]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, loss mask) per conversation; mask is 1 on assistant tokens only."""
        rendered = [self.render_chat(c) for c in conversations]
        encs = self.tok.encode_batch([r[0] for r in rendered], add_special_tokens=False)
        out = []
        for (_, spans), enc in zip(rendered, encs, strict=True):
            starts = np.fromiter((o[0] for o in enc.offsets), dtype=np.int64, count=len(enc.offsets))
            mask = np.zeros(len(starts), dtype=np.uint8)
            for s, e in spans:
                mask[(starts >= s) & (starts < e)] = 1
            out.append((np.asarray(enc.ids, dtype=np.uint32), mask))
        return out

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            return _template(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as e:
            raise DataError(f"chat template failed: {e}") from None


_TEMPLATES: dict[str, object] = {}


def _template(source: str):
    if source not in _TEMPLATES:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str):
            raise TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]


def _fetch(path: str) -> Path:
    """A local tokenizer directory as is; otherwise a hub model id, downloaded (tokenizer files only)."""
    local = Path(path)
    if local.is_dir():
        return local
    if local.exists() or path.startswith((".", "/")) or path.count("/") > 1:
        raise ConfigError(f"tokenize.tokenizer.path: {path} is not a tokenizer directory")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=path, allow_patterns=list(FILES)))
    except Exception as e:
        raise DataError(f"tokenize.tokenizer.path: {path!r} is not a local directory and could not be "
                        f"downloaded from the hub: {type(e).__name__}: {e}") from None

