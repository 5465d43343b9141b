"""The data path at pretraining scale, side by side in one run (issue 16).

    python benchmarks/data.py                 # a 64 MB synthetic jsonl corpus (the issue asks
                                              # for 1 GB; scale with --mb on a bigger machine)
    python benchmarks/data.py --smoke         # 0.6 MB, seconds
    python benchmarks/data.py --long 1 10 100 # peak memory of `data prepare` against the size
                                              # of one document (issue 26.4); --smoke: 0.5 2 MB

Prints, each as a ratio measured here:
(a) ``llmforge data prepare`` (read, clean, tokenize on every core, write shards, hash) against
    the ``tokenizers`` library's own ``encode_batch`` on the same texts (MB/s of text);
(b) start to first training batch: ``data.source: prepared`` (open + check the manifest and
    every shard's sha256, memory-map) against today's ``files`` path (read, tokenize in memory);
    and the prepared corpus read from a ``file://`` URL: the first start copies it to the node
    cache (hashing on the way), the second finds the cache and copies nothing;
(c) peak resident memory of each of 2 ranks (separate processes) reading the same corpus,
    prepared (memory-mapped, shared page cache) against ``files`` (a private token array each),
    with each rank's private bytes and its proportional share (PSS) from /proc/self/smaps_rollup;
(d) resume: time to the first batch at step 0 and at a late step, prepared (sampler arithmetic)
    and streaming (the saved StatefulDataLoader position; at most one block is re-read).

``--long MB...`` instead: for each size, one jsonl file holding a single document of that many
MB, prepared by ``llmforge.data.prepare.prepare`` (one process) in fresh child processes: with
the command's defaults (``train_bpe`` of 8,192 ids trained on the document's first 50 MB, into
an empty ``$LLMFORGE_CACHE``; ``data.val_fraction`` 0.05), and with a given BPE (tokenizing
only); prints each child's peak RSS and the slope (MB of peak RSS per MB of document) between
consecutive sizes and from the smallest to the largest. Before issue 26.4 the slope was ~200;
before issue 50.7 the defaults' was ~90 (the BPE trainer given the document whole: 4.9 GB at
54 MB), and 1.27 and 0.95 from 10 to 100 MB while the jsonl line was still read whole (a line
over 4 MiB is now parsed in chunks: ~0).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at "
         "which but have an they you were her she there one all we their thou thee doth king lord").split()


def write_corpus(folder: Path, mb: float, files: int = 4) -> str:
    rng = random.Random(0)
    per_file = int(mb * 1e6 / files)
    for f in range(files):
        with open(folder / f"part{f}.jsonl", "w") as fh:
            written = 0
            while written < per_file:
                line = json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 400)))}) + "\n"
                fh.write(line)
                written += len(line)
    return str(folder / "part*.jsonl")


def config(source: str, extra: list[str]):
    from llmforge.cli.data_commands import load_prepare_config

    return load_prepare_config(source, ["tokenizer.vocab_size=4096", "tokenizer.train_max_bytes=5000000",
                                        "data.val_fraction=0", *extra])


def warm_tokenizer(source: str) -> None:
    """Train the run's BPE as ``prepare`` would (same cache key) without tokenizing the corpus."""
    from llmforge.data.shakespeare import cache_root
    from llmforge.data.sources import iter_texts, load_documents
    from llmforge.data.tokenizers import build_tokenizer
    from llmforge.data.sources import tokenizer_cache_key

    cfg = config(source, [])
    cfg.data.streaming = True
    docs = load_documents(cfg.data, cfg.run.seed)
    build_tokenizer(cfg.tokenizer, lambda: iter_texts(docs.train, cfg.tokenizer.train_max_bytes),
                    cache_dir=cache_root() / "tokenizers", fingerprint=tokenizer_cache_key(cfg, docs))


def datamodule(docs, tok, rank=0, world=1, start_step=0, resume_dir=None):
    from llmforge.data.datamodule import LLMDataModule

    return LLMDataModule(docs, tok, seq_len=2048, local_batch_size=8, micro_batch_size=8, eval_batches=1,
                         seed=0, num_workers=0, dp_rank=rank, dp_size=world, start_step=start_step,
                         resume_dir=resume_dir)


def first_batch(build) -> float:
    """Seconds from nothing to the first training batch: ``build()`` (read or open the source,
    make the data module), its setup, the first batch."""
    start = time.perf_counter()
    dm = build()
    dm.setup()
    next(iter(dm.train_dataloader()))
    return time.perf_counter() - start


def memory() -> dict:
    """Peak RSS (VmHWM: ru_maxrss would count the parent's pages at fork), and the current Pss
    and private bytes (MB) of this process."""
    out = {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                out["peak_rss"] = int(line.split()[1]) / 1024
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("Pss", "Private_Clean", "Private_Dirty"):
                out[key] = out.get(key, 0) + int(rest.split()[0]) / 1024
    except OSError:
        pass
    return out


def rank_child(args) -> int:
    """One rank: build the data module of ``args.child`` (files or prepared), read 50 batches,
    print its memory as JSON."""
    from llmforge.data.prepared import open_prepared
    from llmforge.data.sources import load_documents
    from llmforge.data.tokenizers import load_saved

    tok = load_saved(Path(args.prepared) / "tokenizer")
    if args.child == "prepared":
        docs = open_prepared(args.prepared)
    else:
        cfg = config(args.source, [])
        docs = load_documents(cfg.data, cfg.run.seed)
    dm = datamodule(docs, tok, rank=args.rank, world=2)
    dm.setup()
    it = iter(dm.train_dataloader())
    for _ in range(50):
        next(it)
    print(json.dumps(memory()))
    return 0


def two_ranks(kind: str, source: str, prepared: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    procs = [subprocess.Popen([sys.executable, __file__, "--child", kind, "--rank", str(r), "--source", source,
                               "--prepared", prepared], stdout=subprocess.PIPE, text=True, env=env)
             for r in range(2)]
    return [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]


def write_long(path: Path, mb: float) -> None:
    """One jsonl line: a single document of ``mb`` MB of words."""
    rng = random.Random(1)
    pieces, size = [], 0
    while size < mb * 1e6:
        line = " ".join(rng.choice(WORDS) for _ in range(200)) + "\n"
        pieces.append(line)
        size += len(line)
    path.write_text(json.dumps({"text": "".join(pieces)}) + "\n")


def long_child(args) -> int:
    """Prepare ``args.source`` (one long document) with the tokenizer at ``args.prepared``;
    print this process's memory as JSON. ``--child tokenize`` instead: read the document with
    ``json.loads``, reset the peak (``/proc/self/clear_refs``) and tokenize it into a shard with
    ``write_shard`` alone; ``above`` is that peak minus the RSS before it (tokenizing only)."""
    if args.child == "defaults":  # as `llmforge data prepare DOC OUT --workers 1` (trains the BPE)
        from llmforge.cli.data_commands import load_prepare_config
        from llmforge.data.prepare import prepare

        start = time.perf_counter()
        manifest = prepare(load_prepare_config(args.source, []), Path(args.source).with_suffix(".def"),
                           workers=1, show_progress=False)
        print(json.dumps({**memory(), "seconds": time.perf_counter() - start,
                          "tokens": manifest["splits"]["train"]["tokens"]}))
        return 0
    if args.child == "tokenize":
        from llmforge.data.shard_writer import write_shard
        from llmforge.data.tokenizers import build_tokenizer

        cfg = config(args.source, ["tokenizer.type=huggingface", f"tokenizer.path={args.prepared}"])
        tok = build_tokenizer(cfg.tokenizer, None, cache_dir=Path(args.source).parent)  # prepare's
        text = json.loads(Path(args.source).read_text())["text"]
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
        base = memory()["peak_rss"]
        start = time.perf_counter()
        entry = write_shard(tok, [text], Path(args.source).with_suffix(".bin"))
        m = memory()
        print(json.dumps({**m, "above": m["peak_rss"] - base, "seconds": time.perf_counter() - start,
                          "tokens": entry["tokens"]}))
        return 0
    from llmforge.data.prepare import prepare

    cfg = config(args.source, ["tokenizer.type=huggingface", f"tokenizer.path={args.prepared}"])
    start = time.perf_counter()
    manifest = prepare(cfg, Path(args.source).with_suffix(".out"), workers=1, show_progress=False)
    print(json.dumps({**memory(), "seconds": time.perf_counter() - start,
                      "tokens": manifest["splits"]["train"]["tokens"]}))
    return 0


def _slopes(rows: list[tuple[float, float]], what: str) -> None:
    pairs = list(zip(rows, rows[1:])) + ([(rows[0], rows[-1])] if len(rows) > 2 else [])
    for (a, ra), (b, rb) in pairs:
        print(f"slope {a:g} -> {b:g} MB: {(rb - ra) / (b - a):.2f} MB of {what} per MB of document")


def long_documents(sizes: list[float], work: Path) -> int:
    from llmforge.data.tokenizers import train_bpe_tokenizer

    train_bpe_tokenizer([" ".join(WORDS)] * 50, 512, work / "tok", "long-bench")
    tok = next((work / "tok").rglob("tokenizer.json"))
    # offline: a Hub lookup without network waits ~60 s for its timeout in every child
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    rows, alone, defaults = [], [], []
    for mb in sizes:
        doc = work / f"long-{mb:g}.jsonl"
        write_long(doc, mb)
        text_mb = doc.stat().st_size / 1e6
        got = {}
        for kind in ("defaults", "long", "tokenize"):
            cache = work / f"cache-{mb:g}"  # empty: the defaults' child trains its BPE
            out = subprocess.run([sys.executable, __file__, "--child", kind, "--source", str(doc),
                                  "--prepared", str(tok)], capture_output=True, text=True,
                                 env={**env, "LLMFORGE_CACHE": str(cache)})
            if out.returncode != 0:
                print(f"{mb:g} MB ({kind}): failed: {out.stderr.strip()[-500:]}")
                return 1
            got[kind] = json.loads(out.stdout.strip().splitlines()[-1])
        d, m, t = got["defaults"], got["long"], got["tokenize"]
        defaults.append((text_mb, d["peak_rss"]))
        rows.append((text_mb, m["peak_rss"]))
        alone.append((text_mb, t["above"]))
        print(f"one document of {text_mb:8.1f} MB: data prepare peak RSS {d['peak_rss']:7.0f} MB with "
              f"the defaults (trains the BPE), {d['seconds']:6.1f} s; {m['peak_rss']:7.0f} MB with a given "
              f"BPE, {m['seconds']:6.1f} s, {m['tokens']:,} tokens; write_shard alone {t['above']:5.0f} MB "
              f"above the text, {t['seconds']:6.1f} s")
        doc.unlink()
        doc.with_suffix(".bin").unlink(missing_ok=True)
        for folder in (doc.with_suffix(".out"), doc.with_suffix(".def"), cache):
            shutil.rmtree(folder, ignore_errors=True)
    _slopes(defaults, "data prepare's peak RSS (defaults)")
    _slopes(rows, "data prepare's peak RSS (given BPE)")
    _slopes(alone, "tokenizing's peak (write_shard)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--mb", type=float, default=64.0, help="corpus size in MB of jsonl")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--source", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prepared", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--long", type=float, nargs="*", default=None, metavar="MB",
                    help="peak memory against the size of one document (e.g. --long 1 10 100)")
    args = ap.parse_args()
    work = None if args.child else Path(tempfile.mkdtemp(prefix="llmforge-data-bench-"))
    if work is not None:  # the Arrow cache of the in-memory path goes with the corpus (GBs at --mb 1000)
        os.environ["HF_DATASETS_CACHE"] = str(work / "hf")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    if args.child:
        return long_child(args) if args.child in ("defaults", "long", "tokenize") else rank_child(args)
    try:
        if args.long is not None:
            return long_documents(args.long or ([0.5, 2] if args.smoke else [1, 10, 100]), work)
        return run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> int:
    mb = 0.6 if args.smoke else args.mb
    from llmforge.data.prepare import prepare
    from llmforge.data.prepared import open_prepared
    from llmforge.data.sources import load_documents
    from llmforge.data.tokenizers import load_saved

    source = write_corpus(work, mb)
    size = sum(f.stat().st_size for f in work.glob("part*.jsonl")) / 1e6
    cores = os.cpu_count() or 1
    print(f"corpus: {size:.1f} MB of jsonl in 4 files (synthetic words), {cores} cores")

    # (a) prepare against the tokenizers batch encoder on the same texts
    warm_tokenizer(source)  # trains (and caches) the BPE, so the timed prepare only tokenizes
    start = time.perf_counter()
    manifest = prepare(config(source, []), work / "prepared", workers=cores, show_progress=False)
    t_prepare = time.perf_counter() - start
    tok = load_saved(work / "prepared" / "tokenizer")
    cfg = config(source, [])
    texts = [r["text"] for r in load_documents(cfg.data, cfg.run.seed).train]
    text_mb = sum(len(t.encode()) for t in texts) / 1e6
    start = time.perf_counter()
    n = 0  # calls of 4,096 documents: one call over 1 GB would hold ~150 bytes of Encoding per token
    for i in range(0, len(texts), 4096):
        n += sum(len(e.ids) for e in tok._tok.encode_batch(texts[i:i + 4096], add_special_tokens=False))
    t_encode = time.perf_counter() - start
    assert n + 2 * len(texts) == manifest["splits"]["train"]["tokens"]
    print(f"(a) tokenizers encode_batch only   {text_mb / t_encode:8.1f} MB/s  ({n / t_encode:,.0f} tokens/s)")
    print(f"    llmforge data prepare          {text_mb / t_prepare:8.1f} MB/s  ratio {t_encode / t_prepare:.2f}"
          "  (read + clean + tokenize + write + sha256)")

    # (b) start to first batch
    del texts
    t_files = first_batch(lambda: datamodule(load_documents(cfg.data, cfg.run.seed), tok))
    t_prep = first_batch(lambda: datamodule(open_prepared(work / "prepared"), tok))
    print(f"(b) start to first batch: files {t_files:.2f} s, prepared {t_prep * 1e3:,.1f} ms (manifest, "
          f"every shard's sha256, memory-map), ratio {t_files / t_prep:,.1f}x")
    url, cache = (work / "prepared").as_uri(), work / "node-cache"
    t_copy = first_batch(lambda: datamodule(open_prepared(url, cache_dir=cache), tok))
    t_again = first_batch(lambda: datamodule(open_prepared(url, cache_dir=cache), tok))
    print(f"    prepared at a file:// URL: first start {t_copy:.2f} s (copied to the node cache, hashed on "
          f"the way), second start {t_again:.2f} s (cache found, nothing copied)")

    # (c) two ranks on the same corpus (--smoke: the prepared path only, which the files path's
    # children share but for their source: 4 processes would be most of the smoke run's time)
    for kind in ("prepared",) if args.smoke else ("files", "prepared"):
        ranks = two_ranks(kind, source, str(work / "prepared"))
        cols = "  ".join(f"rank {i}: peak RSS {m['peak_rss']:.0f} MB, PSS {m.get('Pss', 0):.0f} MB, private "
                         f"{m.get('Private_Clean', 0) + m.get('Private_Dirty', 0):.0f} MB" for i, m in enumerate(ranks))
        print(f"(c) {kind:8s} {cols}")

    # (d) resume at step 0 against a late step
    late = 5_000
    opened = open_prepared(work / "prepared")
    t0 = first_batch(lambda: datamodule(opened, tok, start_step=0))
    t1 = first_batch(lambda: datamodule(opened, tok, start_step=late))
    print(f"(d) prepared  resume at step 0 {t0 * 1e3:.1f} ms, at step {late:,} {t1 * 1e3:.1f} ms, ratio {t1 / t0:.2f}")
    cfg.data.streaming = True
    dm = datamodule(load_documents(cfg.data, cfg.run.seed), tok)
    dm.setup()
    loader = dm.train_dataloader()
    it = iter(loader)
    steps = 4 if args.smoke else 200
    start = time.perf_counter()
    for _ in range(steps):
        next(it)
    t_replay = time.perf_counter() - start
    (work / "ck" / "data").mkdir(parents=True)
    (work / "ck" / "data" / "rank0.json").write_text(json.dumps(
        {"dp_size": 1, "num_workers": 0, "loader": loader.position(steps)}))
    s0 = first_batch(lambda: datamodule(load_documents(cfg.data, cfg.run.seed), tok))
    s1 = first_batch(lambda: datamodule(load_documents(cfg.data, cfg.run.seed), tok, resume_dir=work / "ck"))
    print(f"(d) streaming resume at step 0 {s0:.2f} s, at step {steps} {s1:.2f} s, ratio {s1 / s0:.2f} "
          f"(replaying those {steps} steps took {t_replay:.1f} s)")
    print(f"tokens/s of the prepare: {manifest['splits']['train']['tokens'] / t_prepare:,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
