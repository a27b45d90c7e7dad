"""Document sources on real local files: text, jsonl, parquet, a datasets directory read
through the hub loader, and the ways each can be broken."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import REPO
from longctx.config import CorporaParams, SourceParams
from longctx.data import builtin, corpora
from longctx.data.sources import iter_docs
from longctx.errors import DataError


def docs(spec: dict, kind: str = "short", invalid_utf8: str = "replace"):
    return list(iter_docs(SourceParams(**spec), kind, 0, invalid_utf8))


def test_local_directory_reads_every_supported_file(tmp_path):
    (tmp_path / "a.txt").write_text("alpha text")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("# beta")
    (tmp_path / "c.jsonl").write_text('{"text": "gamma"}\n\n{"text": "delta"}\n')
    pq.write_table(pa.table({"text": ["eps", "zeta"]}), tmp_path / "d.parquet")
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    got = docs({"path": str(tmp_path)})
    assert [d.text for d in got] == ["alpha text", "gamma", "delta", "eps", "zeta", "# beta"]
    assert got[1].id.endswith("c.jsonl:1") and got[2].id.endswith("c.jsonl:3")


def test_budgets_stop_a_source(tmp_path):
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": "x" * 10}) + "\n" for _ in range(20)))
    assert len(docs({"path": str(tmp_path), "max_docs": 3})) == 3
    assert len(docs({"path": str(tmp_path), "max_bytes": 25})) == 3


def test_doc_max_bytes_cuts_each_document_at_a_character_boundary(tmp_path):
    (tmp_path / "a.txt").write_text("ab" + "é" * 10)  # é: 2 bytes, so 5 bytes end inside one
    (tmp_path / "b.txt").write_text("xyz")
    got = docs({"path": str(tmp_path), "doc_max_bytes": 5})
    assert [d.text for d in got] == ["abé", "xyz"]
    repos = docs({"builtin": "stdlib_repos", "max_docs": 3, "doc_max_bytes": 20_000}, kind="long")
    assert len(repos) == 3 and all(18_000 < d.nbytes <= 20_000 for d in repos)
    assert all(d.text.startswith("### File: ") for d in repos)


def test_invalid_utf8_is_replaced_and_counted_or_rejected(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "good.txt").write_text("fine")
    (src / "bad.txt").write_bytes(b"caf\xe9 and \xff\xfe end")
    cfg = CorporaParams(domains={"web": {"kind": "short", "sources": [{"path": str(src)}]}})
    out = tmp_path / "out"
    out.mkdir()
    manifest = corpora.build(cfg, out)
    assert manifest["domains"]["web"]["replaced_chars"] == 3
    assert manifest["domains"]["web"]["docs_with_replacements"] == 1
    texts = pq.read_table(out / "web.parquet").column("text").to_pylist()
    assert "caf\ufffd and \ufffd\ufffd end" in texts
    assert manifest["packages"]["pyarrow"] == pa.__version__
    # a package the run never imports may be absent (a GPU image given only what the pipeline imports)
    assert corpora._version("longctx-no-such-package") is None
    with pytest.raises(DataError, match=r"bad\.txt: not valid UTF-8 at byte 3"):
        docs({"path": str(src)}, invalid_utf8="reject")


def test_corrupt_inputs_name_the_file(tmp_path):
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(DataError, match=r"rows\.jsonl:3: corrupt JSON line"):
        docs({"path": str(bad)})
    bad.write_text('{"text": 5}\n')
    with pytest.raises(DataError, match=r"rows\.jsonl:1: field 'text' must be a string"):
        docs({"path": str(bad)})
    pqfile = tmp_path / "table.parquet"
    pq.write_table(pa.table({"text": [os.urandom(500).hex() for _ in range(100)]}), pqfile)
    data = pqfile.read_bytes()
    pqfile.write_bytes(data[: len(data) // 2])  # a half-written or half-downloaded file
    with pytest.raises(DataError, match=r"table\.parquet: corrupt or unreadable parquet"):
        docs({"path": str(pqfile)})
    pqfile.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"table\.parquet: corrupt or unreadable parquet"):
        docs({"path": str(pqfile)})
    pq.write_table(pa.table({"body": ["x"]}), pqfile)
    with pytest.raises(DataError, match=r"no column 'text'"):
        docs({"path": str(pqfile)})


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(DataError, match="nowhere: source path does not exist"):
        docs({"path": str(tmp_path / "nowhere")})
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .* files in this directory"):
        docs({"path": str(tmp_path / "empty")})
    (tmp_path / "blank.jsonl").write_text("\n")
    cfg = CorporaParams(domains={"web": {"kind": "short", "sources": [{"path": str(tmp_path / "blank.jsonl")}]}})
    with pytest.raises(DataError, match=r"corpora\.domains\.web: source path .*blank\.jsonl yielded no documents"):
        corpora.build(cfg, tmp_path)


def test_domains_built_side_by_side_write_the_same_bytes(tmp_path):
    """num_workers > 1 collects domains in spawned processes: the same files and manifest as one
    process, and a worker's DataError reaches the caller naming its domain."""
    (tmp_path / "web.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 50}) + "\n" for i in range(40)))
    domains = {"web": {"kind": "short", "sources": [{"path": str(tmp_path / "web.jsonl")}]},
               "retrieval": {"kind": "whole", "sources": [{"synthetic": {"formats": ["passkey", "kv"], "min_chars": 200,
                                                                          "max_chars": 900}, "max_bytes": 60_000}]},
               "repos": {"kind": "long", "sources": [{"builtin": "stdlib_repos", "max_bytes": 300_000}]}}
    manifests = {}
    for workers in (1, 3):
        out = tmp_path / f"w{workers}"
        out.mkdir()
        manifests[workers] = corpora.build(CorporaParams(domains=domains, num_workers=workers), out)
    assert manifests[1] == manifests[3] and manifests[1]["domains"]["retrieval"]["docs"] > 10
    for domain in domains:
        assert (tmp_path / f"w1/{domain}.parquet").read_bytes() == (tmp_path / f"w3/{domain}.parquet").read_bytes()
    (tmp_path / "blank.jsonl").write_text("\n")
    broken = domains | {"web": {"kind": "short", "sources": [{"path": str(tmp_path / "blank.jsonl")}]}}
    with pytest.raises(DataError, match=r"corpora\.domains\.web: source path .*blank\.jsonl yielded no documents"):
        corpora.build(CorporaParams(domains=broken, num_workers=3), tmp_path / "w3")


def test_sft_conversations_are_validated(tmp_path):
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"messages": good}) + "\n")
    assert docs({"path": str(f)}, kind="sft")[0].messages == good
    f.write_text(json.dumps({"messages": good[:1]}) + "\n")
    with pytest.raises(DataError, match="no assistant message"):
        docs({"path": str(f)}, kind="sft")
    f.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(DataError, match=r"messages\[0\] must be"):
        docs({"path": str(f)}, kind="sft")


def _hub_dataset(folder: Path) -> Path:
    """A dataset directory in the layout the hub serves (data files under data/)."""
    rows = []
    for repo in ("org/alpha", "org/beta"):
        for i in range(4):
            rows.append({"content": f"print({i})  # {repo}", "repo": repo, "path": f"pkg/m{i}.py",
                         "meta": {"set": "code" if repo != "org/beta" or i < 3 else "other"}})
    (folder / "data").mkdir(parents=True)
    with (folder / "data" / "train-00000-of-00001.jsonl").open("w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return folder


def test_hub_loader_streams_filters_and_groups_repositories(tmp_path):
    ds = _hub_dataset(tmp_path / "ds")
    spec = {"hub": str(ds), "text_field": "content", "group_by": "repo", "header_field": "path",
            "filter": {"meta.set": "code"}}
    got = docs(spec, kind="long")
    assert [d.id for d in got] == [f"{ds}:repo=org/alpha", f"{ds}:repo=org/beta"]
    alpha = got[0].text
    assert alpha.count("### File: pkg/m") == 4 and got[1].text.count("### File:") == 3
    order = [alpha.index(f"pkg/m{i}.py") for i in range(4)]
    assert order != sorted(order) or docs(spec, kind="long")[0].text == alpha  # shuffled, deterministically
    assert docs(spec, kind="long")[0].text == alpha
    plain = docs({"hub": str(ds), "text_field": "content", "max_docs": 5})
    assert len(plain) == 5 and plain[0].text == "print(0)  # org/alpha"


def test_hub_errors_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="hub source 'no-such-org/no-such-dataset'"):
        docs({"hub": "no-such-org/no-such-dataset"})
    ds = _hub_dataset(tmp_path / "ds")
    with pytest.raises(DataError, match="field 'text' must be a string"):
        docs({"hub": str(ds)})


def test_builtin_repos_are_whole_packages_in_seeded_file_order():
    spec = {"builtin": "stdlib_repos", "max_docs": 3}
    a = list(iter_docs(SourceParams(**spec), "long", 0, "replace"))
    b = list(iter_docs(SourceParams(**spec), "long", 0, "replace"))
    c = list(iter_docs(SourceParams(**spec), "long", 1, "replace"))
    assert [d.text for d in a] == [d.text for d in b]
    assert [d.text for d in a] != [d.text for d in c]
    unsorted = 0
    for d in a:
        pkg = d.id.split(":")[1]
        headers = [line for line in d.text.splitlines() if line.startswith("### File: ")]
        root = builtin.stdlib_dir() / pkg
        files = [f for f in builtin._text_files(root) if f.read_text(encoding="utf-8", errors="replace")]
        assert sorted(headers) == sorted(f"### File: {pkg}/{f.relative_to(root).as_posix()}" for f in files)
        unsorted += headers != sorted(headers)
    assert unsorted  # files in random order, not path or dependency order


def test_stage_cli_fails_cleanly_and_keeps_earlier_outputs(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "profile": "tiny",
        "corpora": {"domains": {"code_repos": {"sources": [{"path": str(tmp_path / "missing")}]}}},
        "tracking": {"enabled": False},
    }))
    keep = tmp_path / "data" / "corpora" / "manifest.json"
    keep.parent.mkdir(parents=True)
    keep.write_text('{"earlier": true}')
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "stages.corpora"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "corpora: error:" in proc.stderr and "missing: source path does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert keep.read_text() == '{"earlier": true}'
    assert sorted(p.name for p in keep.parent.parent.iterdir()) == ["corpora"]
    (tmp_path / "params.yaml").write_text("profile: tiny\npack: {sed: 3}\n")
    proc = subprocess.run([sys.executable, "-m", "stages.pack"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "pack.sed: unknown key" in proc.stderr
