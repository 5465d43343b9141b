"""Prepared corpora at an fsspec URL: copied once per node into a verified cache (real processes
racing for it), a second start copies nothing, a killed copy leaves nothing that looks whole;
`llmforge data prepare SOURCE URL` uploads, resumes without re-uploading; bad input exits 2."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import fsspec
import fsspec.implementations.local
import pytest

from conftest import DEMO, REPO, TINY_OVERRIDES
from helpers.prepared import prepare, windows_digest, write_corpus
from llmforge.cli import main

SEQ = 15


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """One corpus prepared once locally (shards of 25 documents), and its train windows' digest."""
    from llmforge.data.prepared import open_prepared

    root = tmp_path_factory.mktemp("remote")
    source = write_corpus(root / "corpus")
    assert prepare(source, root / "tokens") == 0
    return source, root / "tokens", windows_digest(open_prepared(root / "tokens"), SEQ)


def shard_count(out: Path) -> int:
    m = json.loads((out / "manifest.json").read_text())
    return sum(len(info["shards"]) for info in m["splits"].values())


def count_downloads(monkeypatch) -> list:
    import llmforge.data.remote as remote

    real, seen = remote._download, []

    def counting(fs, src, target, where, size=None, sha256=None):
        if sha256 is not None:
            seen.append(where)
        return real(fs, src, target, where, size, sha256)

    monkeypatch.setattr(remote, "_download", counting)
    return seen


def test_two_processes_racing_for_the_cache_copy_once_and_read_the_same_windows(corpus, tmp_path, monkeypatch):
    from llmforge.data.prepared import open_prepared

    _, out, digest = corpus
    url, cache = f"slowfile://{out}", tmp_path / "cache"
    (tmp_path / "barrier").mkdir()
    env = {"PYTHONPATH": f"{REPO / 'src'}:{REPO / 'tests'}", "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "helpers" / "prepared.py"), url, str(cache),
                               str(tmp_path / "barrier"), str(SEQ)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        results.append((json.loads(stdout.strip().splitlines()[-1]), stderr))
    assert sorted(r["downloads"] for r, _ in results) == [0, shard_count(out)]  # copied once
    assert {r["windows"] for r, _ in results} == {digest}
    assert results[0][0]["root"] == results[1][0]["root"]
    waiter = next(err for r, err in results if r["downloads"] == 0)
    assert "waiting for another process copying slowfile://" in waiter  # the race was real
    # a second start (as a file:// URL of another protocol would get its own copy: same URL here)
    import helpers.prepared as helper

    helper._register_slowfile()
    seen = count_downloads(monkeypatch)
    again = open_prepared(url, cache_dir=cache)
    assert seen == [] and str(again.root) == results[0][0]["root"]
    assert not list(cache.rglob("*.tmp"))


def test_a_killed_copy_leaves_no_whole_looking_shard_and_the_next_start_copies_the_rest(corpus, tmp_path,
                                                                                       monkeypatch):
    import llmforge.data.remote as remote
    from llmforge.data.prepared import open_prepared

    _, out, digest = corpus
    monkeypatch.setattr(remote, "COPY_THREADS", 1)
    real, calls = remote._download, []

    def killed_on_the_third(fs, src, target, where, size=None, sha256=None):
        if sha256 is not None:
            calls.append(where)
            if len(calls) >= 3:  # as a SIGKILL mid-copy: half a shard under its temporary name
                target.with_name(target.name + ".tmp").write_bytes(b"\0" * 10)
                raise KeyboardInterrupt
        return real(fs, src, target, where, size, sha256)

    monkeypatch.setattr(remote, "_download", killed_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        open_prepared(out.as_uri(), cache_dir=tmp_path / "cache")
    (copy,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert not (copy / "manifest.json").exists() and len(list(copy.rglob("*.bin"))) == 2
    monkeypatch.setattr(remote, "_download", real)
    seen = count_downloads(monkeypatch)
    opened = open_prepared(out.as_uri(), cache_dir=tmp_path / "cache")
    assert len(seen) == shard_count(out) - 2 and not set(seen) & set(calls[:2])  # the whole two are kept
    assert opened.root == copy and windows_digest(opened, SEQ) == digest
    assert not list(copy.rglob("*.tmp"))


def train(tmp_path, capsys, *extra):
    code = main(["train", DEMO, *TINY_OVERRIDES, f"run.output_dir={tmp_path / 'runs'}", "run.name=p",
                 "trainer.max_steps=1", "trainer.eval_every=0", "trainer.global_batch_size=4",
                 "trainer.micro_batch_size=2", "data.source=prepared", f"data.cache_dir={tmp_path / 'cache'}",
                 *extra])
    return code, capsys.readouterr().err


def test_a_corrupt_remote_shard_exits_2_naming_its_url_and_caches_nothing(corpus, tmp_path, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(corpus[1], bad)
    shard = bad / "train" / "shard_00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, err = train(tmp_path, capsys, f"data.path={bad.as_uri()}")
    assert code == 2 and "Traceback" not in err, err
    assert f"error: data.path: shard {bad.as_uri()}/train/shard_00001.bin is corrupt" in err
    assert not list((tmp_path / "cache").rglob("manifest.json")) and not list((tmp_path / "cache").rglob("*.tmp"))
    assert not (tmp_path / "runs" / "p").exists()
    code, err = train(tmp_path, capsys, f"data.path={(tmp_path / 'nothing').as_uri()}")
    assert code == 2 and "has no manifest.json, so it is not a prepared corpus" in err, err


def test_a_manifest_naming_files_outside_the_corpus_is_refused(corpus, tmp_path):
    import shutil

    from llmforge.data.prepared import open_prepared
    from llmforge.errors import DataError

    bad = tmp_path / "bad"
    shutil.copytree(corpus[1], bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["splits"]["train"]["shards"][0]["file"] = "../../evil.bin"
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match="manifest.json lists the shard '../../evil.bin', which is not "
                                        "a path inside its folder"):
        open_prepared(bad.as_uri(), cache_dir=tmp_path / "cache")
    assert not list(tmp_path.rglob("evil.bin*"))


class HeadersFile(fsspec.implementations.local.LocalFileSystem):
    """A local filesystem that adds to its nested ``headers`` option, as HTTP drivers do."""

    protocol = ("headersfile",)
    seen: list = []

    def __init__(self, headers=None, client_kwargs=None, **kwargs):
        headers["User-Agent"] = "llmforge-test"  # a read-only OmegaConf node refuses this
        HeadersFile.seen.append((type(headers), dict(headers), type(client_kwargs)))
        super().__init__(**kwargs)


def test_a_mixture_entry_at_a_url_is_read_through_the_cache(corpus, tmp_path, capsys):
    fsspec.register_implementation("headersfile", HeadersFile, clobber=True)
    HeadersFile.seen.clear()  # another test of this worker may have used the driver
    _, out, _ = corpus
    nested = "data.storage_options={headers: {Authorization: Bearer-x}, client_kwargs: {region_name: r}}"
    code, err = train(tmp_path, capsys, f"data.mixture=[{{path: 'headersfile://{out}', weight: 1, name: remote}}, "
                                        f"{{path: '{out}', weight: 1, name: local}}]", nested)
    assert code == 0, err
    # nested storage options reach the driver as plain, mutable dicts (issue 26.6)
    assert HeadersFile.seen and all(t is dict and c is dict for t, _, c in HeadersFile.seen)
    assert HeadersFile.seen[0][1] == {"Authorization": "Bearer-x", "User-Agent": "llmforge-test"}
    assert f"copying {shard_count(out)} shard(s)" in err and list((tmp_path / "cache").glob("*/manifest.json"))


def test_prepare_to_a_url_uploads_and_a_run_reads_it(corpus, tmp_path, capsys):
    from llmforge.data.prepared import open_prepared

    source, local, digest = corpus
    url = f"memory://{tmp_path.name}/tokens"
    assert prepare(source, url) == 0
    capsys.readouterr()
    fs = fsspec.filesystem("memory")
    remote = json.loads(fs.cat_file(f"/{tmp_path.name}/tokens/manifest.json"))
    assert remote["splits"] == json.loads((local / "manifest.json").read_text())["splits"]
    assert fs.exists(f"/{tmp_path.name}/tokens/tokenizer/llmforge_tokenizer.json")
    from llmforge.data.shakespeare import cache_root

    staging = cache_root() / "staging"
    assert not any(json.dumps(url) in p.read_text() for p in staging.rglob("progress.json"))
    assert not list(staging.rglob("*.bin"))  # uploaded shards are not kept locally
    assert windows_digest(open_prepared(url, cache_dir=tmp_path / "cache"), SEQ) == digest
    code, err = train(tmp_path, capsys, f"data.path={url}")
    assert code == 0, err
    rows = [json.loads(x) for x in (tmp_path / "runs" / "p" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1]
    assert prepare(source, url) == 2  # a finished corpus is never overwritten
    assert "already holds a prepared corpus" in capsys.readouterr().err


def test_an_interrupted_upload_resumes_without_resending_whole_shards(corpus, tmp_path, monkeypatch, capsys):
    import llmforge.data.prepare as prepare_module  # prepare_to_store uploads through remote._upload

    source, local, _ = corpus
    url = f"memory://{tmp_path.name}/tokens"
    fs = fsspec.filesystem("memory")
    real, sent, stop = prepare_module._upload, [], [True]

    def flaky(fs_, path, rpath, url_):
        sent.append(rpath.rsplit("/", 2)[-2] + "/" + rpath.rsplit("/", 1)[-1])
        if stop[0] and sent[-1] == "train/shard_00001.bin":  # killed mid-upload: a partial object
            fs_.pipe_file(rpath, b"partial")
            raise KeyboardInterrupt
        return real(fs_, path, rpath, url_)

    monkeypatch.setattr(prepare_module, "_upload", flaky)
    assert prepare(source, url) == 130
    assert sent == ["train/shard_00000.bin", "train/shard_00001.bin"]
    assert not fs.exists(f"/{tmp_path.name}/tokens/manifest.json")
    sent.clear()
    stop[0] = False
    assert prepare(source, url) == 0
    shards = [s for s in sent if s.endswith(".bin")]
    assert "train/shard_00000.bin" not in shards and shards.count("train/shard_00001.bin") == 1
    assert len(shards) == shard_count(local) - 1
    remote_m = json.loads(fs.cat_file(f"/{tmp_path.name}/tokens/manifest.json"))
    assert remote_m["splits"] == json.loads((local / "manifest.json").read_text())["splits"]
    whole = (local / "train" / "shard_00001.bin").read_bytes()
    assert fs.cat_file(f"/{tmp_path.name}/tokens/train/shard_00001.bin") == whole
    capsys.readouterr()


def test_a_cache_without_room_exits_2_before_copying(corpus, tmp_path, monkeypatch, capsys):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    code, err = train(tmp_path, capsys, f"data.path={corpus[1].as_uri()}")
    assert code == 2 and f"error: data.cache_dir: {tmp_path / 'cache'} has 0.0 GB free" in err, err
    assert not list((tmp_path / "cache").rglob("*.bin*"))


def test_prepare_refuses_a_url_holding_other_files_and_keeps_them(corpus, tmp_path, capsys):
    fs = fsspec.filesystem("memory")
    fs.pipe_file(f"/{tmp_path.name}/busy/notes.txt", b"mine")
    assert prepare(corpus[0], f"memory://{tmp_path.name}/busy") == 2
    err = capsys.readouterr().err
    assert f"error: OUT: memory://{tmp_path.name}/busy holds other files (notes.txt" in err, err
    assert fs.cat_file(f"/{tmp_path.name}/busy/notes.txt") == b"mine"
    if importlib.util.find_spec("s3fs") is None:
        assert prepare(corpus[0], "s3://bucket/tokens") == 2
        err = capsys.readouterr().err
        assert "error: OUT: s3://bucket/tokens needs the fsspec driver" in err and "pip install s3fs" in err


@pytest.mark.parametrize("url,words", [("gs://bucket/tokens", "pip install gcsfs"),
                                       ("az://container/tokens", "pip install adlfs"),
                                       ("nosuchproto://x/tokens", "Protocol not known: nosuchproto")])
def test_a_missing_driver_or_unknown_protocol_is_a_data_error_naming_the_fix(url, words):
    import importlib.util

    from llmforge.data.remote import open_store
    from llmforge.errors import DataError

    package = words.split()[-1]
    if "install" in words and importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed")
    with pytest.raises(DataError, match="^data.path: ") as info:
        open_store(url, {}, "data.path")
    assert words in str(info.value) and info.value.exit_code == 2


def test_the_drivers_credential_options_are_redacted_in_what_a_run_writes():
    from llmforge.config import redact

    options = {"key": "AKIAEXAMPLE1", "secret": "s3cr3t-value", "token": "session-tok",  # s3fs
               "account_key": "azure-key-1", "sas_token": "sv=2024&sig=x",  # adlfs
               "connection_string": "AccountName=a;AccountKey=azure-key-2", "anon": False}
    out = redact({"data": {"storage_options": options}})["data"]["storage_options"]
    assert out == {**{k: "***" for k in options if k != "anon"}, "anon": False}
