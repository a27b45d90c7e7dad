"""Seeded, offline long-context tasks in the RULER / HELMET formats, built at a token length.

Every task returns `Prompt`s: a long context, a question after it, the text the answer starts
with, the gold answers and the metric of its source (metrics.py). `BUILDERS` is the one list of
tasks; config/schema.py names them in `EvalParams.TASKS` (it imports no eval code) and this module
checks on import that the two agree.
Lengths are in tokens of the evaluated model's tokenizer: the filler (noise sentences, real
validation text, JSON pairs, list words, demonstrations) grows until the prompt reaches it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from ..config import EvalParams, Params
from ..errors import ConfigError
from .metrics import METRICS

NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
WORDS = ["amber", "basin", "cedar", "delta", "ember", "fable", "garnet", "harbor", "iris", "jasper", "kelp",
         "lumen", "maple", "nectar", "onyx", "pebble", "quill", "raven", "sable", "thistle", "umber", "vale",
         "willow", "xenon", "yarrow", "zephyr", "acorn", "birch", "clover", "dune", "egret", "fjord", "grove",
         "heron", "inlet", "juniper", "knoll", "lotus", "marsh", "nimbus", "orchid", "prairie", "quartz",
         "ridge", "spruce", "tundra", "upland", "violet", "wren", "yew"]


@dataclass(frozen=True)
class Prompt:
    task: str
    length: int
    context: str
    question: str
    answer_prefix: str
    gold: list[str]
    metric: str
    max_new_tokens: int
    meta: dict = field(default_factory=dict)

    def text(self) -> str:
        """The prompt as a base model reads it."""
        return f"{self.context}\n\n{self.question}\n{self.answer_prefix}"


def score(prompt: Prompt, output: str) -> float:
    return METRICS[prompt.metric](prompt.gold, output)


# ---------------------------------------------------------------- filling to a token length


class TooShort(ValueError):
    """The length leaves no room for a prompt's filler: its fixed text alone takes `fixed` tokens."""

    def __init__(self, fixed: int):
        super().__init__(f"the fixed text takes {fixed} tokens")
        self.fixed = fixed


class Budget:
    """Counts tokens of text pieces with the model's tokenizer. `reserve` tokens are kept free
    for what wraps the prompt (BOS, chat markers, separators; tokens do not add up exactly
    across joins)."""

    def __init__(self, count: Callable[[str], int], length: int, reserve: int = 8):
        self.count, self.length, self.reserve = count, length, reserve
        self._seen: dict[bytes, int] = {}

    def tokens(self, text: str) -> int:
        """count(text), remembered by digest: the prompts of one length fill with the same filler
        (noise or haystack sentences), so their searches tokenize the same 64K-token texts again."""
        key = hashlib.blake2b(text.encode(), digest_size=16).digest()
        if (c := self._seen.get(key)) is None:
            c = self._seen[key] = self.count(text)
        return c

    def fill(self, fixed: str, pieces: Callable[[int], list[str]], start: int = 8) -> list[str]:
        """The most pieces (pieces(n) gives the first n) such that fixed + pieces fit the length.
        Tokens grow about linearly with pieces, so each guess aims at the room by the rate seen so
        far (a few tokenizer calls on 64K-token texts, where doubling then bisection took ~20);
        after four guesses inside the bracket it bisects, so it always ends."""
        room = self.length - self.reserve - self.tokens(fixed)
        if room <= 0:
            raise TooShort(self.tokens(fixed))
        lo, c_lo, hi, c_hi = 0, 0, None, 0
        n, guesses = start, 0
        while True:
            c = self.tokens("".join(pieces(n)))
            if c <= room:
                lo, c_lo = n, c
            else:
                hi, c_hi = n, c
            if hi is None:  # no bracket yet: grow toward the room, 5% past it
                if n >= 1_000_000:
                    break
                n = max(n + 1, n * 2 if c == 0 else int(n * room / c * 1.05) + 1)
                continue
            if hi - lo <= 1:
                break
            guesses += 1
            aim = lo + (room - c_lo) * (hi - lo) / max(c_hi - c_lo, 1) if guesses <= 4 else (lo + hi) / 2
            n = min(max(int(aim), lo + 1), hi - 1)
        return pieces(lo)


def _insert(sentences: list[str], inserts: list[str], depths: list[float]) -> str:
    out = list(sentences)
    for text, depth in sorted(zip(inserts, depths, strict=True), key=lambda x: -x[1]):
        out.insert(int(round(depth * len(out))), text)
    return "".join(out)


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?\n])", text) if s]


def _number(rng: np.random.Generator) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))


def _key(rng: np.random.Generator, taken: set[str]) -> str:
    while True:
        k = f"{WORDS[int(rng.integers(len(WORDS)))]}-{WORDS[int(rng.integers(len(WORDS)))]}"
        if k not in taken:
            taken.add(k)
            return k


# ---------------------------------------------------------------- NIAH family (RULER)


def niah(budget: Budget, rng: np.random.Generator, depth: float, haystack: str, *, keys: int = 1,
         values: int = 1, queries: int = 1, distractors: int = 0, name: str = "niah_single") -> Prompt:
    """Needles "One of the special magic numbers for {key} is: {value}." in a haystack of noise
    or real text; multi-key adds distractor needles, multi-value several values of one key,
    multi-query asks for several keys. The first needle sits at `depth`, others at random."""
    taken: set[str] = set()
    asked = [_key(rng, taken) for _ in range(max(keys, queries))]
    needles, gold = [], []
    for k in asked[:queries]:
        vals = [_number(rng) for _ in range(values)]
        gold += vals
        needles += [(k, v) for v in vals]
    needles += [(k, _number(rng)) for k in asked[queries:]]
    needles += [(_key(rng, taken), _number(rng)) for _ in range(distractors)]
    texts = [niah_needle(k, v) for k, v in needles]
    depths = [depth] + [float(rng.uniform(0, 1)) for _ in texts[1:]]
    question, prefix = niah_ask(asked[:queries], plural=values > 1 or queries > 1)
    fixed = "".join(texts) + question + prefix
    source = _sentences(haystack)
    sentences = budget.fill(fixed, lambda n: [source[i % len(source)] for i in range(n)])
    return Prompt(name, budget.length, _insert(sentences, texts, depths), question, prefix, gold, "all",
                  max_new_tokens=16 * len(gold), meta={"depth": depth})


def niah_needle(key: str, value: str) -> str:
    return f" One of the special magic numbers for {key} is: {value}. "


def niah_ask(keys: list[str], plural: bool = False) -> tuple[str, str]:
    """The NIAH question and the text the answer starts with (data/synthetic.py writes the same)."""
    which, noun = ", ".join(keys), "numbers" if plural else "number"
    return (f"What are all the special magic {noun} for {which} mentioned in the provided text?",
            f"The special magic {noun} for {which} mentioned in the provided text are")


def passkey_needle(key: str) -> str:
    return f" The pass key is {key}. Remember it. {key} is the pass key. "


PASSKEY_ASK = ("What is the pass key?", "The pass key is")


def passkey(budget: Budget, rng: np.random.Generator, depth: float) -> Prompt:
    key = str(int(rng.integers(10_000, 100_000)))
    needle = passkey_needle(key)
    question, prefix = PASSKEY_ASK
    sentences = budget.fill(needle + question + prefix, lambda n: [NOISE] * n)
    return Prompt("passkey", budget.length, _insert(sentences, [needle], [depth]), question, prefix, [key],
                  "substring", max_new_tokens=12, meta={"depth": depth})


def variable_tracking(budget: Budget, rng: np.random.Generator, hops: int = 4) -> Prompt:
    """RULER VT: "VAR A = 12345" then a chain "VAR B = VAR A" ... hidden in noise; every name
    bound to the value is gold."""
    value = str(int(rng.integers(10_000, 100_000)))
    names = ["".join(chr(int(c)) for c in rng.integers(65, 91, 5)) for _ in range(hops + 1)]
    lines = [f" VAR {names[0]} = {value}. "] + [f" VAR {names[i + 1]} = VAR {names[i]}. " for i in range(hops)]
    question = f"Find all variables that are assigned the value {value} in the text above."
    prefix = f"Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} variables are " \
             f"assigned the value {value}, they are:"
    sentences = budget.fill("".join(lines) + question + prefix, lambda n: [NOISE] * n)
    depths = sorted(float(x) for x in rng.uniform(0, 1, len(lines)))
    return Prompt("variable_tracking", budget.length, _insert(sentences, lines, depths), question, prefix, names,
                  "all", max_new_tokens=8 * len(names))


def common_words(budget: Budget, rng: np.random.Generator, top: int = 10) -> Prompt:
    """RULER CWE: a numbered word list where `top` words appear 30 times and the rest 3 times."""
    words = list(rng.permutation(WORDS))
    common, rare = words[:top], words[top:]
    question = f"What are the {top} most common words in the above list?"
    prefix = f"Answer: The top {top} words that appear most often in the list are:"

    def listing(n: int) -> list[str]:
        pool = [w for w in common for _ in range(30)] + [w for w in rare for _ in range(3)]
        pool = [pool[i % len(pool)] for i in range(n)]
        order = np.random.default_rng(n).permutation(n)
        return [f"{i + 1}. {pool[j]} " for i, j in enumerate(order)]

    items = budget.fill(question + prefix, listing)
    counts: dict[str, int] = {}
    for it in items:
        w = it.split(". ", 1)[1].strip()
        counts[w] = counts.get(w, 0) + 1
    gold = sorted(counts, key=lambda w: (-counts[w], w))[:top]
    return Prompt("common_words", budget.length, "".join(items), question, prefix, gold, "all",
                  max_new_tokens=6 * top)


def frequent_words(budget: Budget, rng: np.random.Generator, top: int = 3, alpha: float = 2.0) -> Prompt:
    """RULER FWE: synthetic words drawn from a Zipf law; the `top` most frequent are gold."""
    vocab = ["".join(chr(int(c)) for c in rng.integers(97, 123, 5)) for _ in range(400)]
    question = f"What are the {top} most frequently appeared coded words in the above coded text?"
    prefix = f"Answer: According to the coded text above, the {top} most frequently appeared words are:"
    draws = np.minimum(rng.zipf(alpha, 200_000) - 1, len(vocab) - 1)

    def text(n: int) -> list[str]:
        return [vocab[int(d)] + " " for d in draws[:n]]

    words = budget.fill(question + prefix, text, start=64)
    counts = np.bincount(draws[:len(words)], minlength=len(vocab))
    gold = [vocab[int(i)] for i in np.argsort(-counts, kind="stable")[:top]]
    return Prompt("frequent_words", budget.length, "... " + "".join(words), question, prefix, gold, "all",
                  max_new_tokens=8 * top)


# ---------------------------------------------------------------- HELMET synthetic


def json_kv(budget: Budget, rng: np.random.Generator, depth: float) -> Prompt:
    """HELMET JSON KV: uuid -> uuid pairs; the asked pair sits at `depth` of the object."""
    def uid() -> str:
        return str(uuid.UUID(int=int(rng.integers(0, 2**63)) << 64 | int(rng.integers(0, 2**63)), version=4))

    pairs = [(uid(), uid()) for _ in range(4096)]
    question_tpl = "Extract the value corresponding to the specified key in the JSON object below."
    fixed = question_tpl + "\n\nJSON data:\n" + f'Key: "{pairs[0][0]}"' + "Corresponding value:"

    def body(n: int) -> list[str]:
        return [json.dumps(dict(pairs[:n]), indent=1)]

    n = len(json.loads(budget.fill(fixed, body)[0] or "{}"))
    n = max(n, 1)
    at = min(n - 1, int(depth * n))
    key, value = pairs[at]
    context = f"{question_tpl}\n\nJSON data:\n{json.dumps(dict(pairs[:n]), indent=1)}"
    return Prompt("json_kv", budget.length, context, f"Key: \"{key}\"", "Corresponding value:", [value], "substring",
                  max_new_tokens=40, meta={"depth": depth, "pairs": n})


TOPICS = {
    "weather": ["rain", "cloud", "storm", "sunny", "wind", "forecast", "humid", "thunder", "snow", "breeze"],
    "cooking": ["bake", "oven", "recipe", "flour", "simmer", "spice", "knead", "roast", "garlic", "sauce"],
    "sports": ["goal", "match", "team", "score", "coach", "league", "referee", "sprint", "tackle", "season"],
    "finance": ["stock", "bond", "loan", "credit", "market", "yield", "budget", "invest", "asset", "bank"],
    "music": ["melody", "chord", "guitar", "tempo", "lyric", "drum", "album", "choir", "violin", "rhythm"],
}
FILLER = ["the", "a", "today", "we", "really", "about", "new", "this", "very", "some", "my", "our"]


def icl(budget: Budget, rng: np.random.Generator) -> Prompt:
    """HELMET-style ICL on a synthetic topic-classification source: class-balanced demos whose
    labels are replaced by random integers (per prompt), so only in-context mapping helps."""
    names = list(TOPICS)
    ids = [int(x) for x in rng.choice(100, size=len(names), replace=False)]

    def sentence(topic: str, r: np.random.Generator) -> str:
        words = list(r.choice(TOPICS[topic], 3)) + list(r.choice(FILLER, 4))
        return " ".join(r.permutation(words))

    test_topic = names[int(rng.integers(len(names)))]
    test = sentence(test_topic, rng)

    def demos(n: int) -> list[str]:
        r = np.random.default_rng(n + 7)
        order = [names[i % len(names)] for i in range(n)]  # class-balanced
        return [f"sentence: {sentence(t, r)}\nlabel: {ids[names.index(t)]}\n\n" for t in r.permutation(order)]

    question = f"sentence: {test}"
    intro = "Use the provided mapping from the sentence to label to assign a label.\n\n"
    shots = budget.fill(intro + question + "\nlabel:", demos)
    return Prompt("icl", budget.length, intro + "".join(shots), question, "label:",
                  [str(ids[names.index(test_topic)])], "accuracy", max_new_tokens=4, meta={"shots": len(shots)})


Builder = Callable[[Budget, np.random.Generator, float, str], Prompt]
"""(budget, rng, depth, a haystack of real text) -> one prompt at budget.length tokens."""

BUILDERS: dict[str, Builder] = {
    "niah_single_noise": lambda b, rng, d, text: niah(b, rng, d, NOISE, name="niah_single_noise"),
    "niah_single_text": lambda b, rng, d, text: niah(b, rng, d, text, name="niah_single_text"),
    "niah_multikey": lambda b, rng, d, text: niah(b, rng, d, text, keys=1, distractors=3, name="niah_multikey"),
    "niah_multivalue": lambda b, rng, d, text: niah(b, rng, d, text, values=4, name="niah_multivalue"),
    "niah_multiquery": lambda b, rng, d, text: niah(b, rng, d, text, queries=4, name="niah_multiquery"),
    "variable_tracking": lambda b, rng, d, text: variable_tracking(b, rng),
    "common_words": lambda b, rng, d, text: common_words(b, rng),
    "frequent_words": lambda b, rng, d, text: frequent_words(b, rng),
    "passkey": lambda b, rng, d, text: passkey(b, rng, d),
    "json_kv": lambda b, rng, d, text: json_kv(b, rng, d),
    "icl": lambda b, rng, d, text: icl(b, rng),
}
TASKS = tuple(BUILDERS)
"""In this order: a task's index seeds its prompts."""
assert TASKS == EvalParams.TASKS, f"eval.tasks builds {TASKS}, config's EvalParams.TASKS lists {EvalParams.TASKS}"

FAMILIES = {"retrieval (passkey, NIAH)": ("passkey", "niah_single_noise", "niah_single_text", "niah_multikey",
                                          "niah_multivalue", "niah_multiquery"),
            "tracing and aggregation (RULER)": ("variable_tracking", "common_words", "frequent_words"),
            "JSON KV (HELMET)": ("json_kv",), "in-context learning (HELMET)": ("icl",)}
"""The task families the comparison figure has one panel each for (RULER's and HELMET's groups)."""


TAUGHT_BY = {"passkey": ("passkey",),
             **{t: ("kv", "multikey", "multiquery") for t in FAMILIES["retrieval (passkey, NIAH)"][1:]}}
"""The synthetic training formats (data/synthetic.py) that write each task's prompt format: the
same needle, question and answer sentences. No synthetic document is in the format of the other
tasks (RULER's tracing and aggregation, JSON KV, ICL, HELMET's data)."""


def trained_formats(cfg: Params) -> list[str]:
    """The synthetic formats of the domains some packed split mixes in: what this run trains on."""
    mixed = {d for split in cfg.pack.splits for d, share in cfg.flat_mix(split).items() if share > 0}
    return sorted({f for d in mixed for s in cfg.corpora.domains[d].sources if s.synthetic
                   for f in s.synthetic.formats})


def held_out(task: str, formats: list[str]) -> bool:
    """Whether no training document of `formats` is in the task's prompt format."""
    return not set(TAUGHT_BY.get(task, ())) & set(formats)


def family(task: str) -> str:
    """The family a task is shown in; a HELMET data task (`helmet:<name>`) is its own family."""
    if task.startswith("helmet:"):
        return "HELMET data"
    return next(name for name, members in FAMILIES.items() if task in members)


def build(task: str, budget: Budget, rng: np.random.Generator, depth: float, text_haystack: str) -> Prompt:
    """One prompt of a task at budget.length tokens."""
    if task not in BUILDERS:
        raise ValueError(f"unknown task {task!r} (known: {TASKS})")
    with fitting(task, budget):
        return BUILDERS[task](budget, rng, depth, text_haystack)


@contextlib.contextmanager
def fitting(task: str, budget: Budget) -> Iterator[None]:
    """A prompt whose fixed text overflows its length, said as the eval.lengths error it is."""
    try:
        yield
    except TooShort as e:
        raise ConfigError(f"eval.lengths: {budget.length} tokens cannot hold a {task} prompt: its question, "
                          f"needles and answer prefix take {e.fixed} tokens and the template {budget.reserve}; "
                          "give longer lengths") from None
