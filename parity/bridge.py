"""Move parameters and arrays between Flax NNX and PyTorch.

Parameters: `flax_to_torch(flax_module, torch_module)` / `torch_to_flax(torch_module, flax_module)`
copy every parameter. A Flax parameter at path ("attn", "q_proj", "kernel") owned by an
`nnx.Linear` is the torch parameter "attn.q_proj.weight" of an `nn.Linear`: the module path is the
same (list indices included: nnx.List item 0 <-> nn.ModuleList item "0"), the leaf name and layout
come from `PARAM_MAP`, the one table of this mapping. nnx.Linear keeps its kernel as [in, out],
nn.Linear its weight as [out, in]; `_relayout` is the one place that transposes. Any Flax parameter
without a mapping, any torch parameter left unmatched, a module-type mismatch or a shape mismatch
raises `BridgeError` before anything is written. Values are cast to the destination parameter's
dtype (float32 -> float64 is exact: that is how the float64 golden twin gets its weights). Only
`nnx.Param` variables and torch parameters move (no buffers / other nnx variables: the layers here
have none). The layers' parameters are the same for every `attention=` / `position=` choice except
the learned stick-breaking decay (`attention="stick_breaking", learn_decay=True`): the per-head
`decay_logit` of `MultiHeadSelfAttention`, same name and layout in both frameworks.
`MultiheadDilatedAttention` holds the projections of `MultiHeadSelfAttention` (`q_proj`, `k_proj`,
`v_proj`, `out_proj`; nnx.Linear <-> nn.Linear, widths from in_features / qkv_features /
out_features), so the same table covers it, and `MultiHeadSelfAttention(attention="dilated")` maps
onto it; so does `HilbertDilatedAttention` (a `MultiheadDilatedAttention` with a Hilbert ordering:
the same parameters); `DilatedAttention` has no parameters (no pairs, nothing to copy).
`NativeSparseAttention` (alone or as an `EncoderBlock`'s `attn` with attention="nsa") adds Linear
gates (`gate_proj`, or `gate_in` and `gate_out`) and, with compress="mlp", `compress_k` and
`compress_v` (`CompressMLP`: `pos`, `w1`, `b1`, `w2`, `b2`, the same names and layouts on both
sides, never transposed).

Arrays: `to_torch(x)` / `to_jax(t)` exchange through DLPack without a copy when the array and the
destination sit on the same device (CPU <-> CPU, GPU i <-> cuda:i) and through a host copy
otherwise; `return_method=True` also returns which happened ("dlpack" or "copy"). A zero-copy
result shares memory with its source: JAX arrays are immutable, so never modify such a torch
tensor in place (and do not modify a torch tensor in place after handing it to JAX).
"""
from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import torch
from flax import nnx
from torch import nn

import jax_attn.nn.layers as jax_layers
import torch_ref.nn.layers as torch_layers


class BridgeError(ValueError):
    """The two modules' parameters do not correspond one to one (missing, extra, mis-shaped)."""


# (flax owner type, flax leaf) -> (torch owner type, torch leaf, transposed?)
PARAM_MAP: dict[tuple[type, str], tuple[type, str, bool]] = {
    (nnx.Linear, "kernel"): (nn.Linear, "weight", True),
    (nnx.Linear, "bias"): (nn.Linear, "bias", False),
    (nnx.LayerNorm, "scale"): (nn.LayerNorm, "weight", False),
    (nnx.LayerNorm, "bias"): (nn.LayerNorm, "bias", False),
    (jax_layers.MultiHeadSelfAttention, "decay_logit"): (torch_layers.MultiHeadSelfAttention, "decay_logit", False),
    # NSA's compression maps: the layouts of attn_spec.nsa.CompressParams in both frameworks
    **{(jax_layers.CompressMLP, f): (torch_layers.CompressMLP, f, False) for f in ("pos", "w1", "b1", "w2", "b2")},
}


def _relayout(x, transposed: bool):
    """Flax layout <-> torch layout (its own inverse: a 2-D transpose or nothing)."""
    return x.T if transposed else x


def _flax_params(flax_module) -> dict[tuple, tuple[object, nnx.Param]]:
    """path -> (owner module, Param) for every nnx.Param of the module."""
    nodes = dict(nnx.iter_graph(flax_module))
    return {path: (nodes[path[:-1]], node) for path, node in nodes.items() if isinstance(node, nnx.Param)}


def _torch_owner(torch_module: nn.Module, name: str) -> nn.Module:
    owner_name = name.rpartition(".")[0]
    return torch_module.get_submodule(owner_name) if owner_name else torch_module


def param_pairs(flax_module, torch_module) -> list[tuple[tuple, str, bool]]:
    """[(flax path, torch name, transposed)] for every parameter; raises BridgeError unless the two
    modules' parameters correspond one to one with matching owners and shapes."""
    torch_params = dict(torch_module.named_parameters())
    pairs, errors = [], []
    for path, (owner, param) in _flax_params(flax_module).items():
        key = (type(owner), path[-1])
        flax_name = "/".join(map(str, path))
        if key not in PARAM_MAP:
            errors.append(f"flax parameter {flax_name} of {type(owner).__name__} has no torch mapping")
            continue
        torch_type, leaf, transposed = PARAM_MAP[key]
        name = ".".join([*map(str, path[:-1]), leaf])
        if name not in torch_params:
            errors.append(f"flax parameter {flax_name} -> torch {name}: missing in the torch module")
            continue
        if not isinstance(_torch_owner(torch_module, name), torch_type):
            errors.append(f"flax parameter {flax_name} -> torch {name}: owner is "
                          f"{type(_torch_owner(torch_module, name)).__name__}, expected {torch_type.__name__}")
        shape = tuple(param.get_value().shape)
        want = shape[::-1] if transposed else shape
        if tuple(torch_params[name].shape) != want:
            errors.append(f"flax parameter {flax_name} {shape} -> torch {name}: shape "
                          f"{tuple(torch_params[name].shape)}, expected {want}")
        pairs.append((path, name, transposed))
    extra = sorted(set(torch_params) - {name for _, name, _ in pairs})
    errors += [f"torch parameter {name} has no flax counterpart" for name in extra]
    if errors:
        raise BridgeError("parameters do not correspond:\n  " + "\n  ".join(errors))
    return pairs


def flax_to_torch(flax_module, torch_module) -> None:
    """Copy every Flax parameter into the torch module (in place, cast to the torch dtype)."""
    flax_params = _flax_params(flax_module)
    torch_params = dict(torch_module.named_parameters())
    with torch.no_grad():
        for path, name, transposed in param_pairs(flax_module, torch_module):
            dst = torch_params[name]
            src = to_torch(flax_params[path][1].get_value(), device=dst.device)
            dst.copy_(_relayout(src, transposed).to(dst.dtype))


def torch_to_flax(torch_module, flax_module) -> None:
    """Copy every torch parameter into the Flax module (in place, cast to the Flax dtype). The
    layout change and the copy happen on the torch side, so the new values never share memory
    with the torch parameters (and no JAX computation has to be compiled per shape)."""
    flax_params = _flax_params(flax_module)
    torch_params = dict(torch_module.named_parameters())
    for path, name, transposed in param_pairs(flax_module, torch_module):
        param = flax_params[path][1]
        old = param.get_value()
        src = _relayout(torch_params[name].detach(), transposed).clone(memory_format=torch.contiguous_format)
        new = to_jax(src, device=_jax_device(old))
        if new.dtype != old.dtype:
            new = new.astype(old.dtype)
        param.set_value(new)


def flax_tree_in_torch_layout(flax_module, tree) -> dict[str, np.ndarray]:
    """A pytree shaped like the module's parameter State (e.g. its gradients, or
    `nnx.state(module, nnx.Param)`) as {torch name: float64 NumPy array in torch layout}."""
    by_path = {}
    for path, leaf in nnx.to_flat_state(tree):
        by_path[tuple(path)] = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
    names = {}
    for path, (owner, _) in _flax_params(flax_module).items():
        key = (type(owner), path[-1])
        if key not in PARAM_MAP:
            raise BridgeError(f"flax parameter {'/'.join(map(str, path))} has no torch mapping")
        _, leaf, transposed = PARAM_MAP[key]
        if path not in by_path:
            raise BridgeError(f"tree has no entry for flax parameter {'/'.join(map(str, path))}")
        names[".".join([*map(str, path[:-1]), leaf])] = _relayout(_np64(by_path[path]), transposed)
    return names


def _np64(x) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(np.float64)


# ------------------------------------------------------------------------------------------------
# Array exchange
# ------------------------------------------------------------------------------------------------
def _jax_device(x):
    devices = x.devices()
    return next(iter(devices)) if len(devices) == 1 else None


def _torch_device_for(jax_device) -> torch.device:
    if jax_device is None or jax_device.platform == "cpu":
        return torch.device("cpu")
    if jax_device.platform in ("gpu", "cuda", "rocm"):
        return torch.device("cuda", _ordinal(jax_device))
    raise ValueError(f"no torch device corresponds to JAX device {jax_device}")


def _ordinal(jax_device) -> int:
    hw = getattr(jax_device, "local_hardware_id", None)
    return jax_device.id if hw is None else hw


def _same_device(jax_device, torch_device: torch.device) -> bool:
    if jax_device is None:
        return False
    if jax_device.platform == "cpu":
        return torch_device.type == "cpu"
    if jax_device.platform in ("gpu", "cuda", "rocm") and torch_device.type == "cuda":
        index = torch.cuda.current_device() if torch_device.index is None else torch_device.index
        return index == _ordinal(jax_device)
    return False


def _numpy_to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:  # NumPy has no bfloat16: move the bits
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().to("cpu")
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def to_torch(x, device=None, *, return_method: bool = False):
    """A JAX array as a torch tensor on `device` (default: the torch twin of x's device).

    DLPack, zero-copy, when x lives on one device and that is `device`; else a host copy
    (np.asarray, then `.to(device)`). With return_method, returns (tensor, "dlpack" | "copy").
    """
    if not isinstance(x, jax.Array):
        raise TypeError(f"to_torch expects a jax.Array, got {type(x).__name__}")
    src = _jax_device(x)
    target = _torch_device_for(src) if device is None else torch.device(device)
    if _same_device(src, target):
        t, method = torch.from_dlpack(x), "dlpack"
    else:
        t, method = _numpy_to_torch(np.asarray(x)).to(target), "copy"
    return (t, method) if return_method else t


def to_jax(t: torch.Tensor, device=None, *, return_method: bool = False):
    """A torch tensor (detached) as a JAX array on `device` (a jax.Device; default, or None: the
    JAX twin of t's device, else JAX's default device).

    DLPack, zero-copy, when t is contiguous and on that device; else a host copy (a
    non-contiguous tensor is copied too). With return_method, returns (array, "dlpack" | "copy").
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"to_jax expects a torch.Tensor, got {type(t).__name__}")
    t = t.detach()
    if device is None:
        device = _jax_device_for(t.device) or jax.devices()[0]
    if _same_device(device, t.device) and t.is_contiguous():
        return (jax.dlpack.from_dlpack(t), "dlpack") if return_method else jax.dlpack.from_dlpack(t)
    a = jax.device_put(_torch_to_numpy(t), device)
    return (a, "copy") if return_method else a


def _jax_device_for(torch_device: torch.device):
    platform = "cpu" if torch_device.type == "cpu" else "gpu" if torch_device.type == "cuda" else None
    if platform is None:
        return None
    try:
        candidates = jax.devices(platform)
    except RuntimeError:  # that platform is not available to JAX
        return None
    if platform == "cpu":
        return candidates[0]
    index = torch.cuda.current_device() if torch_device.index is None else torch_device.index
    return next((d for d in candidates if _ordinal(d) == index), None)
