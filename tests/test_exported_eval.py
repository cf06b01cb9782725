"""`Runner.evaluate` over a torch.export training graph (tp, pp cut from export): the graph has the model's
training-mode ops fixed in it, and `executor.parallel.exported_eval` runs them as `module.eval()` runs the model."""
import torch
import torch.nn as nn

from executor.parallel import exported_eval


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.drop = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.relu(self.bn(self.conv(x)))).sum(dim=(2, 3))


def test_exported_graph_evaluates_as_eval_mode_and_leaves_batch_norm_state():
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(2, 3, 8, 8)
    net(x)  # one training forward: running statistics and counter away from their initial values
    graph = torch.export.export(net, (x,)).module()
    state = {k: v.clone() for k, v in graph.state_dict().items()}
    net.eval()
    with torch.no_grad():
        want = net(x)
        with exported_eval([graph]):
            got, again = graph(x), graph(x)
    assert torch.allclose(got, want, atol=1e-6) and torch.equal(got, again)
    # the graph's in-place add to num_batches_tracked (before its batch norm) ran anyway before the fix: 1 -> 3
    assert all(torch.equal(v, state[k]) for k, v in graph.state_dict().items()), graph.state_dict()


def test_batch_norm_without_running_statistics_and_rrelu_evaluate_as_eval_mode():
    # BatchNorm(track_running_stats=False) normalises with the batch's statistics in eval mode too (forcing
    # training=False raised "running_mean must be defined in evaluation mode"); RReLU's slope is its mean in eval
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6, track_running_stats=False), nn.RReLU(), nn.Linear(6, 2))
    x = torch.randn(8, 4)
    graph = torch.export.export(net, (x,)).module()
    net.eval()
    with torch.no_grad():
        want = net(x)
        with exported_eval([graph]):
            got = graph(x)
    assert torch.allclose(got, want, atol=1e-6), (got, want)
