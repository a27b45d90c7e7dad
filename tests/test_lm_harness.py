"""The lm-eval-harness adapter on a small local multiple-choice task the test writes: the
harness's accuracy is the one our own log-likelihoods give."""

from __future__ import annotations

import json

import torch

from longctx.data.tokenizer import TextTokenizer
from longctx.eval.lm_harness import LongctxLM, evaluate
from longctx.model.config import ModelConfig, RopeConfig
from longctx.model.transformer import Transformer

QUESTIONS = [
    ("The capital of France is", [" Paris", " a banana", " seven"], 0),
    ("def add(a, b): return", [" a + b", " import os", " ]]"], 0),
    ("for i in range(10):", ["\n    print(i)", " ))", " the cat"], 0),
    ("Water boils at 100 degrees", [" Celsius", " def", " return"], 0),
    ("import numpy as", [" np", " the", " class"], 0),
    ("class Foo:", ["\n    pass", " 42", " yes"], 0),
]


def test_harness_accuracy_matches_our_loglikelihoods(small_project, tmp_path):
    tok = TextTokenizer.load(small_project / "data/tokens/tokenizer")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=1024, d_model=64, n_layers=2, n_heads=4, ffn_dim=128,
                                    max_position_embeddings=256, rope=RopeConfig(theta=10000.0)), "sdpa").eval()
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (tmp_path / "tiny_choice.yaml").write_text(f"""task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
""")
    results = evaluate(model, tok, ["tiny_choice"], include_path=str(tmp_path))
    lm = LongctxLM(model, tok)

    class Req:
        def __init__(self, *args):
            self.args = args

    expected = 0
    for q, choices, answer in QUESTIONS:
        scores = [s for s, _ in lm.loglikelihood([Req(q, c) for c in choices], disable_tqdm=True)]
        expected += int(max(range(len(choices)), key=lambda i: scores[i]) == answer)
        # a log-likelihood is a sum of log-probabilities: negative, finite
        assert all(s < 0 for s in scores)
    assert results["tiny_choice"]["acc,none"] == expected / len(QUESTIONS)
