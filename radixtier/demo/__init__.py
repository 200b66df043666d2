"""The demo and its serving loop (toy model, workloads). The core never imports this package;
the CLI imports it only when the `demo` command runs (it needs torch and transformers)."""
