"""Hostile input to `radixtier inspect` and `radixtier plan` (issue 28, item 8): each gets a one-line
error naming the field and the value, a non-zero exit, and leaves nothing behind -- never a
traceback, a MemoryError, or a verdict computed from impossible numbers.

Every case runs the real command line in a subprocess, as an operator would."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from typing import Optional

import pytest

from radixtier.storage.nvmeof.layout import (BLOCK, ENTRY_BYTES, HEADER_BYTES, Superblock, TableEntry, align_up)

ADDRESS_SPACE_LIMIT = 384 << 20  # inspect needs ~200 MiB of address space; the claimed tables need GiBs
CRAFTED_SLOTS = 1 << 27  # an 8 GiB slot table
GEOMETRY = ["--layers", "2", "--kv-heads", "1", "--head-dim", "8"]


def run_cli(*args: str, address_space: Optional[int] = None, file_size: Optional[int] = None,
            timeout: float = 120, prelude: str = "") -> subprocess.CompletedProcess:
    """The CLI in a child process, optionally under RLIMIT_AS / RLIMIT_FSIZE (set in the child only),
    after `prelude` (Python run in the child first)."""

    def limit() -> None:
        if address_space is not None:
            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        if file_size is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))  # Python ignores SIGXFSZ: EFBIG

    code = f"import sys\n{prelude}\nfrom radixtier.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=limit)


def one_error_line(out: subprocess.CompletedProcess) -> str:
    """The single line on stderr (the whole of it), after checking the exit code is argparse's 2."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


def craft_namespace(path: str, slots: int, page_bytes: int = 4096, size: Optional[int] = None) -> Superblock:
    """A CRC-valid superblock (one partition) claiming `slots` slots, on a sparse file of `size`
    bytes (default: exactly the size the superblock describes)."""
    table = 2 * BLOCK
    sb = Superblock("ab" * 16, page_bytes, HEADER_BYTES + align_up(page_bytes), slots, 1, table,
                    align_up(table + slots * ENTRY_BYTES), 0)
    with open(path, "wb") as f:
        f.write(sb.pack())
        f.truncate(sb.total_bytes if size is None else size)
    return sb


# -- inspect ---------------------------------------------------------------------------------------


def test_inspect_streams_a_huge_claimed_slot_table_in_flat_memory(tmp_path):
    """A superblock claiming 2**27 slots on a (sparse) target of the size it describes: the 8 GiB
    table is read in bounded chunks, so the report completes under a 384 MiB address-space limit."""
    path = str(tmp_path / "huge.img")
    craft_namespace(path, CRAFTED_SLOTS)
    out = run_cli("inspect", path, address_space=ADDRESS_SPACE_LIMIT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "MemoryError" not in out.stderr and "Traceback" not in out.stderr
    assert f"{CRAFTED_SLOTS} slots, 0 used" in out.stdout


def test_inspect_reads_a_huge_table_without_holes_in_flat_memory(tmp_path):
    """As on a block device, where no hole can be skipped: every byte of a 2 GiB table is read
    (inspect is told the target has no holes), still under the 384 MiB address-space limit."""
    path = str(tmp_path / "device.img")
    craft_namespace(path, 1 << 25)
    no_holes = "import radixtier.storage.nvmeof.inspect as m\nm._next_data = lambda fd, offset: offset"
    out = run_cli("inspect", path, address_space=ADDRESS_SPACE_LIMIT, prelude=no_holes, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "MemoryError" not in out.stderr and f"{1 << 25} slots, 0 used" in out.stdout


def test_inspect_verify_streams_a_huge_claimed_page(tmp_path):
    """A CRC-valid table entry claiming a 1 GiB page: --verify checksums it in bounded chunks and
    reports the bad page, instead of reading 1 GiB at once."""
    path = str(tmp_path / "bigpage.img")
    page = 1 << 30
    sb = craft_namespace(path, 64, page_bytes=page)
    with open(path, "r+b") as f:
        f.seek(sb.entry_offset(0))
        f.write(TableEntry(b"k" * 16, None, 1, page, 0x1234).pack())
    out = run_cli("inspect", path, "--verify", "--json", address_space=ADDRESS_SPACE_LIMIT)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    rep = json.loads(out.stdout)
    assert rep["used"] == 1 and [e["slot"] for e in rep["errors"]] == [0]


def test_inspect_refuses_a_geometry_larger_than_the_target(tmp_path):
    """The same 2**27-slot claim on a 1 MiB file: one line naming the path, the slot count the
    superblock claims and the target's real size."""
    path = str(tmp_path / "small.img")
    sb = craft_namespace(path, CRAFTED_SLOTS, size=1 << 20)
    line = one_error_line(run_cli("inspect", path, address_space=ADDRESS_SPACE_LIMIT))
    assert path in line and f"slots={CRAFTED_SLOTS}" in line and str(sb.total_bytes) in line
    assert str(1 << 20) in line


# -- plan: flags -----------------------------------------------------------------------------------

FOUR_HUNDRED_DIGITS = "1" + "0" * 399


@pytest.mark.parametrize("option, value", [
    ("--layers", "0"), ("--layers", "-2"), ("--layers", "nan"), ("--layers", "1.5"),
    ("--kv-heads", "0"), ("--kv-heads", "-1"), ("--head-dim", "-8"), ("--head-dim", "0"),
    ("--mla-dim", "-5"), ("--mla-dim", "0"), ("--dtype-bytes", "0"), ("--dtype-bytes", "-2"),
    ("--context", "0"), ("--context", "-5"), ("--context", "inf"), ("--context", FOUR_HUNDRED_DIGITS),
    ("--hit-rate", "nan"), ("--hit-rate", "-0.1"), ("--hit-rate", "1.5"), ("--hit-rate", "inf"),
    ("--concurrency", "0"), ("--concurrency", "-1"), ("--concurrency", FOUR_HUNDRED_DIGITS),
    ("--concurrency", "9" * 5000),  # past int()'s digit limit: its ValueError, not a traceback
    ("--prefill-tps", "0"), ("--prefill-tps", "-1"), ("--prefill-tps", "nan"), ("--prefill-tps", "inf"),
    ("--prefill-overhead-s", "-1"), ("--prefill-overhead-s", "nan"), ("--prefill-overhead-s", "inf"),
    ("--prefix-cost-us-per-token", "-1"), ("--prefix-cost-us-per-token", "nan"),
    ("--prefix-cost-us-per-token", "inf"),
    ("--local-gbps", "0"), ("--local-gbps", "nan"), ("--local-gbps", "inf"),
    ("--tier-gbps", "0"), ("--tier-gbps", "-5"), ("--tier-gbps", "1e-320"), ("--tier-gbps", "1e400"),
    ("--net-gbps", "0"), ("--net-gbps", "nan"), ("--net-gbps", "inf"),
])
def test_plan_refuses_impossible_numbers_naming_the_option_and_value(option, value):
    args = dict(zip(GEOMETRY[::2], GEOMETRY[1::2]))
    args[option] = value
    if option == "--mla-dim":
        del args["--kv-heads"], args["--head-dim"]
    out = run_cli("plan", *[x for kv in args.items() for x in kv])
    line = one_error_line(out)
    assert option in line and value[:12] in line and "expected" in line, line
    assert len(line) < 300 and out.stdout == ""  # a 400-digit value is abbreviated, not echoed whole


def test_plan_accepts_the_edges_of_every_range():
    out = run_cli("plan", *GEOMETRY, "--hit-rate", "0", "--prefill-overhead-s", "0", "--json")
    assert out.returncode == 0, out.stderr
    out = run_cli("plan", *GEOMETRY, "--hit-rate", "1", "--context", "1", "--concurrency", "1", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["inputs"]["hit_rate"] == 1.0


# -- plan: config.json -----------------------------------------------------------------------------

LLAMA = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
DEEPSEEK = {"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
            "hidden_size": 7168}


@pytest.mark.parametrize("base, field, value", [
    (LLAMA, "num_hidden_layers", -5), (LLAMA, "num_hidden_layers", 0), (LLAMA, "num_hidden_layers", 1.5),
    (LLAMA, "num_hidden_layers", True), (LLAMA, "num_hidden_layers", "32"), (LLAMA, "num_hidden_layers", 1e300),
    (LLAMA, "num_attention_heads", 0), (LLAMA, "num_attention_heads", -32), (LLAMA, "num_key_value_heads", 0),
    (LLAMA, "num_key_value_heads", -8), (LLAMA, "head_dim", -128), (LLAMA, "hidden_size", 0),
    (LLAMA, "hidden_size", 16),  # smaller than the head count: head_dim would be 0
    (DEEPSEEK, "kv_lora_rank", -512), (DEEPSEEK, "qk_rope_head_dim", -64),
])
def test_plan_config_with_bad_values_names_the_field_and_value(tmp_path, base, field, value):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**base, field: value}))
    line = one_error_line(run_cli("plan", "--config", str(cfg)))
    assert field in line and json.dumps(value).strip('"') in line and str(cfg) in line, line


@pytest.mark.parametrize("text, named", [
    ("[1, 2]", "JSON object"), ("{not json", "JSON"), ('{"text_config": 5, "num_hidden_layers": 2}', "text_config"),
    ('{"num_hidden_layers": 1e400, "num_attention_heads": 8, "hidden_size": 64}', "num_hidden_layers"),
    ('{"num_hidden_layers": NaN, "num_attention_heads": 8, "hidden_size": 64}', "num_hidden_layers"),
])
def test_plan_config_that_is_not_a_config_gets_one_line(tmp_path, text, named):
    cfg = tmp_path / "config.json"
    cfg.write_text(text)
    line = one_error_line(run_cli("plan", "--config", str(cfg)))
    assert named in line and str(cfg) in line, line


# -- plan: --png -----------------------------------------------------------------------------------


def test_plan_png_to_a_full_device_is_an_error_not_a_plot_written():
    out = run_cli("plan", *GEOMETRY, "--png", "/dev/full")
    line = one_error_line(out)
    assert "--png" in line and "/dev/full" in line
    assert "plot written" not in out.stdout


def test_plan_png_that_cannot_be_written_leaves_no_file(tmp_path):
    """A write cut short (here by a 4 KiB file-size limit: EFBIG) removes the partial file it made."""
    png = tmp_path / "plan.png"
    out = run_cli("plan", *GEOMETRY, "--png", str(png), file_size=4096)
    line = one_error_line(out)
    assert "--png" in line and str(png) in line
    assert not png.exists() and list(tmp_path.iterdir()) == []


def test_plan_png_in_a_missing_folder_fails_before_measuring(tmp_path):
    png = tmp_path / "no" / "such" / "plan.png"
    out = run_cli("plan", *GEOMETRY, "--png", str(png), "--measure", str(tmp_path))
    line = one_error_line(out)
    assert "--png" in line and str(png) in line and "measured" not in out.stdout
    assert list(tmp_path.iterdir()) == []
