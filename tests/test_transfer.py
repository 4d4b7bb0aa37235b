"""Host -> device copies without a wait (cluster_fl/transfer.py): on a CPU the values, dtypes and
shapes (flattened) come back as they went in; the GPU side is exercised by tests/gpu/."""

from __future__ import annotations

import torch

from cluster_fl.transfer import to_device, to_device_together


def test_on_the_host_a_copy_is_the_tensor_itself():
    x = torch.arange(6.0).view(2, 3)
    assert to_device(x, "cpu") is x


def test_tensors_travel_together_with_their_values_and_dtypes():
    xs = [torch.randn(2, 3, dtype=torch.float64), torch.tensor([1, 2], dtype=torch.int64),
          torch.randn(4), torch.zeros(0)]
    out = to_device_together(xs, torch.device("cpu"))
    assert [o.dtype for o in out] == [x.dtype for x in xs]
    assert all(torch.equal(o, x.reshape(-1)) for o, x in zip(out, xs))
