"""Reading an ONNX file for every entry point (import_onnx, quantize_onnx, lower, openvino_layout),
with one wording for the files users actually pass by mistake: not ONNX at all, truncated by an
interrupted download or copy, or saved with external data that is not next to it."""

from __future__ import annotations

from collections.abc import Callable

import onnx
from google.protobuf.message import DecodeError


def parse_onnx(load: Callable[[], onnx.ModelProto], what: str, who: str = "") -> onnx.ModelProto:
    """``load()``; a ValueError naming ``what`` (the file), after ``who: `` when given, when the
    bytes are not an ONNX model or its external data cannot be read."""
    who = f"{who}: " if who else ""
    try:
        proto = load()
    except DecodeError as e:
        raise ValueError(
            f"{who}{what} is not a readable ONNX model ({e}): the file is not ONNX, or "
            "truncated (an interrupted download or copy); export or download it again"
        ) from None
    except onnx.checker.ValidationError as e:
        raise ValueError(
            f"{who}{what} keeps tensors in external data files that cannot be read "
            f"({str(e).strip()}); put the data files next to the model, as when it was saved"
        ) from None
    if not proto.graph.node and not proto.graph.output:
        raise ValueError(
            f"{who}{what} holds no graph (not an ONNX model, or an empty one); pass a "
            ".onnx model file"
        )
    return proto
