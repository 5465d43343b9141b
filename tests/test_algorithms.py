"""Algorithm plugins without training: registry, checks, pipeline order, module structure,
activation memory, the float8 filter."""

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from algo_harness import activation_bytes, fingerprint, make_cfg
from conftest import DEMO, REPO
from llmforge import registry
from llmforge.algorithms import ActivationCheckpointing, Algorithm, Compile, Float8, Stage
from llmforge.parallel.mesh import ParallelDims
from llmforge.plugin import ModelContext, run_pipeline
from llmforge.algorithms.loading import available, build_algorithms
from llmforge.cli import main
from llmforge.errors import ConfigError
from llmforge.models.llama3.model import Llama, LlamaArgs


def meta_model(**kw) -> nn.Module:
    args = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32,
                max_seq_len=32)
    with torch.device("meta"):
        return Llama(LlamaArgs(**{**args, **kw}))


def pipeline_of(entries, model=None):
    cfg = make_cfg(entries)
    algos = build_algorithms(cfg)
    model = model or meta_model()
    transforms = [a.transform() for a in algos]
    return run_pipeline(model, transforms, ModelContext(cfg, None, None, "cpu")), algos


def test_builtins_registered_and_listed(capsys):
    assert {"compile", "activation_checkpointing", "float8"} <= set(registry.algorithms.names())
    rows = {name: (stage, summary) for name, stage, summary in available()}
    assert rows["float8"][0] == "convert" and rows["compile"][0] == "compile"
    assert rows["activation_checkpointing"][0] == "activation_checkpointing"
    assert main(["algorithms"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.split()[:2] == ["float8", "convert"] for line in lines)
    assert any(line.split()[:2] == ["compile", "compile"] for line in lines)


def test_import_path_and_bad_keys():
    cfg = make_cfg([{"name": "llmforge.algorithms.Compile", "per_block": False}])
    (algo,) = build_algorithms(cfg)
    assert isinstance(algo, Compile) and not algo.per_block
    with pytest.raises(ConfigError, match=r"algorithms\[0\] \(compile\).*per_blok"):
        build_algorithms(make_cfg([{"name": "compile", "per_blok": False}]))
    with pytest.raises(ConfigError, match="not a subclass of llmforge.plugin.Algorithm"):
        build_algorithms(make_cfg([{"name": "llmforge.callbacks.SpeedMonitor"}]))


@pytest.mark.parametrize("entries, overrides, words", [
    ([{"name": "compile"}, {"name": "float8"}, {"name": "compile", "mode": "max-autotune"}], {},
     ["algorithms[0] (compile)", "algorithms[2] (compile)"]),
    ([{"name": "float8", "enable_fsdp_float8_all_gather": True}],
     {"strategy.name": "ddp", "trainer.devices": 2},
     ["float8.enable_fsdp_float8_all_gather", "strategy.name=ddp"]),
    ([{"name": "float8", "fsdp_float8_all_gather": True}], {},
     ["float8.enable_fsdp_float8_all_gather", "strategy.dp_shard"]),
    ([{"name": "float8", "recipe": "rowwise", "enable_fsdp_float8_all_gather": True}],
     {"strategy.name": "fsdp2"}, ["float8.recipe=rowwise", "enable_fsdp_float8_all_gather"]),
    ([{"name": "float8", "precompute_float8_dynamic_scale_for_fsdp": True}], {},
     ["precompute_float8_dynamic_scale_for_fsdp", "enable_fsdp_float8_all_gather"]),
    ([{"name": "float8", "modules": ["attention"]}], {"model.dim": 48},
     ["float8.modules", "layers.0.attention.wk", "48 -> 24", "16"]),
    ([{"name": "float8", "filter_fqns": ["output", "lm_head"]}], {},
     ["float8.filter_fqns entry 'lm_head' matches no module", "closest module names: output, w1"]),
    ([{"name": "float8", "modules": ["feed_forwrd"]}], {},
     ["float8.modules entry 'feed_forwrd'", "closest module names: feed_forward"]),
    # a string would be read letter by letter, each letter matching nearly every layer
    ([{"name": "float8", "filter_fqns": "output"}], {}, ["float8.filter_fqns must be a list", "'output'"]),
    ([{"name": "float8", "modules": [["feed_forward"]]}], {}, ["float8.modules must be a list"]),
    ([{"name": "float8", "filter_fqns": [None]}], {}, ["float8.filter_fqns must be a list", "[None]"]),
    ([{"name": "float8", "modules": []}], {}, ["float8.modules [] leaves no Linear layer to convert"]),
    ([{"name": "float8", "modules": ["output"]}], {},
     ["float8.modules ['output'] leaves no", "filter_fqns ['output']"]),
    ([{"name": "compile", "per_block": False}], {"strategy.name": "fsdp2", "trainer.devices": 2},
     ["compile.per_block=false", "compile.fullgraph=true", "strategy.name=fsdp2"]),
    ([{"name": "activation_checkpointing", "mode": "some"}], {}, ["activation_checkpointing.mode"]),
])
def test_impossible_combinations_are_config_errors(entries, overrides, words):
    cfg = make_cfg(entries)
    for k, v in overrides.items():
        section, key = k.split(".")
        cfg[section][key] = v
    with pytest.raises(ConfigError) as err:
        build_algorithms(cfg)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_fp8_all_gather_accepted_under_fsdp2_on_two_ranks():
    cfg = make_cfg([{"name": "float8", "enable_fsdp_float8_all_gather": True}])
    cfg.trainer.devices = 2
    (algo,) = build_algorithms(cfg)
    assert algo.all_gather and algo.precompute


def test_impossible_combination_fails_fast_through_the_cli(tmp_path, capsys):
    """`llmforge train` (in this process: the exit code and message are the point)."""
    code = main(["train", DEMO, f"run.output_dir={tmp_path}",
                 "algorithms=[{name: activation_checkpointing}, {name: compile},"
                 " {name: activation_checkpointing, mode: selective}]"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "algorithms[0] (activation_checkpointing) and algorithms[2] (activation_checkpointing)" in err
    assert not (tmp_path / "demo_cpu").exists()  # nothing was built
    code = main(["train", DEMO, f"run.output_dir={tmp_path}", "--nproc", "2", "strategy.name=ddp",
                 "algorithms=[{name: float8, enable_fsdp_float8_all_gather: true}]"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "float8.enable_fsdp_float8_all_gather" in err and "strategy.name=ddp" in err


def test_yaml_order_does_not_change_the_structure():
    entries = [{"name": "compile", "per_block": True}, {"name": "float8"},
               {"name": "activation_checkpointing", "mode": "selective", "selective": "op"}]
    a, _ = pipeline_of(entries)
    b, _ = pipeline_of(list(reversed(entries)))
    assert fingerprint(a) == fingerprint(b)
    assert repr(a) == repr(b)
    kinds = dict((path, kind) for path, kind, _ in fingerprint(a))
    assert kinds["layers.0"] == "CheckpointWrapper"  # float8 first, then AC wraps, then compile
    assert kinds["layers.0._checkpoint_wrapped_module.attention.wq"] == "Float8Linear"
    compiled = [path for path, _, c in fingerprint(a) if c]
    assert compiled == ["layers.0", "layers.1", "norm"]  # the blocks and the final norm


def test_per_block_compile_also_compiles_the_final_norm():
    """The final norm sits outside the blocks: per-block compile compiles it too (a
    ``decoder.RMSNorm``, whose forward dynamo can start in), and nothing else of the root."""
    from llmforge.algorithms.compile import Compile
    from llmforge.models.llama3.model import Llama, LlamaArgs

    def build():
        return Llama(LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                               multiple_of=16, max_seq_len=16))

    def compiled(model):
        return [n for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None)]

    model = build()
    Compile(per_block=True).apply(model, None)
    assert compiled(model) == ["layers.0", "layers.1", "norm"]
    # auto (the default): the whole model in one process, each block with a mesh, several
    # processes or a data-parallel strategy (their hooks on every block stop one graph)
    one = ModelContext(cfg=OmegaConf.create({"strategy": {"name": "auto"}}), mesh=None,
                       dims=ParallelDims(1, 1, 1, 1), device=torch.device("cpu"))
    for ctx in (None, one):
        model = build()
        Compile().apply(model, ctx)
        assert compiled(model) == [""], ctx
    for name, dims in (("fsdp2", ParallelDims(1, 1, 1, 1)), ("auto", ParallelDims(1, 2, 1, 2))):
        ctx = ModelContext(cfg=OmegaConf.create({"strategy": {"name": name}}), mesh=None, dims=dims,
                           device=torch.device("cpu"))
        assert Compile().compiles_per_block(ctx) and not Compile(per_block=False).compiles_per_block(ctx)
    with pytest.raises(ConfigError, match=r"compile.per_block 'yes' is not a YAML boolean"):
        Compile(per_block="yes")
    # the loss is compiled where its upcast fuses: bf16/fp16 logits, not fp32 (issue 30)
    assert Compile().compile_loss == "auto"
    assert [Compile().loss_compiled(p) for p in ("32-true", "bf16-mixed", "bf16-true", "16-mixed")] == \
        [False, True, True, True]
    assert Compile(compile_loss=True).loss_compiled("32-true") and not Compile(compile_loss=False).loss_compiled("bf16-mixed")
    for bad in ("yes", "true", 1, None):
        with pytest.raises(ConfigError, match=r"compile.compile_loss .* is not a YAML boolean \(true, false\) or auto"):
            Compile(compile_loss=bad)


def test_wrapping_keeps_blocks_and_state_dict_keys():
    plain = meta_model()
    keys = list(plain.state_dict())
    for entries in ([{"name": "activation_checkpointing"}],
                    [{"name": "activation_checkpointing", "mode": "selective", "every": 2},
                     {"name": "compile"}], [{"name": "compile", "per_block": False}]):
        model, (first, *_) = pipeline_of(entries)
        assert list(model.state_dict()) == keys, entries
        assert model.blocks() == list(model.layers)
        if isinstance(first, ActivationCheckpointing):
            wrapped = [type(b).__name__ for b in model.blocks()]
            want = ["CheckpointWrapper"] * 2 if first.mode == "full" else ["TransformerBlock", "CheckpointWrapper"]
            assert wrapped == want


def test_activation_checkpointing_lowers_activation_memory():
    """Activations dominate at seq 512 (dim 64, 4 blocks, vocab 128): full checkpointing keeps
    each block's input only; selective sits between none and full."""
    tokens = torch.randint(0, 128, (2, 512), generator=torch.Generator().manual_seed(0))
    sizes = {}
    for name, entries in [("none", []), ("full", [{"name": "activation_checkpointing"}]),
                          ("layer", [{"name": "activation_checkpointing", "mode": "selective",
                                      "selective": "layer", "every": 2}]),
                          ("op", [{"name": "activation_checkpointing", "mode": "selective",
                                   "selective": "op"}])]:
        torch.manual_seed(0)
        model = Llama(LlamaArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128,
                                multiple_of=32, max_seq_len=512))
        cfg = make_cfg(entries)
        for algo in build_algorithms(cfg):
            model = algo.apply(model, None)
        sizes[name] = activation_bytes(model, tokens)
    print({k: f"{v / 2**20:.1f} MiB" for k, v in sizes.items()})
    assert sizes["full"] * 2 <= sizes["none"]
    assert sizes["full"] < sizes["layer"] < sizes["none"]
    assert sizes["full"] < sizes["op"] < sizes["none"]


def test_float8_filter_keeps_output_and_unaligned_layers():
    # dim 48, 4 heads of 12, 2 kv heads: wk/wv are 48 -> 24 (not multiples of 16)
    model, (f8,) = pipeline_of([{"name": "float8"}], meta_model(dim=48))
    types = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert types["output"] == "Linear"
    for i in range(2):
        assert types[f"layers.{i}.attention.wk"] == types[f"layers.{i}.attention.wv"] == "Linear"
        for name in ("attention.wq", "attention.wo", "feed_forward.w1", "feed_forward.w2",
                     "feed_forward.w3"):
            assert types[f"layers.{i}.{name}"] == "Float8Linear", name
    assert sorted(f8.kept) == sorted(["output"] + [f"layers.{i}.attention.{w}" for i in range(2)
                                                   for w in ("wk", "wv")])
    # filter_fqns: [] converts the output projection too (256 x 48: multiples of 16)
    model, _ = pipeline_of([{"name": "float8", "filter_fqns": []}], meta_model(dim=48))
    assert type(model.output).__name__ == "Float8Linear"
    # modules: only the feed-forward
    model, _ = pipeline_of([{"name": "float8", "modules": ["feed_forward"]}])
    assert type(model.layers[0].attention.wq).__name__ == "Linear"
    assert type(model.layers[0].feed_forward.w2).__name__ == "Float8Linear"


def test_float8_sets_float8_tp_styles_for_its_layers_only():
    """Under tp > 1 with the tensorwise recipe, float8 hands the TP stage torchao's float8 styles
    (all-gathers in FP8) for the layers it converted, torch's for the rest; an input goes to the
    gather in FP8 only if every layer reading it casts (a kept layer would get FP8 values). The
    gathers themselves run in tests/test_algorithms_train.py (2 processes)."""
    from types import SimpleNamespace

    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel, Float8RowwiseParallel,
                                                        PrepareFloat8ModuleInput)

    from llmforge.algorithms.float8 import Float8TPStyles

    def convert(dims, **kw):
        ctx = ModelContext(None, None, dims, "cpu")
        return Float8(**kw).apply(meta_model(dim=48), ctx), ctx

    model, ctx = convert(SimpleNamespace(tp=2))
    st, attn, ffn = ctx.tp_styles, model.layers[0].attention, model.layers[0].feed_forward
    assert isinstance(st, Float8TPStyles)
    assert type(st.colwise(attn.wq)) is Float8ColwiseParallel and type(st.rowwise(ffn.w2)) is Float8RowwiseParallel
    # wk, wv (48 -> 24) and the output stay in high precision: torch's styles
    assert type(st.colwise(attn.wk)) is ColwiseParallel and type(st.colwise(model.output)) is ColwiseParallel
    assert type(st.prepare_input([ffn.w1, ffn.w3])) is PrepareFloat8ModuleInput
    assert type(st.prepare_input([attn.wq, attn.wk, attn.wv])) is PrepareModuleInput
    assert type(st.rowwise(nn.Linear(32, 32))) is RowwiseParallel
    # one process, the rowwise recipe, or the key set to false: the TP stage keeps torch's
    for dims, kw in ((SimpleNamespace(tp=1), {}), (None, {}), (SimpleNamespace(tp=2), {"recipe": "rowwise"}),
                     (SimpleNamespace(tp=2), {"enable_tp_float8_all_gather": False})):
        assert convert(dims, **kw)[1].tp_styles is None, (dims, kw)
    with pytest.raises(ConfigError, match="enable_tp_float8_all_gather=true needs float8.recipe=tensorwise"):
        Float8(recipe="rowwise", enable_tp_float8_all_gather=True)
    # a quoted YAML value would read as true
    for key in ("enable_tp_float8_all_gather", "enable_fsdp_float8_all_gather", "emulate"):
        with pytest.raises(ConfigError, match=f"float8.{key} must be true or false.*got 'false'"):
            Float8(**{key: "false"})


def test_third_party_algorithm_by_import_path_joins_the_pipeline():
    class Marker(Algorithm):
        name = "marker"
        stage = Stage.CONVERT

        def apply(self, model, ctx):
            model.marked = True
            return model

    registry.algorithms.register("test_marker", Marker)
    model, _ = pipeline_of([{"name": "compile"}, {"name": "test_marker"}])
    assert model.marked and Float8.stage < ActivationCheckpointing.stage < Compile.stage


@pytest.mark.parametrize("page", ["compile.md", "activation_checkpointing.md", "float8.md"])
def test_doc_examples_load_and_check(page, tmp_path):
    """Each page's runnable YAML (``base: yamls/demo_cpu.yaml``) loads and its algorithms check."""
    import re

    from llmforge.config import load_config

    text = (REPO / "docs" / "algorithms" / page).read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "base: yamls/" in b]
    assert blocks, page
    path = tmp_path / "example.yaml"
    path.write_text(blocks[0].replace("base: yamls/", f"base: {REPO}/yamls/"))
    algos = build_algorithms(load_config(path))
    assert algos and algos[0].name == page.removesuffix(".md")


def test_fp8_all_gather_weights_save_as_plain_tensors():
    torch.manual_seed(0)
    model = Llama(LlamaArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256,
                            multiple_of=32, max_seq_len=32))
    model = Float8(enable_fsdp_float8_all_gather=True).apply(model, None)
    wq = model.layers[0].attention.wq.weight
    assert type(wq).__name__ == "WeightWithDynamicFloat8CastTensor"
    sd = model.state_dict()
    assert all(type(v) is torch.Tensor for v in sd.values())
    model.load_state_dict({k: torch.full_like(v, 0.5) for k, v in sd.items()})
    assert type(wq).__name__ == "WeightWithDynamicFloat8CastTensor"
    assert bool((wq._tensor == 0.5).all())
