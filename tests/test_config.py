"""Params: profiles resolve, and every kind of bad value fails naming its key."""

from __future__ import annotations

import time

import pytest

from longctx import config
from longctx.errors import ConfigError


@pytest.mark.parametrize("profile", ["tiny", "tiny-scratch", "gpu-64k", "prolong-64k", "prolong-512k"])
def test_profiles_resolve(profile):
    cfg = config.resolve({"profile": profile})
    assert cfg.profile == profile
    for split in cfg.pack.splits:
        assert abs(sum(cfg.flat_mix(split).values()) - 1) < 1e-9


def test_prolong_mix_is_table_9():
    cfg = config.resolve({"profile": "prolong-512k"})
    mix = cfg.flat_mix("stage1")
    assert mix["code_repos"] == pytest.approx(0.30) and mix["books"] == pytest.approx(0.30)
    assert mix["textbooks"] == pytest.approx(0.03)
    assert mix["fineweb_edu"] == pytest.approx(0.37 * 0.27)
    assert mix["arxiv"] == pytest.approx(0.37 * 0.08)
    assert cfg.chunk_lengths("stage2", "code_repos") == {524288: 0.5, 65536: 0.5}
    assert cfg.chunk_lengths("stage2", "books") == {524288: 0.17, 65536: 0.83}
    assert cfg.chunk_lengths("stage2", "textbooks") == {524288: 1.0}
    assert cfg.chunk_lengths("stage2", "fineweb") == {65536: 1.0}
    assert cfg.pack.splits["stage2"].seq_len == 524288
    assert cfg.tokenize.long_min_tokens == 65536


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tokenize": {"bogus": 1}}, r"tokenize\.bogus: unknown key"),
        ({"pack": {"seed": "x"}}, r"pack\.seed: .*integer"),
        ({"pack": {"splits": {"stage1": {"mix": {"books": 0.4}}}}}, r"pack\.splits\.stage1\.mix: shares sum to 1\.2"),
        ({"pack": {"splits": {"stage1": {"seq_len": 0}}}}, r"pack\.splits\.stage1\.seq_len: .*greater than 0"),
        ({"pack": {"splits": {"stage1": {"tokens": -5}}}}, r"pack\.splits\.stage1\.tokens"),
        ({"tokenize": {"long_min_tokens": 4096}}, r"tokenize\.long_min_tokens: 4096 is above the chunk length 2048"),
        ({"pack": {"splits": {"stage2": {"chunk_len": 3000}}}}, r"pack\.splits\.stage2\.chunk_len: 3000 must divide"),
        ({"pack": {"splits": {"stage2": {"lengths": {"books": {8192: None, 3000: 0.17}}}}}},
         r"pack\.splits\.stage2\.lengths\.books\.3000: must .*divide"),
        ({"pack": {"splits": {"stage1": {"mix": {"nope": 0.0}}}}}, r"share must be a positive number"),
        ({"pack": {"splits": {"sft": {"mix": {"chat": 0.5, "books": 0.5, "retrieval_long": None}}}}},
         r"sft domains mix with whole documents only .* not \['long'\]"),
        ({"pack": {"groups": {"shortmix": {"docstrings": 0.5, "modules": 0.6}}}},
         r"pack\.groups\.shortmix: shares sum"),
        ({"pack": {"val_fraction": 1.5}}, r"pack\.val_fraction"),
        ({"corpora": {"domains": {"books": {"sources": [{"path": "x", "hub": "y"}]}}}},
         r"exactly one of path, hub, builtin"),
        ({"corpora": {"domains": {"books": {"kind": "medium"}}}}, r"corpora\.domains\.books\.kind"),
        ({"tokenize": {"tokenizer": {"path": "some/dir"}}}, r"exactly one of path, train"),
        ({"corpora": {"domains": {"books": {"sources": [{"path": "x", "group_by": "repo"}]}}}},
         r"corpora\.domains\.books\.sources\.0: .*hub sources only"),
        ({"profile": "huge"}, r"unknown profile 'huge'"),
        ({"train": {"base": None}}, r"train\.pretrain\.init: 'base' needs a train\.base section"),
        ({"train": {"sft": {"lr": -1}}}, r"train\.sft\.lr"),
        ({"model": {"arch": "mamba"}}, r"model\.arch"),
        ({"train": {"base": {"curriculum": [{"split": "nope", "steps": 1}]}}},
         r"train\.base\.curriculum\.0\.split: 'nope' is not a pack split"),
        ({"train": {"base": {"steps": 10, "curriculum": [{"split": "stage1", "steps": 10}]}}},
         r"train\.base.*curriculum: its phases take 10 of the 10 steps"),
        ({"train": {"base": {"curriculum": [{"split": "stage1", "steps": 1}]}}},
         r"pack\.splits\.stage1\.seq_len: 2048 is beyond the base model's window"),
        ({"model": {"attention_backend": "flashy"}},
         r"model\.attention_backend: attention backend 'flashy' is unknown"),
        ({"model": {"d_model": 60, "n_heads": 4}}, r"model: RoPE needs an even head_dim"),
        ({"model": {"attention_backend": "fox", "d_model": 96}},
         r"model: attention backend 'fox' takes a power-of-two head_dim .*heads have 48"),
        ({"model": {"attention_backend": "cudnn", "d_model": 40, "n_heads": 4}},
         r"model: attention backend 'cudnn' takes head_dim <= 256 and a multiple of 8.*heads have 10"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config.resolve({"profile": "tiny-scratch", **overrides})


def test_null_drops_a_key_and_text_keys_match_numbers():
    cfg = config.resolve({"pack": {"splits": {"stage2": None}},
                          "train": {"pretrain": {"stages": [{"split": "stage1", "steps": 1, "lr": 1e-3}]}}})
    assert "stage2" not in cfg.pack.splits
    with pytest.raises(ConfigError, match=r"train\.pretrain\.stages\.1\.split: 'stage2' is not a pack split"):
        config.resolve({"pack": {"splits": {"stage2": None}}})
    cfg = config.resolve({"pack": {"splits": {"stage2": {"lengths": {"books": {"8192": 0.5, "2048": 0.5}}}}}})
    assert cfg.chunk_lengths("stage2", "books") == {8192: 0.5, 2048: 0.5}


def test_params_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="params file not found"):
        config.load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("pack: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:2:1: not valid YAML: expected ',' or ']'") as e:
        config.load(bad)
    assert "\n" not in str(e.value)  # one line: file, line, column and the problem (no excerpt)
    bad.write_text("- just a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        config.load(bad)
    # a key given twice: PyYAML would keep the last copy, DVC refuses the file; an anchor's merged
    # keys may still be overridden
    bad.write_text("profile: tiny\npack: {seed: 1}\neval: {}\npack: {seed: 2}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:4:1: not valid YAML: duplicate key 'pack'"):
        config.load(bad)
    bad.write_text("profile: tiny-scratch\neval: {samples: 2}\nrope_search: {population: 4}\n"
                   "train: {base: {steps: 3}}\nx: &run {steps: 2, lr: 1.0e-3}\n")
    with pytest.raises(ConfigError, match=r"x: unknown key"):  # parsed (anchors work), then refused by name
        config.load(bad)
    bad.write_text("eval: " + "[" * 3000 + "]" * 3000 + "\n")  # past the YAML reader's recursion
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid params: nested too deeply"):
        config.load(bad)
    for key in ("tasks", "lengths"):  # nothing to evaluate is a mistake, not a run
        bad.write_text(f"profile: tiny\neval: {{{key}: []}}\n")
        with pytest.raises(ConfigError, match=rf"eval\.{key}: List should have at least 1 item"):
            config.load(bad)


def test_config_command_prints_the_params_in_force(tmp_path):
    import subprocess
    import sys

    import yaml

    (tmp_path / "params.yaml").write_text("profile: prolong-64k\npack: {seed: 5}\n")
    out = subprocess.run([sys.executable, "-m", "longctx.config"], cwd=tmp_path, capture_output=True, text=True,
                         check=True).stdout
    shown = yaml.safe_load(out)
    assert shown["pack"]["seed"] == 5 and shown["pack"]["splits"]["stage1"]["seq_len"] == 65536
    (tmp_path / "params.yaml").write_text("profile: prolong-64k\npack: {seed: five}\n")
    proc = subprocess.run([sys.executable, "-m", "longctx.config"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 2 and "pack.seed" in proc.stderr
    # a billion-laughs document (10**9 values through nine levels of aliases): `dvc status` reading it ran past
    # 20 s (killed) on 2026-12-04; the check DVC's commands are documented to follow refuses it at once
    bombs = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"] + [
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    (tmp_path / "params.yaml").write_text("\n".join(["profile: tiny", *bombs, "eval: {tasks: *a8}"]) + "\n")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "longctx.config"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 2 and "a8: unknown key" in proc.stderr and "eval.tasks.0" in proc.stderr
    assert time.perf_counter() - start < 20 and len(proc.stderr.splitlines()) == 1


def test_a_profile_extends_another(tmp_path, monkeypatch):
    from longctx.config import loading

    for name in ("tiny", "tiny-scratch"):
        (tmp_path / f"{name}.yaml").write_text(loading.profile_path(name).read_text())
    monkeypatch.setattr(loading, "PROFILES", tmp_path)
    (tmp_path / "mine.yaml").write_text("extends: tiny-scratch\ntrain: {sft: {steps: 7}}\n")
    cfg = config.resolve({"profile": "mine"})
    # three levels: mine's key, tiny-scratch's base and tokenizer, tiny's everything else
    assert cfg.train.sft.steps == 7 and cfg.train.sft.lr == config.resolve({"profile": "tiny"}).train.sft.lr
    assert cfg.train.base == config.resolve({"profile": "tiny-scratch"}).train.base
    assert cfg.tokenize.tokenizer.path is None and cfg.train.pretrain.init == "base"
    assert cfg.profile == "mine"
    (tmp_path / "loop.yaml").write_text("extends: mine\n")
    (tmp_path / "mine.yaml").write_text("extends: loop\n")
    with pytest.raises(ConfigError, match=r"mine\.yaml: extends: loop -> mine -> loop is a cycle|"
                                          r"loop\.yaml: extends: mine -> loop -> mine is a cycle"):
        config.resolve({"profile": "mine"})
    (tmp_path / "mine.yaml").write_text("extends: tinny\n")
    with pytest.raises(ConfigError, match=r"mine\.yaml: extends: unknown profile 'tinny'"):
        config.resolve({"profile": "mine"})
