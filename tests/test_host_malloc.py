"""trainer.malloc_tuning: glibc keeps a training step's large host blocks instead of faulting
them in again every step."""

import platform
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

PROBE = textwrap.dedent("""
    import resource, sys
    import torch
    from llmforge.host_malloc import tune_host_malloc
    applied = tune_host_malloc() if sys.argv[1] == "1" else False
    x = torch.randn(512, 512)
    for _ in range(3):  # warm-up
        y = [torch.empty(2 * 1024 * 1024) .fill_(1.0) for _ in range(4)]; del y
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(40):  # a 'step': four 8 MiB activations written, then freed
        y = [torch.empty(2 * 1024 * 1024).fill_(1.0) for _ in range(4)]; del y
    print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def faults(tuned: bool) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, "1" if tuned else "0"], capture_output=True,
                         text=True, check=True, env={"PYTHONPATH": str(REPO / "src"), "PATH": ""})
    applied, n = out.stdout.split()
    return applied == "True", int(n)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt (Linux)")
def test_tuned_malloc_reuses_blocks_instead_of_faulting_them_in():
    applied, tuned = faults(True)
    assert applied
    # 40 x 4 x 8 MiB = 1.25 GiB written (327,680 pages): tuned, the blocks are reused and
    # nothing is faulted in again. glibc's defaults fault them in every step (326,400 measured)
    # whenever its dynamic trim threshold hands the freed blocks back, which depends on what
    # else sits at the heap top (another run measured 4,096), so only the tuned side is checked
    # < 5 % of the pages written (two 16 MiB blocks faulted in once more, 8,192 pages, were
    # measured twice on a loaded machine on 2026-12-05; the untuned side is 40x that)
    assert tuned < 16_384, tuned


def test_tuning_is_applied_once_and_reports_it():
    from llmforge.host_malloc import tune_host_malloc

    first = tune_host_malloc()
    assert tune_host_malloc() is first  # idempotent
    assert first is (platform.libc_ver()[0] == "glibc")


TRIM_PROBE = textwrap.dedent("""
    import ctypes, importlib.util, sys
    # the module alone (no torch, no llmforge package): a 50 ms process
    spec = importlib.util.spec_from_file_location("host_malloc", sys.argv[1])
    hm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hm)

    def rss():
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) // 1024

    assert hm.tune_host_malloc()
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(1 << 20) for _ in range(256)]  # 256 MiB on the heap (tuned: < 32 MiB each)
    for b in blocks:
        ctypes.memset(b, 1, 1 << 20)
    for b in blocks[:-1]:  # the last stays: the heap's top cannot simply shrink
        libc.free(b)
    freed = rss()
    released = hm.release_free_heap()
    print(released, freed, rss())
""")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc_trim")
def test_release_free_heap_hands_freed_blocks_back_to_the_kernel():
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE,
                          str(REPO / "src" / "llmforge" / "host_malloc.py")],
                         capture_output=True, text=True, check=True, env={"PATH": ""})
    released, freed, after = out.stdout.split()
    # tuned (trim threshold 1 GiB), the 255 freed MiB stay resident until released: the
    # tokenizer's freed heap sat under the whole run's peak this way (issue 30)
    assert released == "True"
    assert int(freed) - int(after) > 200, (freed, after)


def test_the_module_releases_the_data_path_heap_then_tunes_at_setup(monkeypatch):
    """Lightning runs LLMModule.setup after the data module's setup (the corpus tokenized) and
    before configure_model: the freed heap goes back first, then the allocator is tuned."""
    from omegaconf import OmegaConf

    from llmforge.config.schema import TrainConfig
    from llmforge.config.validate import plan_batch
    from llmforge.training import module as module_mod

    calls = []
    monkeypatch.setattr(module_mod, "release_free_heap", lambda: calls.append("release"))
    monkeypatch.setattr(module_mod, "tune_host_malloc", lambda: calls.append("tune"))
    cfg = OmegaConf.structured(TrainConfig)
    for tuning, expected in ((True, ["release", "tune"]), (False, ["release"])):
        calls.clear()
        cfg.trainer.malloc_tuning = tuning
        module_mod.LLMModule(cfg, plan_batch(cfg, 1)).setup("fit")
        assert calls == expected
