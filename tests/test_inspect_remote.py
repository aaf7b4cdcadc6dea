"""CheckpointSource over the Hub protocol: a loopback server (tests/fake_hub.py) serves fixture repos with
Range support; huggingface_hub does the transport. Requests are counted: at most two per shard (header
range reads) plus config.json and the index (HEAD + GET each through hf_hub_download), never tensor data.
The local reader of the same directory is the reference for what the remote reader must return.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants, hf_hub_download
from safetensors.torch import save_file

from atomtool.errors import HeaderError, SourceError
from atomtool.inspect.source import CheckpointSource, first_range_bytes
from tests.checkpoints import write_hf_checkpoint
from tests.fake_hub import FakeHub, set_endpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("repos")
    sharded = write_hf_checkpoint(base / "sharded", "glm_moe_dsa", max_shard_size="40KB", tokenizer=False)
    single = write_hf_checkpoint(base / "single", "qwen3", tokenizer=False)
    cfg_only = base / "cfg_only"
    cfg_only.mkdir()
    shutil.copy(single / "config.json", cfg_only / "config.json")

    missing = base / "missing"
    shutil.copytree(sharded, missing)
    sorted(missing.glob("model-*.safetensors"))[0].unlink()

    hostile = base / "hostile"
    shutil.copytree(sharded, hostile)
    victim = sorted(hostile.glob("model-*.safetensors"))[-1]
    blob = bytearray(victim.read_bytes())
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    first = next(k for k in header if k != "__metadata__")
    header[first]["dtype"] = "F8_E4M3FN"  # not a safetensors dtype
    text = json.dumps(header).encode()
    text += b" " * (n - len(text)) if len(text) <= n else b""
    victim.write_bytes(len(text).to_bytes(8, "little") + text + bytes(blob[8 + n:]))

    # a shard whose header is longer than the first range (big __metadata__): needs the second request
    bigmeta = base / "bigmeta"
    bigmeta.mkdir()
    shutil.copy(single / "config.json", bigmeta / "config.json")
    save_file({"a.weight": torch.zeros(4, 4)}, bigmeta / "model-00001-of-00002.safetensors",
              metadata={"format": "pt", "notes": "x" * 300_000})
    save_file({"b.weight": torch.zeros(1024, 1024)}, bigmeta / "model-00002-of-00002.safetensors")
    (bigmeta / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                        "b.weight": "model-00002-of-00002.safetensors"}}))
    # model.safetensors beside an index of another model's shards: transformers loads model.safetensors
    both = write_hf_checkpoint(base / "both", "qwen3", seed=2, max_shard_size="40KB", tokenizer=False)
    shutil.copy(single / "model.safetensors", both / "model.safetensors")
    return {"org/sharded": sharded, "org/single": single, "org/cfg-only": cfg_only, "org/missing": missing,
            "org/hostile": hostile, "org/bigmeta": bigmeta, "org/both": both}


@pytest.fixture
def hub(repos, monkeypatch, tmp_path):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    with FakeHub({**repos, "org/gated": repos["org/single"]}, commit=COMMIT, gated=frozenset({"org/gated"})) as server:
        set_endpoint(monkeypatch, server.endpoint)
        yield server


def as_tuples(src: CheckpointSource) -> dict:
    return {k: (t.file, t.dtype, t.shape, t.data_offsets) for k, t in src.tensors.items()}


def test_sharded_repo_matches_local_reader(hub, repos):
    remote = CheckpointSource.open("org/sharded")
    local = CheckpointSource.open(str(repos["org/sharded"]))
    assert remote.is_remote and remote.root is None and remote.commit == COMMIT
    assert remote.source == "org/sharded" and remote.revision is None
    assert as_tuples(remote) == as_tuples(local)
    assert remote.files == local.files and len(remote.files) > 3
    assert remote.config == local.config and remote.metadata == local.metadata
    assert remote.index_metadata == local.index_metadata
    assert remote.read_json("generation_config.json") == local.read_json("generation_config.json")
    assert remote.read_json("hf_quant_config.json") is None  # 404 on the Hub


def test_request_count_at_most_two_per_shard(hub, repos):
    src = CheckpointSource.open("org/sharded")
    names = {f: [k for k, t in src.tensors.items() if t.file == f] for f in src.files}
    by_file: dict[str, list] = {}
    for r in hub.requests:
        assert r.repo == "org/sharded" and (r.status < 400 or r.file == "model.safetensors")
        by_file.setdefault(r.file, []).append(r)
    assert set(by_file) == set(src.files) | {"config.json", "model.safetensors.index.json", "model.safetensors"}
    for f in ("config.json", "model.safetensors.index.json"):
        assert sorted(r.method for r in by_file[f]) == ["GET", "HEAD"]
    # one existence check of model.safetensors (read instead of the index when present, as transformers)
    assert [(r.method, r.status) for r in by_file["model.safetensors"]] == [("HEAD", 404)]
    for f in src.files:
        reqs = by_file[f]
        assert 1 <= len(reqs) <= 2 and all(r.method == "GET" and r.range for r in reqs)
        assert all(r.revision == COMMIT for r in reqs)  # shards read at config.json's commit
        assert reqs[0].range == f"bytes=0-{first_range_bytes(names[f]) - 1}"
    # the first range is sized from the index's names: one request per shard suffices here
    assert sum(len(by_file[f]) for f in src.files) == len(src.files)


def test_long_header_takes_a_second_range_and_no_tensor_data(hub, repos):
    src = CheckpointSource.open("org/bigmeta")
    assert src.metadata["model-00001-of-00002.safetensors"]["notes"] == "x" * 300_000
    big = hub.for_file("model-00001-of-00002.safetensors")
    assert len(big) == 2 and [r.status for r in big] == [206, 206]
    path = repos["org/bigmeta"] / "model-00001-of-00002.safetensors"
    n = int.from_bytes(path.read_bytes()[:8], "little")
    assert sum(r.body_bytes for r in big) == 8 + n  # header bytes only
    small = hub.for_file("model-00002-of-00002.safetensors")
    assert len(small) == 1 and small[0].body_bytes < 8192  # 4 MiB shard: header only
    assert src.tensors["b.weight"].shape == (1024, 1024)


def test_single_file_repo(hub, repos):
    src = CheckpointSource.open("org/single")
    assert src.files == ["model.safetensors"]
    assert as_tuples(src) == as_tuples(CheckpointSource.open(str(repos["org/single"])))
    reqs = hub.for_file("model.safetensors")
    assert 1 <= len(reqs) <= 2 and all(r.range for r in reqs)
    assert [r.status for r in hub.for_file("model.safetensors.index.json")] == [404]


def test_model_safetensors_beside_an_index_is_read_as_transformers_does(hub, repos):
    remote = CheckpointSource.open("org/both")
    local = CheckpointSource.open(str(repos["org/both"]))
    # transformers' from_pretrained loads model.safetensors first; the index names another model's shards
    assert remote.files == local.files == ["model.safetensors"]
    assert as_tuples(remote) == as_tuples(CheckpointSource.open(str(repos["org/single"])))
    assert remote.index_metadata is None and remote.metadata == local.metadata
    said = [w for w in remote.warnings if "has both" in w]
    assert said == [w.replace(str(repos["org/both"]), "org/both") for w in local.warnings if "has both" in w]
    assert said and said[0].startswith("org/both: has both model.safetensors and model.safetensors.index.json")
    read = {r.file for r in hub.requests if r.repo == "org/both"}
    assert read == {"config.json", "model.safetensors.index.json", "model.safetensors"}  # no shard read
    single = hub.for_file("model.safetensors")
    assert single[0].method == "HEAD" and all(r.method == "GET" and r.range for r in single[1:])


def test_config_only_repo(hub):
    src = CheckpointSource.open("org/cfg-only")
    assert src.tensors == {} and src.files == [] and src.config["model_type"] == "qwen3"


def test_hf_token_is_sent(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_for_test")
    CheckpointSource.open("org/sharded")
    assert hub.requests and all(r.authorization == "Bearer hf_secret_for_test" for r in hub.requests)


def test_revision_pins_every_read(hub):
    src = CheckpointSource.open("org/sharded", revision=COMMIT)
    assert src.revision == COMMIT and src.commit == COMMIT
    assert {r.revision for r in hub.requests} == {COMMIT}
    with pytest.raises(SourceError, match=r"^org/sharded: revision not found \(config.json\)$"):
        CheckpointSource.open("org/sharded", revision="v9")


def test_unknown_repo(hub):
    with pytest.raises(SourceError) as e:
        CheckpointSource.open("org/nope")
    assert str(e.value) == (f"org/nope: not a local directory, and no Hub repo of that name at {hub.endpoint} "
                            "(private or gated? set HF_TOKEN)")


def test_gated_repo(hub):
    with pytest.raises(SourceError) as e:
        CheckpointSource.open("org/gated")
    assert str(e.value) == "org/gated: gated repo; accept its terms on the Hub and set HF_TOKEN (config.json)"


def test_index_names_missing_shard(hub, repos):
    gone = sorted(repos["org/sharded"].glob("model-*.safetensors"))[0].name
    with pytest.raises(SourceError) as e:
        CheckpointSource.open("org/missing")
    assert str(e.value) == (f"org/missing/model.safetensors.index.json: names shard '{gone}', which does not "
                            "exist in the repo")


def test_hostile_remote_header(hub, repos):
    victim = sorted(repos["org/hostile"].glob("model-*.safetensors"))[-1].name
    with pytest.raises(HeaderError) as e:
        CheckpointSource.open("org/hostile")
    msg = str(e.value)
    assert msg.startswith(f"org/hostile/{victim}: tensor ") and "unknown dtype 'F8_E4M3FN'" in msg
    assert "\n" not in msg


def test_offline_uses_cache(hub, repos, monkeypatch):
    CheckpointSource.open("org/sharded")  # caches config.json + index.json, not the shards
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.reset()
    with pytest.raises(SourceError) as e:
        CheckpointSource.open("org/sharded")
    assert "not in the local HF cache" in str(e.value) and "HF_HUB_OFFLINE is set" in str(e.value)
    with pytest.raises(SourceError, match="org/single: HF_HUB_OFFLINE is set, and the repo is not in the local"):
        CheckpointSource.open("org/single")
    assert hub.requests == []

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    online = CheckpointSource.open("org/sharded")
    for f in online.files:  # the user downloads the weights
        hf_hub_download("org/sharded", f, endpoint=hub.endpoint)
    assert online.read_json("hf_quant_config.json") is None  # the Hub's 404 is remembered in the cache
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.reset()
    src = CheckpointSource.open("org/sharded")
    assert hub.requests == []
    assert src.is_remote and src.commit == COMMIT and src.root is not None
    assert as_tuples(src) == as_tuples(CheckpointSource.open(str(repos["org/sharded"])))
    assert (src.root / src.files[0]).is_file()
    assert src.read_json("hf_quant_config.json") is None  # its absence was cached while online
    with pytest.raises(SourceError, match="org/sharded: tokenizer_config.json is not in the local HF cache and "
                                          "the Hub cannot be reached"):
        src.read_json("tokenizer_config.json")


def test_network_down_falls_back_to_cache(hub, repos, monkeypatch):
    for f in ["config.json", "model.safetensors"]:
        hf_hub_download("org/single", f, endpoint=hub.endpoint)
    dead = "http://127.0.0.1:9"  # discard port: connection refused
    import huggingface_hub.utils._http as hf_http

    monkeypatch.setattr(hf_http.time, "sleep", lambda s: None)  # skip huggingface_hub's retry backoff waits
    set_endpoint(monkeypatch, dead)
    src = CheckpointSource.open("org/single")
    assert as_tuples(src) == as_tuples(CheckpointSource.open(str(repos["org/single"])))
    with pytest.raises(SourceError) as e:
        CheckpointSource.open("org/sharded")
    msg = str(e.value)
    assert msg.startswith(f"org/sharded: cannot reach {dead}") and "not in the local HF cache" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9", "http://hub.invalid"])  # refused / DNS failure
def test_network_down_fails_fast_and_quietly(hub, monkeypatch, caplog, capfd, endpoint):
    import logging
    import time

    set_endpoint(monkeypatch, endpoint)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    caplog.set_level(logging.DEBUG)
    t0 = time.monotonic()
    with pytest.raises(SourceError) as e:
        CheckpointSource.open("org/sharded")  # nothing cached: no fallback
    assert time.monotonic() - t0 < 8  # huggingface_hub's own backoff alone would sleep 1+2+4+8+8 s
    msg = str(e.value)
    assert msg.startswith(f"org/sharded: cannot reach {endpoint}") and "not in the local HF cache" in msg
    assert "\n" not in msg
    logged = caplog.text + capfd.readouterr().err
    assert "Retrying in" not in logged and "thrown while requesting" not in logged


def test_inspect_of_a_cached_repo_works_with_the_network_down(hub, repos, monkeypatch):
    from atomtool.inspect.classify import inspect_checkpoint

    for f in ["config.json", "model.safetensors"]:  # cached file by file: hf_quant_config.json never asked
        hf_hub_download("org/single", f, endpoint=hub.endpoint)
    set_endpoint(monkeypatch, "http://127.0.0.1:9")
    report = inspect_checkpoint("org/single")
    assert report.tensors and report.root is not None
    # the repo has no hf_quant_config.json; offline nobody can tell, so inspect must not mention it
    assert not [f for f in report.findings if "hf_quant_config" in f.message]
