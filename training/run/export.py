"""The final model exported to ONNX and checked with onnxruntime against PyTorch."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch


def export_onnx(model: torch.nn.Module, sample: torch.Tensor, path: str | Path,
                atol: float = 1e-3, rtol: float = 1e-3) -> dict:
    """Export `model` (eval mode, one input tensor, batch dimension dynamic) to `path` and run the
    file with onnxruntime on `sample` and on a batch of another size; raises ValueError when the
    outputs differ from PyTorch's beyond the tolerance. Returns what was checked."""
    import onnxruntime  # (lazy: onnxruntime)

    model = model.eval()
    dynamic = {0: "batch"} if sample.dim() == 2 and sample.dtype.is_floating_point else {0: "batch", 1: "sequence"}
    with warnings.catch_warnings():
        # The TorchScript exporter: the torch.export one needs onnxscript, which this project does not ship.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(model, (sample,), str(path), input_names=["input"], output_names=["output"],
                          dynamic_axes={"input": dynamic, "output": {0: "batch"}}, dynamo=False)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst = 0.0
    for batch in (sample, torch.cat([sample, sample[:1]])):  # a second batch size: the axis is dynamic
        with torch.no_grad():
            expected = model(batch).float().numpy()
        actual = session.run(None, {"input": batch.numpy()})[0]
        if actual.shape != expected.shape or not np.allclose(actual, expected, atol=atol, rtol=rtol):
            diff = np.abs(actual - expected).max() if actual.shape == expected.shape else float("inf")
            raise ValueError(f"ONNX output differs from PyTorch's (max abs diff {diff:.3g}, shapes "
                             f"{actual.shape} vs {expected.shape}; atol {atol}, rtol {rtol})")
        worst = max(worst, float(np.abs(actual - expected).max()))
    return {"onnx_max_abs_diff": worst, "onnx_bytes": Path(path).stat().st_size}
