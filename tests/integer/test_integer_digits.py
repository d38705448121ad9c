"""The digits demo model (quantbridge.demo): trained, quantized, exported, lowered. Its accuracy
through the integer program matches ONNX Runtime's on the QDQ file within 0.5 points, and the
three emitters (numpy, integer ONNX in ORT, C compiled with gcc) give identical codes on the
held-out digits."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import quantbridge as qb
from quantbridge.demo import load_digits_split, train


@pytest.mark.slow
def test_digits_accuracy_and_emitters(tmp_path, run_c):
    x_train, y_train, x_test, y_test = load_digits_split(0)
    model = train(x_train, y_train, epochs=4, seed=0, log=lambda line: None)
    qm = qb.quantize(model, list(x_train[:256].split(64)), progress=False, recipe="int8")
    path = tmp_path / "digits.int8.onnx"
    qb.export(qm, path, example_inputs=x_test[:1])
    x, y = x_test.numpy(), y_test.numpy()

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    ort_accuracy = float((sess.run(None, {"x": x})[0].argmax(1) == y).mean())
    prog = qb.lower(path)
    (logits,) = prog.run({"x": x}).values()
    program_accuracy = float((logits.argmax(1) == y).mean())
    print(f"digits: ORT QDQ {ort_accuracy:.2%}, integer program {program_accuracy:.2%}")
    assert ort_accuracy > 0.9
    assert abs(program_accuracy - ort_accuracy) <= 0.005

    reference = prog.run({"x": x}, integer=True)
    from_c = run_c(prog, {"x": x}, tmp_path / "c", opt="-O1")
    prog.save_onnx(tmp_path / "int.onnx", {"x": x.shape})
    integer_sess = ort.InferenceSession(
        str(tmp_path / "int.onnx"), providers=["CPUExecutionProvider"]
    )
    codes = prog.run_integer({"x": x})
    from_onnx = integer_sess.run(None, {b.tensor.name: codes[b.tensor.name] for b in prog.inputs})
    for b, onnx_codes in zip(prog.outputs, from_onnx, strict=True):
        np.testing.assert_array_equal(from_c[b.name], reference[b.name])
        np.testing.assert_array_equal(onnx_codes, reference[b.name])
