"""The CPU support layer: each patch's reason still holds in SGLang 0.5.23, and the patch removes it.

Every fact is read in a fresh interpreter with SGLang's CPU engine on, given none, one, or all
patches, so a test fails the day SGLang stops needing a patch (or needs another one).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import warnings

import pytest

from radixtier.testing.skips import require_sglang

require_sglang("sglang.srt.mem_cache.hicache_storage")

from radixtier.integrations.sglang.launch import cpu_support  # noqa: E402

pytestmark = pytest.mark.sglang

PROBE = r'''
import importlib.util, json, os, sys
os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
real_kernel = importlib.util.find_spec("sgl_kernel") is not None
only = json.loads(sys.argv[1])  # patch names, or "all"
from radixtier.integrations.sglang.launch import cpu_support
cpu_support.install(None if only == "all" else only)
facts = {}
try:
    import sglang.srt.mem_cache.memory_pool as mp
except ImportError as exc:
    print(json.dumps({"real_kernel": real_kernel, "memory_pool": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)
import torch
import sglang.srt.mem_cache.pool_host.mha as mha
from radixtier.integrations.sglang.launch.cpu_support import COPY_OPS
facts["copy_ops"] = {n: getattr(vars(mha).get(n), "__module__", None) for n in COPY_OPS}
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=16))
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as asm
dev = mp.MHATokenToKVPool(256, 16, torch.bfloat16, 2, 64, 2, "cpu", False, start_layer=0, end_layer=2,
                          enable_alt_stream=False)
try:
    host = asm.build_kv_host_pool(kv_pool=dev, page_size=16, host_size=None)
    facts["host_pool"] = {"pinned": host.pin_memory}
except Exception as exc:
    facts["host_pool"] = f"{type(exc).__name__}: {exc}"
import sglang.srt.distributed.parallel_state as ps
seen = {}
class Coordinator:
    def __init__(self, **kwargs):
        seen.update(kwargs)
ps.GroupCoordinator = Coordinator
ps.init_model_parallel_group([[0]], 0, "gloo")
facts["use_pynccl"] = seen["use_pynccl"]
import sgl_kernel
try:
    sgl_kernel.copy_all_layer_kv_cache_cpu()
except NotImplementedError as exc:
    facts["standin_call"] = str(exc)
try:
    from sgl_kernel.scalar_type import scalar_types
except ImportError as exc:
    facts["standin_submodule"] = type(exc).__name__
facts["standin_other_name"] = hasattr(sgl_kernel, "scalar_types")
# patch 5: a sliding-window layer whose slots differ between the full and the SWA pool (as after a
# host or tier-3 load): a request's tokens sit at full slots 5..12, SWA slots 0..7
import types
from sglang.srt.layers.attention import torch_native_backend as tnb
g = torch.Generator().manual_seed(0)
class SwaPool:
    layers_mapping = {0: (0, True)}
    def __init__(self):
        self.k, self.v = torch.zeros(16, 1, 4), torch.zeros(16, 1, 4)
        self.k[:8], self.v[:8] = torch.randn(8, 1, 4, generator=g), torch.randn(8, 1, 4, generator=g)
        self.full_to_swa = torch.full((64,), -1, dtype=torch.int64)
        self.full_to_swa[5:13] = torch.arange(8)
    def translate_loc_from_full_to_swa(self, loc):
        return self.full_to_swa[loc.long()]
    def get_key_buffer(self, layer_id):
        return self.k
    def get_value_buffer(self, layer_id):
        return self.v
backend = tnb.TorchNativeAttnBackend.__new__(tnb.TorchNativeAttnBackend)
backend.token_to_kv_pool, backend.use_sliding_window_kv_pool, backend.swa_out_cache_loc = SwaPool(), True, None
req_to_token = torch.zeros(2, 32, dtype=torch.int32)
req_to_token[1, :8] = torch.arange(5, 13)
backend.req_to_token_pool = types.SimpleNamespace(req_to_token=req_to_token)
layer = types.SimpleNamespace(layer_id=0, tp_q_head_num=1, tp_k_head_num=1, qk_head_dim=4, v_head_dim=4, scaling=0.5,
                              is_cross_attention=False, sliding_window_size=128)
batch = types.SimpleNamespace(out_cache_loc=None, req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([8]),
                              encoder_lens=None)
q = torch.randn(1, 4, generator=g)
out = backend.forward_decode(q, None, None, layer, batch, save_kv_cache=False)
pool = backend.token_to_kv_pool
want = torch.softmax((pool.k[:8, 0] @ q[0]) * 0.5, dim=0) @ pool.v[:8, 0]
facts["swa_decode_reads_swa_slots"] = bool(torch.allclose(out[0], want, atol=1e-5))
# patch 6: LFM2's short convolutions (SGLang's only CPU path is Triton) and the Mamba host pool's copies
import sglang.srt.mem_cache.pool_host.mamba as mamba_host
facts["mamba_copy_ops"] = {n: getattr(vars(mamba_host).get(n), "__module__", None) for n in COPY_OPS}
from sglang.srt.layers.attention.mamba import causal_conv1d as conv
x, w, state = torch.randn(1, 6, 3, generator=g), torch.randn(6, 4, generator=g), torch.randn(2, 6, 3, generator=g)
want = torch.nn.functional.conv1d(torch.cat([state[1:2], x], -1), w.unsqueeze(1), groups=6)[..., -3:]
try:
    got = conv.causal_conv1d_update(x, state.clone(), w, None, conv_state_indices=torch.tensor([1], dtype=torch.int32))
    facts["conv1d_update"] = bool(torch.allclose(got, want, atol=1e-5))
except Exception as exc:
    facts["conv1d_update"] = type(exc).__name__
print(json.dumps(facts))
'''


PATCH_SETS = {"none": [], "standin only": ["sgl_kernel"], "all": "all"}


@pytest.fixture(scope="module")
def probes():
    """The probe under each patch set, each in its own fresh interpreter, the three run at once
    (each is mostly SGLang's imports)."""
    if cpu_support.cuda_present():
        pytest.skip("CUDA present: SGLang runs without the CPU support layer")
    procs = {name: subprocess.Popen([sys.executable, "-c", PROBE, json.dumps(only)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
             for name, only in PATCH_SETS.items()}
    facts = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"probe with patches {name!r} failed:\n{err[-3000:]}"
        facts[name] = json.loads(out.strip().splitlines()[-1])
    return facts


def test_without_the_standin_sglangs_cpu_engine_cannot_import_its_memory_pool(probes):
    """Patch 1's reason: no CPU build of sgl_kernel, and the CPU engine imports its ops at module level."""
    facts = probes["none"]
    assert facts["real_kernel"] is False, "a real sgl_kernel is installed: the stand-in is moot"
    assert facts["memory_pool"] == "ModuleNotFoundError: No module named 'sgl_kernel'"


def test_without_patches_2_to_6_each_reason_holds(probes):
    facts = probes["standin only"]
    assert facts["copy_ops"] == {n: None for n in cpu_support.COPY_OPS}  # patch 2: imported on CUDA/HIP only
    assert "NVIDIA driver" in facts["host_pool"]  # patch 3: the host pool is built pinned
    assert facts["use_pynccl"] is True  # patch 4: PyNccl by default, even on the CPU
    assert facts["swa_decode_reads_swa_slots"] is False  # patch 5: SWA layers read with full-pool slots
    assert facts["mamba_copy_ops"] == {n: None for n in cpu_support.COPY_OPS}  # patch 6: CUDA/HIP only
    assert facts["conv1d_update"] == "RuntimeError"  # patch 6: Triton, which finds no GPU driver


def test_with_every_patch_sglangs_cpu_path_builds(probes):
    facts = probes["all"]
    assert facts["copy_ops"] == {n: cpu_support.__name__ for n in cpu_support.COPY_OPS}
    assert facts["host_pool"]["pinned"] is False
    assert facts["use_pynccl"] is False
    assert facts["swa_decode_reads_swa_slots"] is True
    assert facts["mamba_copy_ops"] == {n: cpu_support.__name__ for n in cpu_support.COPY_OPS}
    assert facts["conv1d_update"] is True
    assert "radixtier's CPU stand-in has no kernels" in facts["standin_call"]  # never called on this path
    assert facts["standin_submodule"] == "ModuleNotFoundError"  # SGLang's own fallbacks take over
    assert facts["standin_other_name"] is False


def test_every_standin_op_is_still_imported_by_sglang():
    """A name SGLang no longer imports from sgl_kernel is stale. (One it newly imports on the server's
    path fails the real server's start with an ImportError naming it: the real-server tests see that.)"""
    import ast

    import sglang

    imported = {"sgl_kernel": set(), "sgl_kernel.mamba": set()}
    torch_ops = set()
    for f in pathlib.Path(sglang.__file__).parent.rglob("*.py"):
        text = f.read_text(errors="replace")
        if "sgl_kernel" not in text:  # no import of it can hide in this file: parse only the rest
            continue
        try:
            with warnings.catch_warnings():  # SGLang's own sources: their invalid escapes are not ours to report
                warnings.simplefilter("ignore")
                tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in imported:
                imported[node.module] |= {a.name for a in node.names}
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                  and node.value.attr == "sgl_kernel" and isinstance(node.value.value, ast.Attribute)
                  and node.value.value.attr == "ops"):
                torch_ops.add(node.attr)  # torch.ops.sgl_kernel.<name>
    stale = [n for n in cpu_support.STANDIN_OPS if n not in imported["sgl_kernel"]]
    assert not stale, f"SGLang no longer imports {stale} from sgl_kernel: drop them from STANDIN_OPS"
    stale = [n for n in cpu_support.MAMBA_STANDIN_OPS if n not in imported["sgl_kernel.mamba"]]
    assert not stale, f"SGLang no longer imports {stale} from sgl_kernel.mamba: drop them from MAMBA_STANDIN_OPS"
    stale = [n for n in cpu_support.STANDIN_TORCH_OPS if n not in torch_ops]
    assert not stale, f"SGLang no longer reads torch.ops.sgl_kernel.{stale}: drop them from STANDIN_TORCH_OPS"


def test_install_refuses_unknown_patches_and_a_second_different_set():
    with pytest.raises(ValueError, match="only: unknown patch 'pinned'"):
        cpu_support.install(["pinned"])
    if cpu_support.cuda_present():
        pytest.skip("CUDA present: the layer does not install")
    cpu_support.install()  # as the SGLang harness does in this process
    cpu_support.install()
    with pytest.raises(ValueError, match="cannot replace them"):
        cpu_support.install(["sgl_kernel"])
