"""Offloaded weights of models dispatched by accelerate (``from_pretrained(..., device_map=...)``,
``dispatch_model``).

Such a model keeps its layers on several devices, and with CPU or disk offloading keeps an offloaded layer's
weights on the meta device except inside that layer's own forward (accelerate's ``AlignDevicesHook`` loads them in
``pre_forward`` and drops them in ``post_forward``). The library rebuilds each layer's operator after the forward
pass, from the layer's weights: :func:`loaded_weights` asks the hooks for them, layer by layer, on the layer's
execution device, and puts the meta placeholders back on exit. Only one layer's offloaded weights are loaded at a
time, so the driver's memory stays below the model's size.
"""
from __future__ import annotations

import contextlib

from torch import nn


def _offload_hook(module: nn.Module):
    """The offloading ``AlignDevicesHook`` on ``module`` (inside a ``SequentialHook`` too), or None."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return None
    from accelerate.hooks import AlignDevicesHook

    for candidate in getattr(hook, "hooks", (hook,)):
        if isinstance(candidate, AlignDevicesHook) and candidate.offload:
            return candidate
    return None


def is_dispatched(model: nn.Module) -> bool:
    """Whether accelerate's hooks manage the model's devices (``device_map=``, ``dispatch_model``, ``cpu_offload``)."""
    return any(hasattr(module, "_hf_hook") for module in model.modules())


def _offloaded(module: nn.Module, hook, prefix: str = "") -> list[str]:
    """Names (relative to ``module``) of the tensors ``hook`` loads on ``module``, restricted to those under
    ``prefix`` (a submodule path ending in '.'), that are on the meta device now."""
    from accelerate.utils.modeling import named_module_tensors

    names = []
    for name, tensor in named_module_tensors(module, include_buffers=hook.offload_buffers,
                                             recurse=hook.place_submodules, remove_non_persistent=True):
        if name.startswith(prefix) and tensor.device.type == "meta":
            names.append(name)
    return names


@contextlib.contextmanager
def loaded_weights(model: nn.Module, module: nn.Module):
    """Every offloaded weight of ``module`` (a decoder layer, a mixer) loaded on its execution device while the
    context is open; on exit, each tensor this context loaded goes back to the meta device.

    A no-op for models without offloading (every other model, and accelerate's multi-device maps without offload,
    whose weights stay on their devices). Weights already loaded (inside the layer's own forward) are left alone.
    """
    if not is_dispatched(model):
        yield
        return
    from accelerate.utils import set_module_tensor_to_device

    path = next((name for name, candidate in model.named_modules() if candidate is module), None)
    if path is None:
        raise ValueError(f"mamba_captum: {type(module).__name__} is not a submodule of the model.")
    hooked = []  # (hooked module, hook, names of its tensors to load)
    for candidate in module.modules():  # the module and everything inside it (a shared block too)
        hook = _offload_hook(candidate)
        if hook is not None:
            hooked.append((candidate, hook, _offloaded(candidate, hook)))
    parts = path.split(".") if path else []
    for depth in range(len(parts)):  # ancestors whose hook loads their whole subtree (preloaded classes)
        ancestor = model.get_submodule(".".join(parts[:depth]))
        hook = _offload_hook(ancestor)
        if hook is not None and hook.place_submodules:
            hooked.append((ancestor, hook, _offloaded(ancestor, hook, ".".join(parts[depth:]) + ".")))
    loaded = []
    hooks = {id(hook): hook for _, hook, _ in hooked}
    try:
        for owner, hook, names in hooked:
            for name in names:
                set_module_tensor_to_device(owner, name, hook.execution_device, value=hook.weights_map[name])
                loaded.append((owner, name))
        for hook in hooks.values():
            # the rebuild runs submodules' forward, which accelerate wraps: with offload on, its post_forward would
            # put the weights back on meta before the rebuild reads them
            hook.offload = False
        yield
    finally:
        for hook in hooks.values():
            hook.offload = True
        for owner, name in loaded:
            set_module_tensor_to_device(owner, name, "meta")
