"""The test helpers' device move keeps each input's layout (backends.to)."""
import pytest
import torch

from backends import _to_keeping_strides, require

VIEWS = {
    "expanded": lambda: torch.randn(2, 1, 3).expand(2, 5, 3),       # overlapping
    "column-slice": lambda: torch.randn(2, 100)[:, 32:64],
    "transposed": lambda: torch.randn(4, 5).t(),
    "stepped": lambda: torch.randn(3, 4, 5)[:, ::2, 1:],
    "empty": lambda: torch.randn(2, 3)[:, :0],
    "contiguous": lambda: torch.randn(3, 4),
}


@pytest.mark.parametrize("device", ["meta", "cuda"])
@pytest.mark.parametrize("name", sorted(VIEWS))
def test_device_move_keeps_strides_and_values(name, device):
    if device == "cuda":
        require("cuda")
    torch.manual_seed(0)
    t = VIEWS[name]()
    moved = _to_keeping_strides(t, torch.device(device))
    assert moved.device.type == device
    assert moved.shape == t.shape
    if t.numel():
        assert moved.stride() == t.stride()
    if device != "meta":
        assert torch.equal(moved.cpu(), t)
