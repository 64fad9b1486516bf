"""The benchmark's mode names (``benchmarks/train/modes.py``): FSDP2 modes with a compiled loss
(``-closs``) are known and split into their base mode; the suffix is refused where it means
nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from train.modes import mode_name, split_compiled_loss  # noqa: E402


@pytest.mark.parametrize("mode, base", [("fsdp2-compile-ac-closs", "fsdp2-compile-ac"),
                                        ("fsdp2-closs", "fsdp2"),
                                        ("fsdp2-compile-amb0.5-closs", "fsdp2-compile-amb0.5")])
def test_fsdp2_modes_take_a_compiled_loss(mode, base):
    assert mode_name(mode) == mode
    assert split_compiled_loss(mode) == (base, True)
    assert split_compiled_loss(base) == (base, False)


@pytest.mark.parametrize("mode, match", [("shardc-closs", "FSDP2 modes only"),
                                         ("fsdp2-compile-xyz-closs", "unknown mode"),
                                         ("fsdp2-compile-amb2-closs", "ratio")])
def test_a_compiled_loss_is_refused_where_it_means_nothing(mode, match):
    with pytest.raises(ValueError, match=match):
        mode_name(mode)
