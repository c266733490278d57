"""`ucm bench sparse`'s argument checks that run before any model loads."""
import argparse

import pytest

from ucm.bench.engines.sparse_setup import reselect_every
from ucm.errors import ArgumentError


@pytest.mark.parametrize("raw, want", [("1", [1]), ("1,4", [1, 4]), (" 2 , 8 ", [2, 8])])
def test_reselect_every_values(raw, want):
    assert reselect_every(argparse.Namespace(reselect_every=raw)) == want


@pytest.mark.parametrize("raw", ["0", "1,0", "-2", "a", "1.5", "", ","])
def test_a_bad_reselect_every_names_the_flag(raw):
    with pytest.raises(ArgumentError, match="--reselect-every .*comma-separated ints >= 1"):
        reselect_every(argparse.Namespace(reselect_every=raw))
