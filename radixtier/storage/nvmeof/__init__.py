"""The NVMe-oF namespace: on-device layout, target opening, partition leases, I/O engines, the page store."""
