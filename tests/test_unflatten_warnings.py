"""The executor's torch.export unflattening (tp, and pp cut from export) does not print torch's own deprecation
warning on every rank of a user's training script."""
import warnings

import torch
import torch.nn as nn

from executor.graph_ops import unflatten


def test_unflatten_keeps_torchs_leafspec_warning_out_of_the_users_output():
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    ep = torch.export.export(net, (x,), strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        root = unflatten(ep)
    assert not [w for w in caught if "LeafSpec" in str(w.message)], [str(w.message) for w in caught]
    assert torch.allclose(root(x), net(x))
