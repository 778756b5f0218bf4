"""Norm layers exported to ONNX (``torch.onnx.export(..., dynamo=True)``), run in onnxruntime.

What a deployment sees: the operators each exported layer becomes, their time in
onnxruntime on this machine's CPU (one thread, median of the repeats; every session in
one process, ratios to torch's exported layer), and their error at an offset against
the same layer's float64 eager output. Three exports per layer: torch.nn's, normkit's
(``backend="auto"``) and normkit's reference math (``backend="reference"``, what
normkit recorded for inference BatchNorm before it recorded torch's ``batch_norm``).

Needs ``onnx``, ``onnxscript`` and ``onnxruntime`` (not normkit dependencies)::

    pip install onnx onnxscript onnxruntime
    PYTHONPATH=src python benchmarks/onnx_export.py [--repeats 15]

The figures are for reading, not asserting: one machine, one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np
import torch
from torch import nn

import normkit

LAYERS = (  # (title, torch's layer, normkit's layer class and arguments, input shape)
    ("LayerNorm", lambda: nn.LayerNorm(768), (normkit.LayerNorm, (768,)), (8, 512, 768)),
    ("RMSNorm", lambda: nn.RMSNorm(768), (normkit.RMSNorm, (768,)), (8, 512, 768)),
    ("BatchNorm2d eval", lambda: nn.BatchNorm2d(64), (normkit.BatchNorm2d, (64,)),
     (8, 64, 56, 56)),
    ("GroupNorm", lambda: nn.GroupNorm(32, 64), (normkit.GroupNorm, (32, 64)),
     (8, 64, 56, 56)),
)
OFFSETS = (0.0, 1e2, 1e4)


def _session(module, x, ort):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, (x,), dynamo=True, verbose=False)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    ops = sorted({node.op_type for node in program.model_proto.graph.node})
    session = ort.InferenceSession(program.model_proto.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return session, ops


def _run(session, x):
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


def _median_ms(session, x, repeats):
    _run(session, x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _run(session, x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    try:
        import onnxruntime as ort
    except ImportError as error:
        raise SystemExit(f"needs onnx, onnxscript and onnxruntime: {error}") from error
    torch.manual_seed(0)
    print("| layer | shape | exported from | ONNX operators | ms | torch's / this | "
          + " | ".join(f"error at offset {o:g}" for o in OFFSETS) + " |")
    print("|---|---|---|---|---:|---:|" + "---:|" * len(OFFSETS))
    for title, make_torch, (cls, cargs), shape in LAYERS:
        layers = {"torch.nn": make_torch(), "normkit": cls(*cargs),
                  'normkit backend="reference"': cls(*cargs, backend="reference")}
        gen = torch.Generator().manual_seed(1)
        for layer in layers.values():
            layer.eval()
            if getattr(layer, "running_mean", None) is not None:
                with torch.no_grad():
                    layer.running_mean.copy_(torch.randn(shape[1], generator=gen))
                    layer.running_var.copy_(torch.rand(shape[1], generator=gen) + 0.5)
        x = torch.randn(*shape, generator=gen)
        baseline = None
        for name, layer in layers.items():
            session, ops = _session(layer, x, ort)
            ms = _median_ms(session, x, args.repeats)
            baseline = ms if baseline is None else baseline
            errors = []
            for offset in OFFSETS:
                shifted = x + offset
                with torch.no_grad():
                    want = layer.double()(shifted.double()).numpy()
                layer.float()
                errors.append(float(np.abs(_run(session, shifted) - want).max()))
            print(f"| {title} | {'x'.join(map(str, shape))} | {name} | {', '.join(ops)} | "
                  f"{ms:.2f} | {baseline / ms:.2f}x | "
                  + " | ".join(f"{e:.1e}" for e in errors) + " |", flush=True)


if __name__ == "__main__":
    main()
