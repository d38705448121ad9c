"""``QuantModel``: the quantized model, still an ``nn.Module`` that behaves like the user's model.

It is a ``torch.fx.GraphModule`` (the captured computation with quantizers in it) that

* keeps the user's parameters at their original state-dict keys (quantizer state lives under
  ``_quantbridge.*``),
* runs with INT8 semantics (fake quantization) by default; ``float_mode`` bypasses every quantizer
  (and runs the float value of a weight AdaRound rounded in place, ``keep_float_weight``),
* falls back to the original model for attributes and methods it does not have itself,
* carries the recipe and the placement record (``qb_points``) as plain data for export, save and
  debug tools.

It knows nothing of QAT, checkpoints or distributed code: those modules build on it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from ..recipe import Recipe
from ._call_guards import wrap_guards
from ._errors import CheckpointError
from ._fakequant import BiasQuantizer, Quantizer
from ._float_layers import float_layers
from ._passes import set_graph_training
from ._pickling import reduce_quant_model
from ._placement import CONTAINER, QuantPoint, output_quantizers
from ._replace import adopt_hook, record_weight_shapes

# nn.Module's forward/backward hook registries: GraphModule.__deepcopy__ re-initialises the copy
# and carries only the state-dict hooks over
_CALL_HOOKS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_is_full_backward_hook",
)


class QuantModel(torch.fx.GraphModule):
    """A captured model with quantizers placed; see the module docstring."""

    def __init__(
        self,
        gm: torch.nn.Module,
        graph: torch.fx.Graph | None = None,
        recipe: Recipe | None = None,
        points: list[QuantPoint] | None = None,
        source: nn.Module | None = None,
    ):
        # (gm, graph) is GraphModule's own signature: deepcopy and pickling call it that way and
        # carry our attributes in gm.__dict__
        super().__init__(gm, graph if graph is not None else gm.graph, class_name="QuantModel")
        if CONTAINER not in self._modules:  # nothing placed: GraphModule keeps only used modules
            self.add_module(CONTAINER, nn.Module())
        extra = getattr(gm, "__dict__", {})
        self.qb_recipe = recipe if recipe is not None else extra.get("qb_recipe")
        self.qb_points = points if points is not None else extra.get("qb_points", [])
        self.qb_bn_frozen = extra.get("qb_bn_frozen", False)
        # per model output: the container attribute of its quantizer (None: a float output)
        self.qb_outputs = extra.get("qb_outputs") or output_quantizers(self)
        # how the model was captured (input spec, dynamic dims, BN folding): enough to redo it
        self.qb_capture = extra.get("qb_capture", {})
        # the capture's dynamic-size ranges: export writes its program from this graph (one trace)
        self.qb_shape_ranges = extra.get("qb_shape_ranges")
        # not a submodule: its float weights are not ours
        self.__dict__["_qb_source"] = source if source is not None else extra.get("_qb_source")
        # a layer replaced later (transfer learning) gets its quantizers re-set (``_replace``)
        record_weight_shapes(self)
        wrap_guards(self)  # torch's 'Guard failed: ...' as a ValueError naming the input
        self.register_forward_pre_hook(adopt_hook)

    def _deepcopy_init(self):
        return QuantModel.__init__  # GraphModule.__deepcopy__ re-initialises through this

    def __deepcopy__(self, memo: dict) -> QuantModel:
        """``copy.deepcopy``: ``GraphModule``'s copy, plus what its re-initialisation drops: the
        forward/backward hooks (the input check ``check_call_hook`` among them) and train/eval
        mode, so the copy computes and refuses bad inputs as the original does."""
        res = super().__deepcopy__(memo)
        for attr in _CALL_HOOKS:
            if attr in self.__dict__:
                res.__dict__[attr] = copy.deepcopy(self.__dict__[attr], memo)
        res.training = self.training
        return res

    def __reduce__(self):
        """``pickle`` / ``torch.save``: the graph with its captured values, not fx's re-trace
        of the code (``_pickling``)."""
        return reduce_quant_model(self, QuantModel)

    @property
    def training(self) -> bool:
        return self.__dict__.get("_qb_training", True)

    @training.setter
    def training(self, mode: bool) -> None:
        """The captured batch-norm and dropout ops follow the mode, however it is set
        (``model.train()``, or ``module.training = ...`` as Lightning does)."""
        self.__dict__["_qb_training"] = bool(mode)
        if "_graph" in self.__dict__:
            bn = mode and not self.__dict__.get("qb_bn_frozen", False)
            set_graph_training(self, bn=bool(bn), dropout=bool(mode))

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            source = self.__dict__.get("_qb_source")
            if source is not None and not name.startswith("__"):
                try:
                    return getattr(source, name)
                except AttributeError:
                    pass
            raise

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As ``nn.Module.load_state_dict``; a float state dict (no quantizer state) is refused
        with the fix (``CheckpointError``)."""
        prefix = CONTAINER + "."
        if (
            strict
            and not any(k.startswith(prefix) for k in state_dict)
            and any(k.startswith(prefix) for k in self.state_dict())
        ):
            raise CheckpointError(
                "this is a float checkpoint (no '_quantbridge.*' quantizer state), not a "
                "QuantModel state_dict: load it with model.load_state_dict on your float model, "
                "then qb.quantize(model, calib_data) (or qb.prepare_qat); strict=False loads some "
                "weights"
            )
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    # -- quantizers -------------------------------------------------------------------------------
    def quantizers(self) -> dict[str, Quantizer | BiasQuantizer]:
        """User-facing name -> quantizer module, in placement order."""
        container = getattr(self, CONTAINER)
        return {getattr(container, p.attr).name: getattr(container, p.attr) for p in self.qb_points}

    def output_quantizer(self, index: int = 0) -> Quantizer:
        """The quantizer of the model's ``index``-th output (flattened return value), from the
        placement record ``qb_outputs``; ``ValueError`` when that output is float."""
        if not 0 <= index < len(self.qb_outputs) and not -len(self.qb_outputs) <= index < 0:
            raise ValueError(
                f"output {index} does not exist: the model returns {len(self.qb_outputs)} tensors"
            )
        attr = self.qb_outputs[index]
        if attr is None:
            raise ValueError(
                f"output {index} of the model is not quantized (it stays float: the op producing "
                "it runs in float, or the recipe skips its layer)"
            )
        return getattr(getattr(self, CONTAINER), attr)

    def _all_quantizers(self) -> Iterator[nn.Module]:
        yield from getattr(self, CONTAINER).children()

    def set_quantization(self, enabled: bool) -> None:
        """Persistent switch: INT8 semantics (True) or float (False). Weights never change."""
        for m in self._all_quantizers():
            m.enabled = enabled

    @property
    def quantization_enabled(self) -> bool:
        return all(m.enabled for m in self._all_quantizers())

    def summary(self) -> str:
        """One line per quantizer, then one per layer whose weight runs in float and why (a
        recipe rule that skips it, or no int8 form: ``float_layers``)."""
        lines = []
        for name, q in self.quantizers().items():
            lines.append(f"{name}: {q.extra_repr() if isinstance(q, Quantizer) else 'int32 bias'}")
        lines += [f"{name}: float weight, {why}" for name, why in self.float_layers().items()]
        return "\n".join(lines)

    def float_layers(self) -> dict[str, str]:
        """Layer name -> why its weight runs in float: kept by a recipe rule (named), or with no
        int8 form (placement warned). Empty when every layer with weights is quantized."""
        return float_layers(self, self.qb_recipe)


# module types of higher layers with their own float switch (``quantization_enabled`` and
# ``set_quantization``), registered by those layers: the engine layer's ``EngineModel``
def check_dynamic(model: nn.Module, dynamic: str | None, caller: str) -> None:
    """ValueError for ``dynamic="all"`` on a QuantModel captured with ``"batch"`` / ``"none"``:
    its graph has every other size fixed (reshapes, positions), so the file would be
    ``[batch, 8]`` without a word (measured on BERT, GPT-2, a CNN). ``caller`` names the call."""
    captured = (model.qb_capture or {}).get("dynamic") if isinstance(model, QuantModel) else None
    if dynamic == "all" and captured in ("batch", "none"):
        raise ValueError(
            f"{caller}(dynamic='all'): this QuantModel was quantized with dynamic={captured!r}, "
            "so its graph has every other size fixed; quantize with dynamic='all' to vary "
            "sequence lengths or image sizes"
        )


FLOAT_SWITCHES: list[type] = []


def keep_float_weight(
    quantizer: nn.Module, param: torch.Tensor, float_weight: torch.Tensor
) -> None:
    """Record ``float_weight`` as the float value of ``param``, which now holds a rounded copy
    (AdaRound writes its hard rounding into the parameter, so that export and checkpoints carry
    it): ``float_mode`` runs ``float_weight``, so the float references made from it (sequential
    bias correction, ``compare``, sensitivity) are the float model's, not the rounded weights'.
    Kept by ``qb.save`` / ``qb.load`` (``kept_float_weights``), ``pickle`` and ``copy.deepcopy``
    (``WeightQuantizer.__getstate__``); forgotten once ``param`` is written by anything else
    (its version counter moved: ``float_mode`` then runs the weights the parameter holds)."""
    quantizer.__dict__["_float_weight"] = (param, float_weight.detach().clone(), param._version)


def kept_float_weights(model: QuantModel) -> dict[str, tuple[str, torch.Tensor]]:
    """Quantizer attribute -> (parameter name, float weight) of each live ``keep_float_weight``
    record of ``model``'s quantizers (a stale one, whose parameter was written since, is left
    out)."""
    names = {id(p): n for n, p in model.named_parameters()}
    found = {}
    for attr, m in getattr(model, CONTAINER).named_children():
        param, weight, version = m.__dict__.get("_float_weight", (None, None, None))
        if param is not None and param._version == version and id(param) in names:
            found[attr] = (names[id(param)], weight)
    return found


def _swap_float_weights(quantizers: list) -> list:
    """Copy each recorded float weight into its parameter; returns what to restore."""
    swapped = []
    with torch.no_grad():
        for m in quantizers:
            param, weight, version = m.__dict__.get("_float_weight", (None, None, None))
            if param is None:
                continue
            if param._version != version or param.shape != weight.shape:
                del m.__dict__["_float_weight"]  # the parameter changed since: stale
                continue
            swapped.append((m, param, weight, param.detach().clone()))
            m.__dict__["_rounded_weight"] = swapped[-1][3]  # what the quantizer gives if enabled
            param.copy_(weight)
    return swapped


def _restore_weights(swapped: list) -> None:
    with torch.no_grad():
        for m, param, weight, rounded in swapped:
            param.copy_(rounded)
            m.__dict__.pop("_rounded_weight", None)
            m.__dict__["_float_weight"] = (param, weight, param._version)


@contextlib.contextmanager
def float_mode(model: nn.Module):
    """Run ``model`` (a QuantModel, an EngineModel, or a model containing one) in float:
    quantizers bypassed (an EngineModel runs its fp32 export), weights AdaRound rounded at their
    float values (``keep_float_weight``)."""
    saved = [(m, m.enabled) for m in model.modules() if isinstance(m, (Quantizer, BiasQuantizer))]
    switches = [
        (m, m.quantization_enabled) for m in model.modules() if isinstance(m, tuple(FLOAT_SWITCHES))
    ]
    swapped = []
    try:
        for m, _ in saved:
            m.enabled = False
        for m, _ in switches:
            m.set_quantization(False)
        swapped = _swap_float_weights([m for m, _ in saved])
        yield model
    finally:
        _restore_weights(swapped)
        for m, enabled in saved:
            m.enabled = enabled
        for m, enabled in switches:
            m.set_quantization(enabled)
