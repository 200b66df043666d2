"""`python -m radixtier.integrations.sglang.cpu_server ARGS`: SGLang's real server on a machine without
CUDA -- the documented name of `launch/cpu_server.py` (see there).

Importing the implementation installs the CPU support layer; SGLang's spawned processes import this
module again as `__mp_main__`, so they get the patches too."""

from radixtier.integrations.sglang.launch import cpu_server as _impl

if __name__ == "__main__":
    _impl.main()
