"""Starting SGLang with radixtier: the `sglang.srt.plugins` entry point (plugin.py), real
`sglang.launch_server` processes for the demo, tests and benches (server.py), and SGLang's server on
a machine without CUDA (cpu_support.py, cpu_server.py)."""
