"""Peak dense TFLOPs per device, for MFU (model FLOPs utilization).

Values are the vendors' dense (no 2:4 sparsity) tensor-core peaks per device, in TFLOPs
(10^12 FLOP/s), for bf16 and fp8 inputs:

| device (matched in ``torch.cuda.get_device_name()``) | bf16 | fp8 |
| --- | --- | --- |
| A100 (SXM and PCIe) | 312 | — (no fp8 units) |
| H100 SXM (``H100`` without PCIe/NVL) | 989.4 | 1978.9 |
| H100 PCIe | 756 | 1513 |
| H100 NVL / H200 NVL | 835 | 1671 |
| H200 (SXM), GH200 | 989.4 | 1978.9 |
| B200 | 2250 | 4500 |
| GB200 | 2500 | 5000 |
| AMD MI300X, MI325X | 1307.4 | 2614.9 |

Any other device (the CPU, other GPUs) has no entry: give ``peak_tflops`` to the speed monitor.
"""

from __future__ import annotations

from typing import Optional

# (all of these substrings, upper case) -> (bf16, fp8) dense TFLOPs; the first match wins.
PEAK_TFLOPS: list[tuple[tuple[str, ...], float, Optional[float]]] = [
    (("GB200",), 2500.0, 5000.0),
    (("B200",), 2250.0, 4500.0),
    (("H100", "NVL"), 835.0, 1671.0),
    (("H100", "PCIE"), 756.0, 1513.0),
    (("H100",), 989.4, 1978.9),
    (("H200", "NVL"), 835.0, 1671.0),
    (("H200",), 989.4, 1978.9),
    (("A100",), 312.0, None),
    (("MI300X",), 1307.4, 2614.9),
    (("MI325X",), 1307.4, 2614.9),
]

PRECISIONS = ("bf16", "fp8")


def peak_tflops(device_name: str, precision: str = "bf16") -> Optional[tuple[float, str]]:
    """``(TFLOPs, precision used)`` for a device name such as ``"NVIDIA H100 80GB HBM3"``.

    ``precision`` is ``bf16`` or ``fp8``; a device without fp8 units (A100) answers its bf16
    peak and says ``bf16``. ``None`` for a device not in the table.

    Raises:
        ValueError: ``precision`` is not ``bf16`` or ``fp8``.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    name = device_name.upper()
    for needles, bf16, fp8 in PEAK_TFLOPS:
        if all(n in name for n in needles):
            if precision == "fp8" and fp8 is not None:
                return fp8, "fp8"
            return bf16, "bf16"
    return None
