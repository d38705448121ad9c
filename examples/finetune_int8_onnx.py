"""Fine-tune an INT8 ONNX model: import ONNX Runtime's QOperator file, new head, QAT, INT8 again.

scikit-learn's 8x8 digits, fixed split (1347 training / 450 held-out images):

1. a float DigitsCNN is trained on digits 0-4 only (labels 0-4), exported to ONNX and quantized
   by ONNX Runtime's ``quantize_static`` to a QOperator file (QLinearConv, QGemm, QLinearAdd;
   s8/s8, per-channel weights): the "INT8 model from elsewhere";
2. ``qb.import_onnx(file, learn_scales=True)`` gives a trainable ``QuantModel`` holding the file's
   integer weights, scales and zero points (its outputs equal ONNX Runtime's on the file);
3. the new task is digits 5-9 (labels 0-4 again: digit - 5): the head (``fc2``) is re-initialised
   and the whole INT8 model is trained with QAT - LSQ, starting from the file's scales - once in a
   plain torch loop and once by a Lightning ``Trainer.fit`` (when ``lightning`` is installed);
4. each fine-tuned model is exported as a QDQ INT8 file and run in ONNX Runtime.

Usage::

    python examples/finetune_int8_onnx.py [--float-epochs 6] [--epochs 4] [--json out.json]

Prints held-out accuracies: of the INT8 file on the old task (ONNX Runtime and the import), of the
imported model on the new task before fine-tuning (its old head: chance or below), and after QAT
(torch and ONNX Runtime on the exported file).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

import onnxruntime as ort
import torch
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

import quantbridge as qb
from quantbridge.demo import load_digits_split, train

try:
    import lightning as L
except ImportError:  # optional: the plain loop runs without it
    L = None


class _Calibration(CalibrationDataReader):
    def __init__(self, x: torch.Tensor, batch: int = 64):
        self._it = iter([{"x": x[i : i + batch].numpy()} for i in range(0, len(x), batch)])

    def get_next(self):
        return next(self._it, None)


def ort_int8_file(model: torch.nn.Module, calib: torch.Tensor, folder: Path) -> Path:
    """The float model as ONNX Runtime's QOperator INT8 file (what a user receives)."""
    float_path, int8_path = folder / "digits.float.onnx", folder / "digits.int8.qop.onnx"
    torch.onnx.export(
        model.eval(), (calib[:2],), str(float_path), dynamo=False, opset_version=17,
        input_names=["x"], output_names=["logits"], dynamic_axes={"x": {0: "n"}, "logits": {0: "n"}},
    )  # fmt: skip
    logging.getLogger().setLevel(logging.ERROR)  # ORT's pre-processing advice
    quantize_static(
        str(float_path), str(int8_path), _Calibration(calib), quant_format=QuantFormat.QOperator,
        per_channel=True, activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
    )  # fmt: skip
    return int8_path


def ort_accuracy(path: Path, x: torch.Tensor, y: torch.Tensor) -> float:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    logits = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    return float((logits[:, :5].argmax(1) == y.numpy()).mean())


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(x)[:, :5].argmax(1) == y).numpy().mean())


def new_head(qmodel: qb.QuantModel, seed: int) -> qb.QuantModel:
    """Re-initialise the classifier (same shape: 10 logits, the new task uses 5). Its weight and
    output scales are LSQ-learned from the file's values during QAT."""
    torch.manual_seed(seed)
    # layers are named after their ONNX node: ORT's QGemm '/fc2/Gemm_quant' is 'fc2_Gemm_quant'
    head = qmodel.get_submodule("fc2_Gemm_quant")
    fresh = torch.nn.Linear(head.weight.shape[1], head.weight.shape[0])
    with torch.no_grad():
        head.weight.copy_(fresh.weight)
        head.bias.copy_(fresh.bias)
    return qmodel


def _loss(qmodel, x, y):
    return torch.nn.functional.cross_entropy(qmodel(x)[:, :5], y)


def qat_plain(qmodel, x, y, epochs: int, seed: int, lr: float = 1e-3) -> qb.QuantModel:
    opt = torch.optim.Adam(qmodel.parameters(), lr=lr)
    shuffle = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        qmodel.train()
        for idx in torch.randperm(len(x), generator=shuffle).split(32):
            loss = _loss(qmodel, x[idx], y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return qmodel.eval()


def qat_lightning(qmodel, x, y, epochs: int, seed: int, lr: float = 1e-3) -> qb.QuantModel:
    class FineTune(L.LightningModule):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def training_step(self, batch, _):
            return _loss(self.net, *batch)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=lr)

    L.seed_everything(seed, verbose=False)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    trainer = L.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(FineTune(qmodel), data)
    return qmodel.eval()


def run(float_epochs: int, epochs: int, seed: int, folder: Path, log=print) -> dict:
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_digits_split(seed)
    old_tr, old_te = y_train < 5, y_test < 5
    log(f"float DigitsCNN on digits 0-4 ({int(old_tr.sum())} images), {float_epochs} epochs")
    model = train(x_train[old_tr], y_train[old_tr], float_epochs, seed, lambda line: None)
    path = ort_int8_file(model, x_train[old_tr][:256], folder)
    report = {"old_task": {"float": accuracy(model, x_test[old_te], y_test[old_te])}}
    report["old_task"]["ort_int8_file"] = ort_accuracy(path, x_test[old_te], y_test[old_te])
    imported = qb.import_onnx(path, learn_scales=True)
    report["old_task"]["imported"] = accuracy(imported, x_test[old_te], y_test[old_te])

    new_tr, new_te = y_train >= 5, y_test >= 5
    xn, yn, xt, yt = x_train[new_tr], y_train[new_tr] - 5, x_test[new_te], y_test[new_te] - 5
    report["new_task"] = {"before": accuracy(imported, xt, yt)}
    trainers = {"plain": qat_plain}
    if L is not None:
        trainers["lightning"] = qat_lightning
    else:
        log("lightning is not installed: only the plain loop runs")
    for name, fit in trainers.items():
        qmodel = fit(new_head(qb.import_onnx(path, learn_scales=True), seed), xn, yn, epochs, seed)
        out = folder / f"digits59.{name}.int8.onnx"
        qb.export(qmodel, out, example_inputs=xt[:2])
        report["new_task"][name] = accuracy(qmodel, xt, yt)
        report["new_task"][f"{name}_ort"] = ort_accuracy(out, xt, yt)
    return report


def format_report(report: dict) -> str:
    old, new = report["old_task"], report["new_task"]
    lines = [
        "old task (digits 0-4), held out:",
        f"  float {old['float']:.1%}   ORT int8 file {old['ort_int8_file']:.1%}   "
        f"imported {old['imported']:.1%}",
        "new task (digits 5-9), held out:",
        f"  imported, old head (before fine-tuning) {new['before']:.1%}",
    ]
    for name in ("plain", "lightning"):
        if name in new:
            lines.append(
                f"  QAT {name:9s} torch {new[name]:.1%}   ORT on the exported INT8 file "
                f"{new[f'{name}_ort']:.1%}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--float-epochs", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=4, help="QAT epochs on the new task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        report = run(args.float_epochs, args.epochs, args.seed, Path(folder))
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
