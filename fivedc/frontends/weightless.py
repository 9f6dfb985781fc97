"""Models without weights: plan a model whose parameters were never allocated.

A plan needs a model's shapes, its ops and the values of what it computes from its
buffers and the input shapes (rotary tables, masks), never its parameters' values.
`empty_weights()` builds a model that way, as accelerate's
`init_empty_weights(include_buffers=False)` does: every parameter a module registers
while it is active is moved to the meta device at once (its initialisation then
costs nothing), while buffers are computed on the CPU as usual. A factory that builds
under `torch.device("meta")` itself gets its buffers on the CPU too (a tensor asked
for on the meta device is made on the CPU; parameters still go to meta), so

    with fivedc.empty_weights():
        model = AutoModelForCausalLM.from_config(config)   # a 70B config on a laptop

compiles (`fivedc compile`, `trace_module`) to the plan the same model with weights
compiles to. The frontend computes the example run of such a model on the meta
device wherever a parameter takes part (`fivedc/frontends/fx/trace.py`), and for real where
only inputs, buffers and shapes do. A model whose buffers are on the meta device
(built under `torch.device("meta")` or fake tensors without this) cannot be planned:
its rotary tables and masks have no values; the frontend says so at the buffer.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["empty_weights", "meta_buffers", "example_run"]


class _MetaOnCpu(TorchFunctionMode):
    """A tensor asked for on the meta device (a factory's `torch.device("meta")`) is made on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_meta(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func in (torch.Tensor.to, torch.Tensor.cuda) and any(_is_meta(a) for a in args[1:]):
            args = tuple("cpu" if _is_meta(a) else a for a in args)
        return func(*args, **kwargs)


def _is_meta(device) -> bool:
    return (isinstance(device, str) and device == "meta") or (isinstance(device, torch.device)
                                                               and device.type == "meta")


@contextlib.contextmanager
def empty_weights():
    """Within it, parameters are registered on the meta device; everything else is made on the CPU."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            with torch._C.DisableTorchFunction():  # past _MetaOnCpu: this one goes to meta
                on = param.data.to("meta")
            module._parameters[name] = type(param)(on, requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        with _MetaOnCpu():
            yield
    finally:
        nn.Module.register_parameter = register


class _MetaWhereMixed(TorchFunctionMode):
    """The example run of a model without weights: a call that meets a tensor on the meta device
    computes on meta (shape and dtype: where a parameter took part); other calls compute for real,
    on the CPU (a tensor asked for on the meta device, as `torch.arange(device=embeds.device)`, is
    made there: its values are a mask or a table the frontend reads)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in leaves):
            with torch._C.DisableTorchFunction():
                args, kwargs = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
        elif any(_is_meta(d) for d in leaves):
            args, kwargs = tree_map(lambda d: torch.device("cpu") if _is_meta(d) else d, (args, kwargs))
        return func(*args, **kwargs)


def example_run(module: nn.Module):
    """The mode the example run of `module` takes: `_MetaWhereMixed` when a parameter is on the meta device."""
    weightless = any(p.is_meta for p in module.parameters())
    return _MetaWhereMixed() if weightless else contextlib.nullcontext()


@contextlib.contextmanager
def in_float64(module: nn.Module):
    """A model without weights in a lower precision (a bf16 config) is captured as float64, as a
    float64 model is (its rotary tables then read to float64 precision): cast while the context is
    active, then every parameter and buffer back to its own dtype (meta parameters cost nothing,
    and float64 holds every lower-precision value exactly)."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    floating = [(t, t.dtype) for _, t in tensors if t.is_floating_point()]
    lower = any(dtype != torch.float64 for _, dtype in floating)
    if not lower or not any(p.is_meta for p in module.parameters()):
        yield
        return
    try:
        for t, _ in floating:
            t.data = t.data.to(torch.float64)
        yield
    finally:
        for t, dtype in floating:
            t.data = t.data.to(dtype)


def meta_buffers(module: nn.Module) -> list[str]:
    """The module's buffers whose values are unknown (on the meta device, or fake)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return [name for name, b in module.named_buffers() if b.is_meta or isinstance(b, FakeTensor)]
