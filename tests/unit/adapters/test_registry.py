import pytest

from ucm.adapters.base import load_adapter_class
from ucm.errors import AdapterNotFoundError


def test_unknown_adapter_name():
    with pytest.raises(AdapterNotFoundError, match=r"No 'ucm.adapters' driver found, looking for 'floppy'"):
        load_adapter_class("floppy")
