"""GPU kinds as data: memory, peak FLOP/s and bandwidths of the accelerators the planner knows.

Every figure is the vendor's published one (``source`` of each row); "dense" FLOP/s are without
2:4 sparsity. Bandwidths are per GPU and one direction, in bytes/s: ``intra_node_bw`` over
NVLink / Infinity Fabric (half the bidirectional figure vendors print), ``inter_node_bw`` the
GPU's own network port (400 Gb/s = 50 GB/s per GPU on the reference DGX/HGX/MI300X platforms,
200 Gb/s on DGX A100). Memory is the marketed capacity in GB read as 10^9 bytes (the device
reports a little more; the difference is left as headroom).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from llmforge.errors import ConfigError

G = 1e9
T = 1e12


@dataclass(frozen=True)
class GPUKind:
    """One accelerator model.

    Attributes:
        name: the key ``--gpu`` takes.
        memory_bytes: device memory, bytes.
        bf16_flops: dense bf16 peak, FLOP/s.
        fp8_flops: dense fp8 peak, FLOP/s (0: no fp8 units).
        intra_node_bw: per-GPU, one direction, bytes/s inside a node.
        inter_node_bw: per-GPU, one direction, bytes/s between nodes.
        gpus_per_node: GPUs in one node of the reference platform.
        source: where the figures come from.
        memory_bw: device memory (HBM) bandwidth, bytes/s.
    """

    name: str
    memory_bytes: float
    bf16_flops: float
    fp8_flops: float
    intra_node_bw: float
    inter_node_bw: float
    gpus_per_node: int
    source: str
    memory_bw: float

    def as_dict(self) -> dict:
        return asdict(self)


GPU_KINDS: dict[str, GPUKind] = {g.name: g for g in (
    GPUKind("H100-SXM-80GB", 80 * G, 989 * T, 1979 * T, 450 * G, 50 * G, 8,
            "NVIDIA H100 Tensor Core GPU datasheet (SXM: 80 GB HBM3, BF16 1,979 / FP8 3,958 TFLOPS "
            "with sparsity, halved for dense; NVLink 900 GB/s); DGX H100 user guide (8 GPUs, "
            "8x ConnectX-7 400 Gb/s); HBM3 3.35 TB/s", memory_bw=3.35 * T),
    GPUKind("H100-96GB-500W", 96 * G, 989 * T, 1979 * T, 450 * G, 50 * G, 8,
            "the power-limited H100 of Meta's Grand Teton hosts that torchtitan's benchmarks ran on "
            "(pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md: 96 GB HBM2e, 500 W, "
            "400 Gb/s per GPU; its peak is between SXM and NVL and not published: the SXM figures "
            "here, the step-time model's power_limited_clock scales them; 2.4 TB/s of HBM2e bandwidth, ibid.)",
            memory_bw=2.4 * T),
    GPUKind("H200-141GB", 141 * G, 989 * T, 1979 * T, 450 * G, 50 * G, 8,
            "NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB HBM3e, BF16 1,979 / FP8 3,958 TFLOPS "
            "with sparsity, halved for dense; NVLink 900 GB/s); HGX H200 8-GPU with 400 Gb/s per GPU; HBM3e 4.8 TB/s",
            memory_bw=4.8 * T),
    GPUKind("B200", 180 * G, 2250 * T, 4500 * T, 900 * G, 50 * G, 8,
            "NVIDIA HGX B200 datasheet (per GPU: 180 GB HBM3e, BF16 4.5 / FP8 9 PFLOPS with "
            "sparsity, halved for dense; NVLink 5 1.8 TB/s); DGX B200 (8 GPUs, 8x ConnectX-7 400 Gb/s); HBM3e 8 TB/s",
            memory_bw=8.0 * T),
    GPUKind("MI300X-192GB", 192 * G, 1307.4 * T, 2614.9 * T, 448 * G, 50 * G, 8,
            "AMD Instinct MI300X datasheet (192 GB HBM3, BF16 1,307.4 / FP8 2,614.9 TFLOPS dense; "
            "7 Infinity Fabric links, 896 GB/s aggregate bidirectional); 8-GPU OAM platform, "
            "400 Gb/s NIC per GPU; HBM3 5.3 TB/s", memory_bw=5.3 * T),
    GPUKind("A100-SXM-80GB", 80 * G, 312 * T, 0.0, 300 * G, 25 * G, 8,
            "NVIDIA A100 Tensor Core GPU datasheet (SXM 80 GB HBM2e, BF16 312 TFLOPS dense, no FP8; "
            "NVLink 600 GB/s); DGX A100 (8 GPUs, 8x 200 Gb/s HDR InfiniBand); HBM2e 2,039 GB/s",
            memory_bw=2.039 * T),
)}

ALIASES = {"h100": "H100-SXM-80GB", "h200": "H200-141GB", "b200": "B200", "mi300x": "MI300X-192GB",
           "a100": "A100-SXM-80GB"}


def gpu_kind(name: str, key: str = "--gpu") -> GPUKind:
    """The row of ``name`` (a table name or a short alias such as ``h100``, any case).

    Raises:
        ConfigError: unknown name; the message lists the known ones.
    """
    if name in GPU_KINDS:
        return GPU_KINDS[name]
    low = name.lower()
    for known in GPU_KINDS:
        if known.lower() == low:
            return GPU_KINDS[known]
    if low in ALIASES:
        return GPU_KINDS[ALIASES[low]]
    raise ConfigError(f"{key}: unknown GPU kind '{name}'; known: {', '.join(GPU_KINDS)} "
                      f"(or {', '.join(ALIASES)})")


# words in a cluster's gpu type -> the row; the memory size tells the 40 GB A100 apart
_TYPE_WORDS = (("mi300x", "MI300X-192GB"), ("b200", "B200"), ("h200", "H200-141GB"),
               ("h100", "H100-SXM-80GB"), ("a100", "A100-SXM-80GB"))


def gpu_kind_of_type(gpu_type: str, key: str) -> GPUKind:
    """The row of a cluster's GPU type as clusters spell it: ``h100`` (SLURM gres), ``H100``,
    ``A100-80GB`` (SkyPilot accelerator, SageMaker instance table), ``NVIDIA H100 80GB HBM3``
    (``torch.cuda.get_device_name``), or a table name.

    Raises:
        ConfigError: a type that names no known row (``key`` names where it came from, e.g.
            ``cluster 'big'.gpu_type``); the message lists the known ones.
    """
    low = gpu_type.lower().replace(" ", "").replace("_", "-")
    if gpu_type in GPU_KINDS or low in ALIASES:
        return gpu_kind(gpu_type, key)
    for word, row in _TYPE_WORDS:
        if word in low and not (word == "a100" and "40g" in low):
            return GPU_KINDS[row]
    raise ConfigError(f"{key}: unknown GPU kind '{gpu_type}'; known: {', '.join(GPU_KINDS)} "
                      f"(or {', '.join(ALIASES)}); pass --gpu NAME to plan for one of them")
