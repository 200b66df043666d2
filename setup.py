"""Build script: metadata lives in setup.cfg; this file only adds the native extensions.

All are optional: where one does not build, the pure-Python path it stands in for is used instead.
`radixtier._slotpool` is a page pool's free() in one pass (radixtier/_slotpool.c; needs only a C
compiler). `radixtier.storage.nvmeof._fence` issues a write only before the partition lease's
deadline, the check in C (radixtier/storage/nvmeof/_fence.c; needs only a C compiler; without it the check
runs in Python, which a pause can outlast, and the store says so when it opens). The io_uring
extension links the system liburing (Debian/Ubuntu: liburing-dev, which
scripts/setup.sh installs); where liburing's headers are missing the build skips it with a
warning, and the page store uses its preadv/pwritev thread pool instead (it says so at open).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("radixtier._slotpool", ["radixtier/_slotpool.c"], optional=True,
                  extra_compile_args=["-O2", "-Wall"]),
        Extension("radixtier.storage.nvmeof._fence", ["radixtier/storage/nvmeof/_fence.c"], optional=True,
                  extra_compile_args=["-O2", "-Wall"]),
        Extension("radixtier.storage.nvmeof._uring",
                  ["radixtier/storage/nvmeof/_uring.c", "radixtier/storage/nvmeof/_pagebatch.c", "radixtier/storage/nvmeof/_crc32c.c"],
                  depends=["radixtier/storage/nvmeof/_native.h"], libraries=["uring"], optional=True,
                  extra_compile_args=["-O2", "-Wall", "-Wno-missing-field-initializers"]),
    ],
)
