"""The region and peer tables the proxy resolves through: what they refuse. (How records resolve through them
is the translate model's test, tests/transportd_models/test_translate.py, and the engine's differential test.)"""

from __future__ import annotations

import pytest

from transportd.dataplane.tables import PeerTable, RegionTable


def test_table_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="region id"):
        RegionTable().set(1 << 16, 0, 1, 1)
    with pytest.raises(ValueError, match="aligned"):
        PeerTable(2).set_flags(1, 0x1004, 4, 1)
    with pytest.raises(ValueError, match="world"):
        PeerTable(1 << 17)
