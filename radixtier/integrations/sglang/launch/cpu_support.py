"""SGLang 0.5.23's real server on a machine with no CUDA: the patches it needs, each for a named reason.

On a GPU node none of this is loaded (`install()` refuses where CUDA is present). Here, on CPU-only
machines, it lets the real `sglang.launch_server` -- its HTTP server, scheduler and detokenizer
processes, radixtier attached as the L3 backend -- run a small model, so the project's tests, bench
and demo go through the path users run. Each patch is as small as SGLang allows, and
`tests/test_cpu_support.py` fails the day SGLang's behaviour it works around changes:

1. **`sgl_kernel` stand-in.** With SGLang's CPU engine on (`SGLANG_USE_CPU_ENGINE=1`), modules on the
   server's import path import CPU ops from `sgl_kernel` at module level (e.g.
   `kernels/ops/kvcache/cache_move.py`: `copy_all_layer_kv_cache_cpu`), and PyPI has no CPU build of
   sgl_kernel (its only wheel needs libcuda). The stand-in names exactly those ops (`STANDIN_OPS`),
   each raising if called; none is called on this path. Submodules (`sgl_kernel.scalar_type`, ...)
   stay missing, so SGLang takes the fallbacks it already has for them, and with no
   `torch.ops.sgl_kernel` registered SGLang picks its torch fallbacks (RMSNorm, RoPE, SiLU, linear).
   A real sgl_kernel, where one is installed, always wins.
2. **L1<->L2 copies.** `pool_host/mha.py` and `pool_host/mla.py` import sgl_kernel's direct copy ops
   (`transfer_kv_direct`, `transfer_kv_per_layer_direct_pf_lf`, `transfer_kv_all_layer_direct_lf_pf`)
   only on CUDA/HIP, so a host-pool load or backup raises NameError on the CPU. Torch index copies
   with the same signatures are put in their place. They move L1<->L2 only; tier 3 never uses them.
3. **Unpinned host pool.** SGLang builds the host pool with `pin_memory=True`, which needs a CUDA
   driver. The assembler's pool classes are wrapped to pass `pin_memory=False`, and the pool is
   faulted in at once, as pinned memory is (left lazy, the first transfer into each page pays it).
4. **No PyNccl for TP > 1.** `init_model_parallel_group` defaults to PyNccl on every platform but
   NPU/XPU ("Expected a cuda device"); on the CPU it is told `use_pynccl=False` (gloo carries the
   collectives). Each rank also needs its own cores: `SGLANG_CPU_OMP_THREADS_BIND` (the launcher sets it).
5. **Sliding-window layers read their own pool's slots.** For hybrid-SWA models (Mellum, Gemma,
   ...) SGLang keeps sliding-window layers' KV in a smaller SWA pool whose slot numbers differ from
   the full pool's; `req_to_token` holds full-pool numbers. `torch_native_backend.py` writes SWA
   layers at the translated slots (`swa_out_cache_loc`) but reads them with the untranslated ones
   (`_run_sdpa_forward_extend` / `_run_sdpa_forward_decode` never call
   `translate_loc_from_full_to_swa`; the Intel AMX backend does, `_swa_kv_indices`). The two agree
   only while both allocators stay in step: after a host or tier-3 load they do not, and greedy
   answers changed (logprob difference 0.24 on Mellum; an index past the SWA pool can raise). For
   SWA layers the batch's rows of `req_to_token` are translated before the read, as the AMX
   backend does.
6. **Mamba-type hybrids (LFM2's short convolutions).** For every Mamba / linear-attention config
   SGLang imports `sgl_kernel.mamba` (and reads two `torch.ops.sgl_kernel` gated-delta-net names) on
   the CPU: the stand-in serves them, raising if called (LFM2 calls none). Its causal depthwise
   convolutions (`layers/attention/mamba/causal_conv1d.py`) have only a Triton path without CUDA:
   torch versions take their place. The Mamba host pool gets the same torch L1<->L2 copies
   (`pool_host/mamba.py`) and is built unpinned, as in patches 2 and 3.

The patches are applied as their modules are imported (an import hook), in every SGLang process:
`python -m radixtier.integrations.sglang.cpu_server` runs `sglang.launch_server` after `install()`,
and SGLang's spawned processes import that module again as `__mp_main__` before anything of SGLang's.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from typing import Any, Callable, Dict, Optional, Sequence

log = logging.getLogger("radixtier.sglang.cpu")

# What SGLang 0.5.23's CPU engine imports from sgl_kernel at module level on the server's path.
STANDIN_OPS = (
    "copy_all_layer_kv_cache_cpu",          # kernels/ops/kvcache/cache_move.py
    "assign_req_to_token_pool_cpu",         # mem_cache/allocation.py
    "build_tree_kernel_efficient_cpu",      # speculative decoding (imported, not used without it)
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
)
# What SGLang imports from sgl_kernel.mamba on the CPU, for every Mamba / linear-attention config
# (attention_registry -> linear/kda_backend.py, gdn_backend.py); LFM2's short convolutions call none.
MAMBA_STANDIN_OPS = ("causal_conv1d_update_cpu", "causal_conv1d_fn_cpu", "chunk_gated_delta_rule_cpu")
# torch.ops.sgl_kernel names the same modules read at import (gated delta net ops; LFM2 calls neither).
# No `convert_weight_packed` among them: SGLang's AMX check stays False, its torch fallbacks stay on.
STANDIN_TORCH_OPS = ("fused_sigmoid_gating_delta_rule_update_cpu", "fused_gdn_gating_cpu")
COPY_OPS = ("transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_all_layer_direct_lf_pf")
HOST_POOL_MODULES = ("sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.pool_host.mla",
                     "sglang.srt.mem_cache.pool_host.mamba")
ASSEMBLER_MODULE = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"
PARALLEL_STATE_MODULE = "sglang.srt.distributed.parallel_state"
TORCH_NATIVE_MODULE = "sglang.srt.layers.attention.torch_native_backend"
CONV1D_MODULE = "sglang.srt.layers.attention.mamba.causal_conv1d"


class CudaPresentError(RuntimeError):
    """The support layer is for machines without CUDA; on a GPU SGLang runs as it is."""


# ---------------------------------------------------------------- patch 1: sgl_kernel stand-in
class _StandinKernel(types.ModuleType):
    """`sgl_kernel` (or its `mamba` submodule) with only the ops named; each raises if called (none
    is, on this path)."""

    def __init__(self, name: str, ops: Sequence[str]) -> None:
        super().__init__(name)
        self._ops = tuple(ops)

    def __getattr__(self, name: str):
        if name.startswith("__") or name not in self._ops:
            raise AttributeError(f"module {self.__name__!r} (radixtier's CPU stand-in) has no attribute {name!r}")

        def op(*_args, **_kwargs):
            raise NotImplementedError(f"{self.__name__}.{name}: radixtier's CPU stand-in has no kernels; "
                                      f"this SGLang path needs a real sgl_kernel CPU build")
        op.__name__ = op.__qualname__ = name
        setattr(self, name, op)
        return op


# ---------------------------------------------------------------- patch 2: L1<->L2 copies in torch
# sgl_kernel's signatures (src, dst, indices, ...); on the CPU the "pointers" are the tensors themselves.
def transfer_kv_direct(src_layers: Sequence[Any], dst_layers: Sequence[Any], src_indices: Any, dst_indices: Any,
                       page_size: int) -> None:
    """Token rows from each source layer buffer to the same layer's destination buffer (layer_first)."""
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices.long()] = src[src_indices.long()]


def transfer_kv_per_layer_direct_pf_lf(src_ptrs: Sequence[Any], dst_ptrs: Sequence[Any], src_indices: Any,
                                       dst_indices: Any, layer_id: int, page_size: int) -> None:
    """One layer from a page_first_direct host pool ([pages, layers, page_size, ...]) to the device."""
    idx = src_indices.long()
    for src, dst in zip(src_ptrs, dst_ptrs):
        dst[dst_indices.long()] = src[idx // page_size, layer_id, idx % page_size]


def transfer_kv_all_layer_direct_lf_pf(src_ptrs: Sequence[Any], dst_ptrs: Sequence[Any], src_indices: Any,
                                       dst_indices: Any, page_size: int) -> None:
    """Every layer from the device to a page_first_direct host pool. The device buffers are every
    layer's K, then every layer's V (MHA: two host buffers) or one latent buffer per layer (MLA: one)."""
    layers = len(src_ptrs) // len(dst_ptrs)
    idx = dst_indices.long()
    for b, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            dst[idx // page_size, layer, idx % page_size] = src_ptrs[b * layers + layer][src_indices.long()]


def _patch_host_pool_module(module: types.ModuleType) -> None:
    for name in COPY_OPS:
        if name not in vars(module):  # imported only on CUDA/HIP; never replace a real kernel
            setattr(module, name, globals()[name])


# ---------------------------------------------------------------- patch 3: unpinned, resident host pool
def _unpinned(cls: type) -> type:
    """A host pool class whose instances are built with pin_memory=False and faulted in at once, as
    pinned memory is (left lazy, the first transfer into each page would pay the fault)."""

    class Unpinned(cls):
        def __init__(self, *args, **kwargs):
            kwargs["pin_memory"] = False
            super().__init__(*args, **kwargs)
            buffers = self.kv_buffer if isinstance(self.kv_buffer, (list, tuple)) else [self.kv_buffer]
            for b in buffers:  # the Mamba pool's is a list (temporal state, then each conv state)
                b.zero_()

    Unpinned.__name__ = Unpinned.__qualname__ = cls.__name__
    Unpinned.__module__ = cls.__module__
    return Unpinned


def _patch_assembler(module: types.ModuleType) -> None:
    original = module.get_mha_host_pool_cls

    def get_mha_host_pool_cls(*args, **kwargs):
        return _unpinned(original(*args, **kwargs))

    module.get_mha_host_pool_cls = get_mha_host_pool_cls
    module.MLATokenToKVPoolHost = _unpinned(module.MLATokenToKVPoolHost)
    module.MambaPoolHost = _unpinned(module.MambaPoolHost)  # hybrids' state pool (LFM2, Mamba2, ...)


# ---------------------------------------------------------------- patch 4: gloo, not PyNccl
def _patch_parallel_state(module: types.ModuleType) -> None:
    original = module.init_model_parallel_group

    def init_model_parallel_group(group_ranks, local_rank, backend, use_pynccl=None, *args, **kwargs):
        return original(group_ranks, local_rank, backend, False if use_pynccl is None else use_pynccl,
                         *args, **kwargs)

    module.init_model_parallel_group = init_model_parallel_group


# ---------------------------------------------------------------- patch 5: SWA layers read SWA slots
def swa_rows(pool: Any, layer_id: int, req_to_token: Any, req_pool_indices: Any, seq_lens: Any):
    """(req_to_token, req_pool_indices) for reading layer `layer_id` of `pool`: unchanged for a full
    layer; for a sliding-window layer of an SWAKVPool, the batch's rows translated to SWA slots and
    indices 0..n-1 addressing them (what the AMX backend's `_swa_kv_indices` does)."""
    import torch

    mapping = getattr(pool, "layers_mapping", None)
    if not mapping or not mapping[layer_id][1] or len(req_pool_indices) == 0:
        return req_to_token, req_pool_indices
    rows = req_to_token[req_pool_indices, : int(seq_lens.max())]
    translated = pool.translate_loc_from_full_to_swa(rows).to(req_to_token.dtype)
    return translated, torch.arange(translated.shape[0], dtype=req_pool_indices.dtype,
                                    device=req_pool_indices.device)


def _patch_torch_native(module: types.ModuleType) -> None:
    cls = module.TorchNativeAttnBackend
    if getattr(cls, "_radixtier_swa_rows", False):
        return
    run_extend, run_decode = cls._run_sdpa_forward_extend, cls._run_sdpa_forward_decode
    forward_extend, forward_decode = cls.forward_extend, cls.forward_decode

    def with_layer(forward):
        def wrapped(self, q, k, v, layer, forward_batch, *args, **kwargs):
            self._radixtier_layer = layer.layer_id if self.use_sliding_window_kv_pool else None
            try:
                return forward(self, q, k, v, layer, forward_batch, *args, **kwargs)
            finally:
                self._radixtier_layer = None
        wrapped.__name__ = forward.__name__
        return wrapped

    def with_swa_rows(run):
        def wrapped(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, *args, **kwargs):
            layer_id = getattr(self, "_radixtier_layer", None)
            if layer_id is not None:
                req_to_token, req_pool_indices = swa_rows(self.token_to_kv_pool, layer_id, req_to_token,
                                                          req_pool_indices, seq_lens)
            return run(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                       *args, **kwargs)
        wrapped.__name__ = run.__name__
        return wrapped

    cls.forward_extend, cls.forward_decode = with_layer(forward_extend), with_layer(forward_decode)
    cls._run_sdpa_forward_extend, cls._run_sdpa_forward_decode = with_swa_rows(run_extend), with_swa_rows(run_decode)
    cls._radixtier_swa_rows = True


# ---------------------------------------------------------------- patch 6: short convolutions in torch
def causal_conv1d_fn(x: Any, weight: Any, bias: Any = None, query_start_loc: Any = None, cache_indices: Any = None,
                     has_initial_state: Any = None, conv_states: Any = None, activation: Optional[str] = "silu",
                     pad_slot_id: int = -1, **_kwargs: Any) -> Any:
    """SGLang's varlen causal depthwise conv (prefill) in torch: x (dim, tokens) holds the batch's
    sequences end to end (query_start_loc); each starts from its conv state (conv_states[cache_indices[b]],
    the last inputs it saw) where has_initial_state[b], else from zeros, and leaves its last inputs there."""
    import torch

    dim, width = weight.shape
    starts = [0, x.shape[-1]] if query_start_loc is None else query_start_loc.tolist()
    out = torch.empty_like(x)
    for b in range(len(starts) - 1):
        s, e = starts[b], starts[b + 1]
        idx = None if cache_indices is None else int(cache_indices[b])
        if idx == pad_slot_id:
            continue
        state_len = conv_states.shape[-1] if conv_states is not None and idx is not None else width - 1
        if conv_states is not None and idx is not None and has_initial_state is not None and bool(has_initial_state[b]):
            before = conv_states[idx].to(x.dtype)
        else:
            before = x.new_zeros((dim, state_len))
        full = torch.cat([before, x[:, s:e]], dim=1)
        window = full[:, state_len - (width - 1):]
        y = torch.nn.functional.conv1d(window.unsqueeze(0), weight.unsqueeze(1).to(x.dtype),
                                       None if bias is None else bias.to(x.dtype), groups=dim).squeeze(0)
        out[:, s:e] = torch.nn.functional.silu(y) if activation in ("silu", "swish") else y
        if conv_states is not None and idx is not None:
            conv_states[idx] = full[:, -state_len:].to(conv_states.dtype)
    return out


def causal_conv1d_update(x: Any, conv_state: Any, weight: Any, bias: Any = None, activation: Optional[str] = None,
                         cache_seqlens: Any = None, conv_state_indices: Any = None, pad_slot_id: int = -1) -> Any:
    """SGLang's causal depthwise conv for decode in torch: x (batch, dim[, tokens]) continues each
    request's conv state (conv_state[conv_state_indices[b]]), which is shifted to end with x."""
    import torch

    if cache_seqlens is not None:
        raise NotImplementedError("causal_conv1d_update: a circular conv state (cache_seqlens) has no torch path here")
    dim, width = weight.shape
    squeeze = x.dim() == 2
    x3 = x.unsqueeze(-1) if squeeze else x
    batch, _, tokens = x3.shape
    idx = torch.arange(batch) if conv_state_indices is None else conv_state_indices.long()
    live = idx != pad_slot_id
    out = torch.zeros_like(x3)
    if bool(live.any()):
        rows = idx[live]
        state = conv_state[rows].to(x.dtype)
        state_len = state.shape[-1]
        full = torch.cat([state, x3[live]], dim=-1)
        windows = full[:, :, state_len - (width - 1):].unfold(-1, width, 1)  # (b, dim, tokens, width)
        y = (windows * weight.to(x.dtype)[None, :, None, :]).sum(-1)
        if bias is not None:
            y = y + bias.to(x.dtype)[None, :, None]
        out[live] = torch.nn.functional.silu(y) if activation in ("silu", "swish") else y
        conv_state[rows] = full[:, :, -state_len:].to(conv_state.dtype)
    return out.squeeze(-1) if squeeze else out


def _patch_conv1d(module: types.ModuleType) -> None:
    if getattr(module, "_HAS_CONV1D_KERNEL", False):  # a compiled kernel: never replaced
        return
    module.causal_conv1d_fn = causal_conv1d_fn
    module.causal_conv1d_update = causal_conv1d_update


# patch name -> {module: what to do to it once it is imported}; "sgl_kernel" is the stand-in (no module patch)
PATCHES: Dict[str, Dict[str, Callable[[types.ModuleType], None]]] = {
    "sgl_kernel": {},
    "copy_ops": {name: _patch_host_pool_module for name in HOST_POOL_MODULES},
    "unpinned_host_pool": {ASSEMBLER_MODULE: _patch_assembler},
    "no_pynccl": {PARALLEL_STATE_MODULE: _patch_parallel_state},
    "swa_rows": {TORCH_NATIVE_MODULE: _patch_torch_native},
    "conv1d": {CONV1D_MODULE: _patch_conv1d},
}


# ---------------------------------------------------------------- the import hook
class _PatchingLoader(importlib.abc.Loader):
    """Runs a module's own loader, then its patch: the patch lands before any importer binds a name."""

    def __init__(self, inner: importlib.abc.Loader, patch: Callable[[types.ModuleType], None]) -> None:
        self.inner, self.patch = inner, patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        self.patch(module)


class _SupportFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the sgl_kernel stand-in and wraps the loaders of the modules PATCHES names."""

    def __init__(self, names: set, standin: bool,
                 module_patches: Dict[str, Callable[[types.ModuleType], None]]) -> None:
        self.names, self.standin, self.module_patches = names, standin, module_patches

    def find_spec(self, name: str, path=None, target=None):
        if name in STANDIN_MODULES and self.standin:
            return importlib.machinery.ModuleSpec(name, self, is_package=name == "sgl_kernel")
        patch = self.module_patches.get(name)
        if patch is None:
            return None
        spec = _find_real_spec(name, path, target, skip=self)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec

    def create_module(self, spec):  # the stand-in
        module = _StandinKernel(spec.name, STANDIN_MODULES[spec.name])
        if spec.name == "sgl_kernel":
            module.__path__ = []  # a package, so `sgl_kernel.mamba` can be found; other submodules stay missing
        return module

    def exec_module(self, module) -> None:
        pass


def _find_real_spec(name, path, target, skip):
    for finder in sys.meta_path:
        if finder is skip or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(name, path, target)
        if spec is not None:
            return spec
    return None


STANDIN_MODULES = {"sgl_kernel": STANDIN_OPS, "sgl_kernel.mamba": MAMBA_STANDIN_OPS}
_standin_library = None  # torch.library.Library holding STANDIN_TORCH_OPS (kept alive: dropping it unregisters)


def _register_standin_torch_ops() -> None:
    """torch.ops.sgl_kernel.<name> for STANDIN_TORCH_OPS, each raising NotImplementedError if called."""
    global _standin_library
    import torch

    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name in STANDIN_TORCH_OPS:
        if hasattr(torch.ops.sgl_kernel, name):
            continue
        lib.define(f"{name}(Tensor x) -> Tensor")

        def raising(x, _name=name):
            raise NotImplementedError(f"torch.ops.sgl_kernel.{_name}: radixtier's CPU stand-in has no kernels")
        lib.impl(name, raising, "CompositeExplicitAutograd")
    _standin_library = lib
_installed: Optional[_SupportFinder] = None


def cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


def install(only: Optional[Sequence[str]] = None) -> None:
    """Apply the patches in this process (`only`: just these names of PATCHES, so a test can show one
    patch's reason with the others in place). Installing again with the same patches does nothing;
    with others it is an error (a module already imported cannot be un-patched). Raises
    CudaPresentError on a GPU machine."""
    global _installed
    names = list(PATCHES) if only is None else list(only)
    unknown = sorted(set(names) - set(PATCHES))
    if unknown:
        raise ValueError(f"only: unknown patch {unknown[0]!r} (patches: {', '.join(PATCHES)})")
    if _installed is not None:
        if set(names) != _installed.names:
            raise ValueError(f"only: patches {sorted(_installed.names)} are installed in this process already; "
                             f"{sorted(names)} cannot replace them")
        return
    if cuda_present():
        raise CudaPresentError("radixtier's SGLang CPU support layer is for machines without CUDA; "
                               "on a GPU run sglang.launch_server as it is")
    real_kernel = "sgl_kernel" in sys.modules or importlib.util.find_spec("sgl_kernel") is not None
    module_patches = {mod: fn for name in names for mod, fn in PATCHES[name].items()}
    _installed = _SupportFinder(set(names), standin="sgl_kernel" in names and not real_kernel,
                                module_patches=module_patches)
    sys.meta_path.insert(0, _installed)
    if _installed.standin:
        _register_standin_torch_ops()
    for mod, patch in module_patches.items():  # modules this process imported before install()
        module = sys.modules.get(mod)
        if module is not None:
            patch(module)
