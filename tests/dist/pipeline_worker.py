"""Run under torchrun (gloo): pipeline parallelism against a one-process reference.

Every rank trains the same tiny fp32 Llama (dim 32, 4 blocks (8 on 4 ranks but TP x PP), vocab
64, seq 16) for STEPS AdamW steps, with gradient clipping, once in one process (the reference,
computed on every rank; one per set of algorithms that changes the training, ``REFERENCES``,
and per depth) and once per layout in
``LAYOUTS[world size]`` over all ranks (with the layout's algorithms: their model transforms, e.g.
activation checkpointing, compile, float8, LoRA, and their event handlers, e.g. z-loss, EMA,
the loss-spike guard; ``packed``: packed SFT rows with document ids; ``moe``: a tiny Qwen3-MoE,
``MOE``, on right-padded SFT rows whose padding its routers leave out); writes ``<out>/rank<R>.json`` with each layout's losses, gradient norms, plugin and
auxiliary metrics and its reference's. tests/test_pipeline.py reads them.

On 4 ranks the FSDP2 x PP (2 x 2) run also saves a checkpoint after step 3 (the checkpoint
callback's own ``save_checkpoint``, flattened optimizer state), and the ``resume_*`` layouts load
it at ``pp=4`` (1F1B), with FSDP2 over 4 ranks (no pp) and in one process, then run steps 4-5.
"""

import json
import sys
import time

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from llmforge.algorithms.chunked_cross_entropy import ChunkedCrossEntropy
from llmforge.algorithms.loading import build_algorithms
from llmforge.checkpoint.dcp import load_training_state, save_checkpoint
from llmforge.config.schema import TrainConfig, model_config_class
from llmforge.config.validate import plan_batch
from llmforge.errors import ConfigError
from llmforge.events import Event
from llmforge.parallel.mesh import ParallelDims, build_mesh
from llmforge.parallel.transforms import strategy_transforms
from llmforge.training.module import LLMModule
from llmforge.training.optim import build_optimizer

STEPS = 5
SAVE_AT = 3
# z-loss on the last stage, an EMA per stage and a spike guard tight enough to skip steps
# (min_history 2, grad-norm spikes over 1.2 x the median): its decision must be the same on all stages
ALGOS = [{"name": "z_loss"}, {"name": "ema", "decay": 0.5},
         {"name": "loss_spike_guard", "factor": 1.2, "min_history": 2, "metric": "grad_norm", "max_skips": 6}]
EVENTS_UNDER_TEST = {a["name"] for a in ALGOS}
REFERENCES = {"plain": [], "algos": ALGOS,
              "float8": [{"name": "float8", "emulate": True}],
              "lora": [{"name": "lora", "base_dtype": "float32", "targets": ["wq", "wv", "w2", "output"]}],
              "packed": [],  # packed SFT rows: dict batches with doc_ids (see packed_rows)
              "moe": []}  # the tiny Qwen3-MoE (MOE): router losses and load-free balancing on
MOE = {"name": "qwen3_moe", "dim": 32, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "hidden_dim": 64,
       "vocab_size": 64, "max_seq_len": 16, "num_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 16, "router_aux_loss_coef": 0.05, "router_z_loss_coef": 0.001,
       "mlp_only_layers": [1], "router_bias_update_rate": 0.01, "tie_embeddings": False,
       "capacity_factor": 1.0}  # drops some assignments: stages of 1 and 2 sparse layers pool them
LAYOUTS = {
    2: {"1f1b": {"strategy.pp": 2},
        "gpipe": {"strategy.pp": 2, "pipeline.schedule": "gpipe"},
        "interleaved_1f1b": {"strategy.pp": 2, "pipeline.schedule": "interleaved_1f1b",
                             "pipeline.stages_per_rank": 2},
        "zbv": {"strategy.pp": 2, "pipeline.schedule": "zbv"},
        "dualpipev": {"strategy.pp": 2, "pipeline.schedule": "dualpipev"},
        "lighter_ends_m2": {"strategy.pp": 2, "pipeline.split": "lighter_ends", "pipeline.microbatches": 2},
        # per-stage model transforms: activation checkpointing and compile of each block
        # (aot_eager: dynamo + AOTAutograd without inductor's minute of C++ compiling)
        "ac_full": {"strategy.pp": 2, "algorithms": [{"name": "activation_checkpointing"}]},
        "compile_aot_eager": {"strategy.pp": 2, "algorithms": [{"name": "compile", "backend": "aot_eager"}]},
        "algos": {"strategy.pp": 2, "ref": "algos"},
        "float8": {"strategy.pp": 2, "ref": "float8"},
        "lora": {"strategy.pp": 2, "ref": "lora"},
        # document ids reach every stage (2 per rank) through the schedule's keyword tensors
        "packed_sft": {"strategy.pp": 2, "pipeline.schedule": "interleaved_1f1b", "ref": "packed"},
        # router statistics ride with the hidden states (aux_carry); block 1 is dense, so with
        # 4 stages of one block the second stage adds nothing to them
        "moe_1f1b": {"strategy.pp": 2, "ref": "moe"},
        "moe_interleaved": {"strategy.pp": 2, "pipeline.schedule": "interleaved_1f1b", "ref": "moe"}},
    # pp=4 with 1F1B is resume_pp4 (steps 4-5 from the FSDP2 x PP checkpoint)
    4: {"pp4_interleaved": {"strategy.pp": 4, "pipeline.schedule": "interleaved_1f1b"},
        "fsdp2_x_pp2": {"strategy.pp": 2, "strategy.name": "fsdp2", "save": True},
        "tp2_x_pp2": {"strategy.pp": 2, "strategy.tp": 2, "model.n_layers": 4},  # DTensor ops: the dearest
        "resume_pp4": {"strategy.pp": 4, "resume": True},
        "resume_fsdp4": {"strategy.name": "fsdp2", "resume": True},
        "resume_pp1": {"resume": True, "one_process": True},
        "moe_ep2_x_pp2": {"strategy.pp": 2, "strategy.name": "fsdp2", "strategy.ep": 2, "ref": "moe"}},
}


def make_cfg(overrides, n_layers, moe=False):
    cfg = OmegaConf.structured(TrainConfig)
    if moe:
        cfg.model = OmegaConf.merge(OmegaConf.structured(model_config_class("qwen3_moe")),
                                    {**MOE, "n_layers": n_layers})
    else:
        cfg.model.merge_with({"dim": 32, "n_layers": n_layers, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 64,
                              "multiple_of": 16, "max_seq_len": 16})
    cfg.trainer.merge_with({"micro_batch_size": 2, "global_batch_size": 8, "seq_len": 16,
                            "gradient_clip_val": 0.5})
    cfg.optimizer.merge_with({"lr": 1e-2, "eps": 1e-6})
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def train(mod, cfg, batches, dp_rank, dp, opt=None, first_step=1, save_to=None):
    """The optimizer steps of ``LLMModule.training_step`` without Lightning: forward/backward,
    clip, ``BEFORE_OPTIMIZER_STEP`` (plugins' metrics, skip decision; under pp agreed by the
    stages), step or skip, ``AFTER_OPTIMIZER_STEP``. Returns (losses, norms, plugin metrics)."""
    opt = opt or build_optimizer(mod.model, cfg.optimizer)
    st = mod.state
    losses, norms, extra = [], [], []
    rows = len(batches[0]["labels"] if isinstance(batches[0], dict) else batches[0]) // dp
    for step, batch in enumerate(batches, first_step):
        st.step, st.skip_step, st.metrics = step, False, {}
        mod.step_metrics = st.metrics
        part = slice(dp_rank * rows, (dp_rank + 1) * rows)
        batch = {k: v[part] for k, v in batch.items()} if isinstance(batch, dict) else batch[part]
        loss, n = mod.forward_backward(batch)
        st.grad_norm = mod.clip_gradients_(opt)
        st.metrics.update({"train/loss": mod.dp_all_reduce(loss) / n, "train/grad_norm": st.grad_norm})
        aux = mod.step.aux_step_metrics(n)  # the router losses and the expert load
        st.metrics.update(aux)
        computed = set(st.metrics)
        mod.event(Event.BEFORE_OPTIMIZER_STEP)
        if mod.pp_schedule is not None:
            mod.step.agree_on_step(set(st.metrics) - computed, set(aux))
        if not st.skip_step:
            opt.step()
            mod.step.model_after_optimizer_step()  # loss-free balancing: each stage's own routers
        opt.zero_grad(set_to_none=True)
        mod.event(Event.AFTER_OPTIMIZER_STEP)
        losses.append(float(st.metrics["train/loss"]))
        norms.append(float(st.grad_norm))
        extra.append({k: float(v) for k, v in st.metrics.items() if k not in ("train/loss", "train/grad_norm")})
        if save_to is not None and step == SAVE_AT:
            save_checkpoint(save_to, step, mod.model, opt, {"step": step}, {}, flatten_optimizer=True)
    return losses, norms, extra


def build(overrides, n_layers, world, moe=False):
    """(module with the layout's model transforms and event handlers, its algorithms, cfg)."""
    cfg = make_cfg(overrides, n_layers, moe)
    cfg.trainer.devices = world  # the algorithms' checks read the world size here
    algos = build_algorithms(cfg)
    pipeline = [t for t in (a.transform() for a in algos) if t is not None]
    if world == 1:
        mod = LLMModule(cfg, plan_batch(cfg, 1), pipeline=pipeline)
    else:
        dims = ParallelDims.from_config(cfg, world)
        mod = LLMModule(cfg, plan_batch(cfg, world), pipeline=pipeline + strategy_transforms(cfg, dims))
        mod.mesh_override = build_mesh(dims, "cpu")
    mod.configure_model()
    # the event handlers under test; the others' (compile, float8, lora) report to a Lightning trainer
    mod.setup_events([a for a in algos if a.name in EVENTS_UNDER_TEST])
    mod.event(Event.BEFORE_LOAD)  # the EMA starts at the initial weights
    return mod, algos, cfg


def ema_of(algos):
    """The EMA plugin's average as full tensors, by parameter name ({} without an EMA)."""
    ema = next((a for a in algos if a.name == "ema"), None)
    if ema is None:
        return {}
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in ema.shadow.items()}


def eval_loss(mod, batch):
    """Mean loss per target of ``batch`` (windows) after training: one process's forward, or
    the schedule's forward-only ``eval`` (every stage; the V schedules' forwards alone)."""
    x, y = batch[:, :-1], batch[:, 1:]
    mod.state.training = False  # no auxiliary losses: the pure cross-entropy, as in evaluation
    with torch.no_grad():
        if mod.pp_schedule is None:  # in micro-batches, as the schedule splits it (float8 scales
            mb = mod.plan.micro_batch_size  # per tensor: the rows taken together matter)
            sums = [mod.compute_loss(mod(x[i:i + mb]), y[i:i + mb]) for i in range(0, len(x), mb)]
            return (sum(s[0] for s in sums) / sum(s[1] for s in sums)).item()
        mod.step.run_schedule(x, y, train=False)
        return (mod.step.pp_all_reduce(mod.step.loss_sum) / mod.step.pp_all_reduce(mod.step.target_count.float())).item()


def packed_rows(batches):
    """Each window as a packed SFT row: 2-4 documents (``doc_ids``), no target on each
    document's first token (where a real packed row's prompt would be)."""
    out = []
    for b in batches:
        g = torch.Generator().manual_seed(int(b.sum()))
        doc_ids = torch.cumsum(torch.rand(b.shape[0], b.shape[1] - 1, generator=g) < 0.2, dim=1)
        labels = b[:, 1:].clone()
        labels[:, 1:][doc_ids[:, 1:] != doc_ids[:, :-1]] = -100
        out.append({"input_ids": b[:, :-1], "labels": labels, "doc_ids": doc_ids})
    return out


def padded_rows(batches):
    """Each window as a right-padded SFT row (the MoE layouts): row r keeps 16 - 2 * (r % 4)
    real tokens (``token_mask``); padding has id 0 and label -100 and no router counts it."""
    out = []
    for b in batches:
        inputs, labels = b[:, :-1].clone(), b[:, 1:].clone()
        real = torch.arange(16)[None, :] < (16 - 2 * (torch.arange(len(b)) % 4))[:, None]
        inputs[~real], labels[~real] = 0, -100
        out.append({"input_ids": inputs, "labels": labels, "token_mask": real})
    return out


def main(out):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    batches = [torch.randint(0, 64, (8, 17)) for _ in range(STEPS)]
    n_layers = 4 if world == 2 else 8  # pp 4 x 2 virtual stages: 8 blocks

    def ref_of(spec):  # (reference name, its algorithms, its blocks)
        ref, n = spec.get("ref", "plain"), spec.get("model.n_layers", n_layers)
        return (ref if n == n_layers else f"{ref}_{n}_blocks"), REFERENCES[ref], n

    report, ref_ema = {"seconds": {}}, {}
    refs = {ref_of(spec)[0]: ref_of(spec)[1:] for spec in LAYOUTS[world].values()}
    packed, padded = packed_rows(batches), padded_rows(batches)
    data_of = {"packed": packed, "moe": padded}
    for ref, (algorithms, n) in sorted(refs.items()):
        mod, algos, cfg = build({"algorithms": algorithms}, n, 1, ref.startswith("moe"))
        report["ref_" + ref] = train(mod, cfg, data_of.get(ref, batches), 0, 1)
        report["ref_eval_" + ref] = eval_loss(mod, batches[0])
        ref_ema[ref] = ema_of(algos)
    ckpt = f"{out}/ckpt"
    for name, spec in LAYOUTS[world].items():
        start = time.perf_counter()
        spec = dict(spec)
        ref, algorithms, n = ref_of(spec)
        spec.pop("ref", None)
        resume, save, one = spec.pop("resume", False), spec.pop("save", False), spec.pop("one_process", False)
        mod, algos, cfg = build({**spec, "algorithms": spec.get("algorithms", algorithms)}, n, 1 if one else world,
                                ref.startswith("moe"))
        dp = mod.mesh["dp"] if mod.mesh is not None else None
        dp_rank, dp_size = (dp.get_local_rank(), dp.size()) if dp is not None else (0, 1)
        opt, first = build_optimizer(mod.model, cfg.optimizer), 1
        if resume:
            load_training_state(f"{ckpt}/step_{SAVE_AT:08d}", mod.model, opt)
            first = SAVE_AT + 1
        data = data_of.get(ref, batches)
        report[name] = train(mod, cfg, data[first - 1:], dp_rank, dp_size, opt, first,
                             ckpt if save else None)
        report[name + "_ref"] = ref
        if world == 2:  # one data-parallel rank: the schedule's micro-batches take the whole batch
            report[name + "_eval"] = eval_loss(mod, batches[0])
        report[name + "_keys"] = sorted(mod.model.state_dict())
        ema = ema_of(algos)
        if ema:  # this rank's stage's average against the one-process run's
            report[name + "_ema"] = {"names": len(ema), "of": len(ref_ema[ref]), "max_diff": max(
                (v - ref_ema[ref][k]).abs().max().item() for k, v in ema.items())}
        if name == "1f1b":  # the fit-start check of the real pipeline step (no handlers here)
            try:
                mod.setup_events([ChunkedCrossEntropy()])
                report["refusal"] = None
            except ConfigError as exc:
                report["refusal"] = [str(exc), exc.exit_code]
            mod.setup_events([])
        report["seconds"][name] = time.perf_counter() - start
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
