"""rayconv.mesh.Mesh: rank <-> (dp, pp, fs) coordinates, the groups along each axis, role names."""

from __future__ import annotations

import itertools

import pytest

from rayconv.mesh import AXES, Mesh


MESHES = [(1, 1, 1), (4, 1, 1), (1, 3, 1), (1, 1, 4), (2, 3, 2), (3, 2, 4), (2, 1, 3)]


@pytest.mark.parametrize("shape", MESHES)
def test_mesh_rank_coord_round_trip(shape):
    mesh = Mesh(*shape)
    assert mesh.world_size == shape[0] * shape[1] * shape[2]
    coords = [mesh.coord(r) for r in range(mesh.world_size)]
    assert sorted(coords) == list(itertools.product(*(range(n) for n in shape)))  # a bijection
    for r, c in enumerate(coords):
        assert mesh.rank(c) == r
        assert mesh.rank(tuple(c)) == r
    assert mesh.coord(mesh.world_size - 1) == tuple(n - 1 for n in shape)


@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("axis", AXES)
def test_mesh_groups_partition_the_ranks(shape, axis):
    mesh = Mesh(*shape)
    i = AXES.index(axis)
    groups = mesh.groups(axis)
    flat = [r for g in groups for r in g]
    assert sorted(flat) == list(range(mesh.world_size))           # every rank exactly once
    assert len(groups) == mesh.world_size // shape[i]
    for g in groups:
        assert len(g) == shape[i]
        cs = [mesh.coord(r) for r in g]
        assert [c[i] for c in cs] == list(range(shape[i]))         # in coordinate order
        others = {tuple(v for j, v in enumerate(c) if j != i) for c in cs}
        assert len(others) == 1                                     # differ only along `axis`
        for r in g:
            assert mesh.group_of(r, axis) == g


@pytest.mark.parametrize("shape", MESHES)
def test_fs_groups_are_contiguous_ranks(shape):
    mesh = Mesh(*shape)
    for g in mesh.groups("fs"):
        assert g == list(range(g[0], g[0] + mesh.fs))


def test_mesh_role_names():
    assert Mesh(1, 1, 1).role(0) == "dp0"
    assert [Mesh(3, 1, 1).role(r) for r in range(3)] == ["dp0", "dp1", "dp2"]
    assert [Mesh(1, 2, 1).role(r) for r in range(2)] == ["pp0", "pp1"]
    assert [Mesh(1, 1, 2).role(r) for r in range(2)] == ["fs0", "fs1"]
    assert Mesh(2, 2, 2).role(5) == "dp1-pp0-fs1"
    assert Mesh(2, 3, 1).role(5) == "dp1-pp2"
    for shape in MESHES:
        mesh = Mesh(*shape)
        roles = [mesh.role(r) for r in range(mesh.world_size)]
        assert len(set(roles)) == len(roles)


def test_mesh_rejects_degree_zero():
    with pytest.raises(ValueError, match="fs"):
        Mesh(2, 1, 0)
