"""SGLang's real server on a CPU-only machine, run as `python -m radixtier.integrations.sglang.cpu_server ARGS`.

ARGS are `sglang.launch_server`'s own. This module installs radixtier's CPU support layer
(`cpu_support`: six patches, each for a named reason) and then runs `sglang.launch_server` as
`python -m sglang.launch_server ARGS` would. SGLang starts its scheduler and detokenizer processes
with multiprocessing's spawn method, which imports the parent's `__main__` module (the documented
`radixtier.integrations.sglang.cpu_server`, which imports this one) in each child as `__mp_main__`
before it unpickles anything of SGLang's, so every process gets the patches before its first SGLang
import. On a machine with CUDA it refuses: run SGLang as it is.
"""

from __future__ import annotations

import os
import runpy
import sys

from radixtier.integrations.sglang.launch import cpu_support

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # SGLang's CPU path (else it imports vllm's CUDA ops)
try:
    cpu_support.install()
except cpu_support.CudaPresentError as exc:
    sys.exit(f"radixtier: {exc}")



def main() -> None:
    """Run `sglang.launch_server` with sys.argv. alter_sys=False keeps the running module as
    __main__, so SGLang's spawned processes import it (and so this layer) before anything of SGLang's."""
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)


if __name__ == "__main__":
    main()
