import pytest

from radixtier.units import parse_size


@pytest.mark.parametrize("text, n", [("4096", 4096), ("256KiB", 256 << 10), ("4m", 4 << 20), ("1.5GiB", 3 << 29),
                                     ("2TB", 2 * 10**12), (" 8 k ", 8192)])
def test_sizes(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "lots", "4 furlongs", "-1", True])
def test_bad_sizes_say_what_is_accepted(bad):
    with pytest.raises(ValueError, match="expected a size like"):
        parse_size(bad)
