"""HF checkpoints: small random HF models load into ours with the same logits, ours export to
directories `AutoModelForCausalLM` loads with the same logits, FoX round-trips natively."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from longctx.errors import DataError
from longctx.model.config import FoxConfig, ModelConfig, RopeConfig
from longctx.model.hf import load_hf, load_native, save_hf, save_native
from longctx.model.transformer import Transformer

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
                 "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.7 * i for i in range(8)]},
}


def hf_model(arch: str, rope: dict):
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "mistral": transformers.MistralConfig}[arch]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "mistral": transformers.MistralForCausalLM}[arch]
    extra = {"sliding_window": None} if arch in ("mistral", "qwen2") else {}
    cfg = config_cls(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                     rms_norm_eps=1e-5, rope_parameters=dict(rope), tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    return model_cls(cfg).float().eval()


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0]


@pytest.mark.parametrize("rope", list(ROPES))
def test_llama_checkpoints_import_with_equal_logits(tmp_path, rope):
    ref = hf_model("llama", ROPES[rope])
    ref.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    for length in (12, 40):  # inside and beyond the original window of 16
        ids = torch.randint(0, 101, (length,))
        with torch.no_grad():
            diff = (ours(ids) - hf_logits(ref, ids)).abs().max().item()
        assert diff <= 1e-4, (rope, length, diff)


def test_sharded_checkpoints_load(tmp_path):
    ref = hf_model("llama", ROPES["default"])
    ref.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_hf(tmp_path).eval()
    ids = torch.randint(0, 101, (20,))
    with torch.no_grad():
        assert (ours(ids) - hf_logits(ref, ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_each_architecture_imports_and_exports_as_itself(tmp_path, arch):
    """Qwen2 and Mistral come back out as Qwen2 and Mistral (Qwen2's q/k/v biases would make a
    Llama export expect an o_proj bias that does not exist), with every tensor loaded."""
    from transformers import AutoModelForCausalLM

    ref = hf_model(arch, ROPES["default"])
    ref.save_pretrained(tmp_path / "in")
    ours = load_hf(tmp_path / "in").eval()
    ids = torch.randint(0, 101, (20,))
    with torch.no_grad():
        assert (ours(ids) - hf_logits(ref, ids)).abs().max().item() <= 1e-4
    assert ours.cfg.attention_bias == (arch == "qwen2")
    save_hf(ours, tmp_path / "out")
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                      output_loading_info=True)
    assert type(back) is type(ref)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert (hf_logits(back.eval(), ids) - hf_logits(ref, ids)).abs().max().item() <= 1e-5


def test_qkv_biases_are_qwen2s_layout_alone():
    with pytest.raises(ValueError, match="attention_bias.*Qwen2's layout, not LlamaForCausalLM's"):
        ModelConfig(vocab_size=101, d_model=64, n_layers=2, n_heads=4, ffn_dim=96, attention_bias=True)


@pytest.mark.parametrize("rope", [
    RopeConfig(),
    RopeConfig(theta=8e6),  # ProLong's base change
    RopeConfig(type="yarn", factor=4.0, original_max_position_embeddings=16),
    RopeConfig(type="llama3", theta=500000.0, factor=8.0, original_max_position_embeddings=16),
    RopeConfig(type="dynamic", factor=2.0),
    RopeConfig(type="linear", factor=2.0),
    RopeConfig(type="longrope", original_max_position_embeddings=16, short_factor=[1.0] * 8, long_factor=[3.0] * 8),
])
def test_export_loads_in_transformers_with_equal_logits(tmp_path, rope):
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig(vocab_size=101, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                      max_position_embeddings=64, rope=rope)
    torch.manual_seed(0)
    ours = Transformer(cfg).eval()
    save_hf(ours, tmp_path, shard_bytes=50_000)  # sharded, with an index, as large models are
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 101, (40,))
    with torch.no_grad():
        assert (ours(ids) - hf_logits(ref, ids)).abs().max().item() <= 1e-4


def test_export_carries_the_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from longctx.config import BPEParams
    from longctx.data.tokenizer import TextTokenizer

    tok = TextTokenizer.train(["def f(x):\n    return x + 1\n"] * 50, BPEParams(vocab_size=300, min_frequency=1))
    tok.save(tmp_path / "tok")
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=4, ffn_dim=48)
    save_hf(Transformer(cfg), tmp_path / "hf", tokenizer_dir=tmp_path / "tok")
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok("return x")["input_ids"] == tok.encode_texts(["return x"], False, False)[0].tolist()
    assert hf_tok.eos_token == "<|eos|>"


def test_fox_round_trips_natively(tmp_path):
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, ffn_dim=48, rope=None, fox=FoxConfig())
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    save_native(model, tmp_path)
    again = load_native(tmp_path).eval()
    ids = torch.randint(0, 50, (17,))
    with torch.no_grad():
        assert torch.equal(model(ids), again(ids))
    with pytest.raises(ValueError, match="no HF architecture"):
        save_hf(model, tmp_path / "hf")


def test_native_checkpoints_are_checked_against_their_weights_digests(tmp_path):
    """Each weights file's size and SHA-256, recorded at save (every shard) and checked at load: a
    byte changed in place, a shard gone, a malformed record; the committed tiny base carries them."""
    import shutil

    from longctx.model.hf import native_config

    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, ffn_dim=48)
    save_native(Transformer(cfg), tmp_path / "one")
    save_native(Transformer(cfg), tmp_path / "sharded", shard_bytes=20_000)
    recorded = json.loads((tmp_path / "sharded/longctx_config.json").read_text())["weights"]
    shards = sorted(f.name for f in (tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 2 and sorted(recorded) == shards
    weights = tmp_path / "one/model.safetensors"
    assert json.loads((tmp_path / "one/longctx_config.json").read_text())["weights"]["model.safetensors"]["bytes"] \
        == weights.stat().st_size
    load_native(tmp_path / "one")
    data = bytearray(weights.read_bytes())
    data[-100] ^= 1  # one bit of the last tensor: safetensors still reads it
    weights.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"one/model\.safetensors: its SHA-256 is [0-9a-f]{12}\.\.\., [0-9a-f]{12}"):
        load_native(tmp_path / "one")
    assert native_config(tmp_path / "one") == cfg  # the config alone reads no weights
    (tmp_path / "sharded" / shards[1]).unlink()
    with pytest.raises(DataError, match=rf"sharded/{shards[1]}: missing"):
        load_native(tmp_path / "sharded")
    config = tmp_path / "sharded/longctx_config.json"
    config.write_text(json.dumps(dict(json.loads(config.read_text()), weights={shards[0]: "abc"})))
    with pytest.raises(DataError, match=r"longctx_config\.json: weights: .* bytes and sha256 expected"):
        load_native(tmp_path / "sharded")
    base = tmp_path / "tiny-base"
    shutil.copytree(Path(__file__).parents[1] / "checkpoints/tiny-base", base)
    load_native(base)
    data = bytearray((base / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (base / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(DataError, match="the file is corrupt or was replaced"):
        load_native(base)


def test_bad_checkpoints_name_the_problem(tmp_path):
    ref = hf_model("llama", ROPES["default"])
    ref.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    bad = dict(cfg, intermediate_size=128)
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(DataError, match=r"tensor layers\.0\.mlp\.(down|gate|up)_proj\.weight has shape"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, architectures=["GPT2LMHeadModel"])))
    with pytest.raises(DataError, match="architectures: 'GPT2LMHeadModel' is not supported"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(DataError, match="no model.safetensors"):
        load_hf(tmp_path)


def test_a_corrupt_hf_config_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64,}')
    with pytest.raises(DataError, match=r"config\.json: the model's config is corrupt: Expecting property name"):
        load_hf(tmp_path)


def test_an_export_over_an_earlier_one_leaves_nothing_of_it(tmp_path):
    """A sharded export then a single-file one into the same folder (and the other way round):
    no stale index or shard for load_hf or transformers to mix in; a user's own files stay."""
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig(vocab_size=101, d_model=64, n_layers=2, n_heads=4, ffn_dim=96, max_position_embeddings=64)
    first, second = (Transformer(cfg).eval() for _ in range(2))
    torch.manual_seed(1)
    second.reset_parameters()
    out = tmp_path / "export"
    out.mkdir()
    (out / "NOTES.md").write_text("my notes")
    (out / "runs").mkdir()
    (out / "runs" / "log.txt").write_text("kept")
    ids = torch.randint(0, 101, (20,))
    for a, b, shard_bytes in ((first, second, 50_000), (second, first, None)):
        save_hf(a, out, **({"shard_bytes": shard_bytes} if shard_bytes else {}))
        save_hf(b, out, **({} if shard_bytes else {"shard_bytes": 50_000}))
        with torch.no_grad():
            want = b(ids)
            assert torch.equal(load_hf(out).eval()(ids), want)
            ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
            assert (hf_logits(ref, ids) - want).abs().max().item() <= 1e-4
        sharded = (out / "model.safetensors.index.json").is_file()
        assert sharded == (shard_bytes is None) and (out / "model.safetensors").is_file() != sharded
        assert (out / "NOTES.md").read_text() == "my notes" and (out / "runs" / "log.txt").read_text() == "kept"
