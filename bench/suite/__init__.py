"""The benchmark suite behind ``python -m bench``.

Modules, one concern each:

* ``machine``   - what the numbers were measured on (CPU, flags, cores, load, versions);
* ``timing``    - interleaved A/B timing with warm-up, medians, min/max, per-round ratios;
* ``engines``   - ONNX Runtime and OpenVINO sessions with the suite's thread settings;
* ``tools``     - the three quantizers side by side: quantbridge, ONNX Runtime ``quantize_static``,
                  PyTorch FX PTQ;
* ``workloads`` - models and data (digits, ResNet-18, MobileNetV2, MiniLM-L6, PP-OCRv4 det);
* ``ocr_data``  - rendered text images for the OCR model;
* ``accuracy``, ``speed``, ``cost``, ``qat`` - the four figures;
* ``cost_child``- one quantization run in a fresh process (``python -m bench.suite.cost_child``);
* ``report``    - ``BENCHMARKS.md`` from the results dict.

Peer tools (OpenVINO, Pillow for the OCR images) are optional: a figure whose peer is missing
reports the row as unavailable with the reason instead of failing the run.
"""
