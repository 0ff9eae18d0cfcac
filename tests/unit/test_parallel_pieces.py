"""Pieces of a parallel part without Ray: filter split's sliced dropout masks, compiled segments ending
at exchanges and bucket sizes and compiling only the full step's shapes, data-parallel gradient buckets
in a one-rank gloo group, the process-group rendezvous."""

from __future__ import annotations

import torch
from torch import nn

from rayconv.parallel.data_parallel import GradientSync
from rayconv.parallel.filter_split.exchanges import Gather
from rayconv.parallel.filter_split.layers import SlicedDropout
from rayconv.parallel.segments import CompiledSegment, fix_shapes, segments


def test_sliced_dropout_slices_make_up_one_full_mask():
    x = torch.ones(4, 6, 3, 3)
    cpu = torch.device("cpu")
    whole = SlicedDropout(0.5, [6], 0)
    whole.reseed(123, cpu)
    want = whole(x)
    parts = []
    for index in (0, 1):
        d = SlicedDropout(0.5, [3, 3], index)
        d.reseed(123, cpu)
        parts.append(d(x[:, 3 * index:3 * index + 3]))
    assert torch.equal(torch.cat(parts, dim=1), want)
    assert not torch.equal(parts[0], parts[1])          # the slices do not repeat one mask
    assert set(want.unique().tolist()) == {0.0, 2.0}    # inverted dropout scaling
    d.reseed(124, cpu)
    assert not torch.equal(d(x[:, 3:]), parts[1])       # a new step draws new masks
    assert torch.equal(d.eval()(x[:, 3:]), x[:, 3:])


def test_segments_end_at_the_bucket_size_and_keep_exchanges_eager():
    lin = [nn.Linear(16, 16) for _ in range(5)]  # 272 parameters, 1088 bytes each
    gather = Gather(1, [8, 8], 0, None, False)
    runs = segments([lin[0], lin[1], gather, lin[2], lin[3], lin[4]], max_bytes=2 * 1088)
    assert [(c, len(ms)) for c, ms in runs] == [(True, 2), (False, 1), (True, 2), (True, 1)]
    assert runs[1][1][0] is gather
    assert [(c, len(ms)) for c, ms in segments(lin, None)] == [(True, 5)]


def test_a_compiled_segment_compiles_the_full_steps_shapes_only():
    """After ``fix_shapes`` (the run's first full step), a partial batch, an evaluation chunk and the
    eval mode run the layers eagerly: no new compilation, the same outputs as the eager layers."""
    graphs = []

    def backend(gm, example_inputs):  # counts the graphs dynamo hands over, runs them as they are
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    seg = CompiledSegment(seq, backend=backend)
    full, partial = torch.randn(8, 4), torch.randn(5, 4)
    seg(full)
    assert len(graphs) == 1
    fix_shapes([nn.Sequential(seg)])
    seg(full)
    assert len(graphs) == 1                        # the same shape: its compiled graph again
    for x in (partial, full[:3]):
        assert torch.equal(seg(x), seq(x))         # (train mode: the batch's own statistics)
    seq.eval()
    with torch.no_grad():
        assert torch.equal(seg(full), seq(full))
    assert len(graphs) == 1                        # nothing compiled for the other shapes or modes
    assert seg._orig_mod is seq


def test_gradient_sync_buckets_keep_channels_last_gradients(tmp_path):
    """GradientSync in a real one-rank gloo process group: the sum over one replica is the gradient
    itself, whatever the parameter's memory layout; a parameter without a gradient gets zeros."""
    import torch.distributed as dist


    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    sync = None
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.Flatten(),
                              nn.Linear(16, 3))
        model.to(memory_format=torch.channels_last)
        unused = nn.Parameter(torch.ones(5))
        params = [*model.parameters(), unused]
        sync = GradientSync(params, dist.new_group([0]), bucket_mb=0.001, first_bucket_mb=0.0001)
        assert len(sync.buckets) > 2
        x = torch.randn(2, 3, 6, 6).contiguous(memory_format=torch.channels_last)
        model(x).sum().backward()
        want = {id(p): p.grad.clone() for p in model.parameters()}
        strides = {id(p): p.grad.stride() for p in model.parameters()}
        model.zero_grad(set_to_none=True)
        sync.arm()
        model(x).sum().backward()
        sync.finish()
        for p in model.parameters():
            torch.testing.assert_close(p.grad, want[id(p)], rtol=0, atol=0)
            assert p.grad.stride() == strides[id(p)]
        assert torch.equal(unused.grad, torch.zeros(5))
    finally:
        if sync is not None:
            sync.close()  # else its hooks keep the gloo group (and its threads) alive until exit
        dist.destroy_process_group()


def test_the_rendezvous_holds_its_port_from_the_moment_its_address_is_given():
    """``comm.open_rendezvous`` hands out an address whose port is already bound (no other process can
    take it before rank 0 joins), and rank 0's ``join_world`` uses that store: a one-rank gloo group
    forms through it."""
    import errno
    import socket

    import torch.distributed as dist

    from rayconv.parallel import comm

    address = comm.open_rendezvous("127.0.0.1", 30.0)
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        try:
            s.bind(("", int(port)))
            bound_by_another = False
        except OSError as e:
            bound_by_another = e.errno == errno.EADDRINUSE
    assert bound_by_another, f"{address}'s port was free after open_rendezvous returned"
    try:
        comm.join_world(address, 0, 1, "gloo", 30.0)
        t = torch.ones(3)
        dist.all_reduce(t)
        assert torch.equal(t, torch.ones(3))
        assert comm._opened is None   # (rank 0 joined through its own store)
    finally:
        comm.destroy()
