"""Meshes shardc shards over: 1-D (FSDP), 2-D ``("replicate", "shard")`` (HSDP) and 2-D
``("dp", "tp")`` (FSDP on ``dp`` of a model parallelized with torch's tensor-parallel API on
``tp``).

Whatever the mesh, shardc shards the tensor a rank would otherwise hold (the plain parameter, or a
tensor-parallel parameter's tp-local tensor) on dim 0 over one 1-D process group, the *shard group*
(``shard`` or ``dp``). On an HSDP mesh the gradient is then averaged over the *replicate group* as
well. Every sharded parameter is a DTensor on the whole mesh, with the placements DCP needs to save
and load it in global coordinates:

- 1-D: ``(Shard(0),)``;
- HSDP: ``(Replicate(), Shard(0))``;
- FSDP+TP: ``(dp placement, tp placement)``, where the tp placement is the one the tensor-parallel
  API gave it and the dp placement is ``Shard(0)``, or ``_StridedShard(0, split_factor=tp)`` when tp
  already split dim 0 (dp then splits each tp shard, not the global tensor, so in global
  coordinates the dp pieces interleave with the tp pieces; this is how ``fully_shard`` places them
  too).

Inside a forward, the gathered tp-local tensor is wrapped again as a DTensor on the tp sub-mesh
with the tensor-parallel placements (:func:`wrap_tp`), so the parallelized module's forward runs
unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from shardc import _torch
from shardc.runtime.collectives import group_name_of

HSDP_DIM_NAMES = ("replicate", "shard")
TP_DIM_NAMES = ("dp", "tp")


def _strided_shard(dim: int, split_factor: int) -> Placement:
    """``_StridedShard`` (private in torch 2.11-2.14, see :mod:`shardc._torch`)."""
    return _torch.strided_shard(dim, split_factor)


@dataclass(frozen=True)
class TpSpec:
    """How a tensor-parallel parameter was placed on the tp sub-mesh before shardc sharded it."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]


@dataclass(frozen=True)
class MeshLayout:
    """The roles of the dimensions of the mesh given to :func:`shardc.shard`.

    ``kind``: ``"fsdp"`` (1-D), ``"hsdp"`` or ``"fsdp+tp"``. ``shard_mesh``: the 1-D mesh dim 0 is
    sharded over; ``replicate_mesh``: HSDP's replicate dimension; ``tp_mesh``: the tensor-parallel
    dimension (FSDP+TP).
    """

    kind: str
    mesh: DeviceMesh
    shard_mesh: DeviceMesh
    replicate_mesh: DeviceMesh | None = None
    tp_mesh: DeviceMesh | None = None

    @property
    def shard_world(self) -> int:
        return self.shard_mesh.size()

    @property
    def shard_rank(self) -> int:
        return self.shard_mesh.get_local_rank()

    @property
    def shard_group_name(self) -> str:
        return group_name_of(self.shard_mesh.get_group())

    @property
    def replicate_world(self) -> int:
        return self.replicate_mesh.size() if self.replicate_mesh is not None else 1

    @property
    def replicate_group_name(self) -> str:
        if self.replicate_mesh is None:
            return ""
        return group_name_of(self.replicate_mesh.get_group())

    def group_roles(self) -> dict[str, tuple[str, int]]:
        """Process group name -> (role, ranks) of each dimension: ``shard``, ``replicate``, ``tp``
        (the planner names the group of every collective it plans by these)."""
        roles = {self.shard_group_name: ("shard", self.shard_world)}
        if self.replicate_mesh is not None:
            roles[self.replicate_group_name] = ("replicate", self.replicate_world)
        if self.tp_mesh is not None:
            roles[group_name_of(self.tp_mesh.get_group())] = ("tp", self.tp_mesh.size())
        return roles


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (``mesh`` itself if it was not sliced).

    DeviceMesh has no public accessor for it in torch 2.11-2.14; :func:`shardc._torch.root_mesh`
    uses the private ones. Without either, ``mesh`` counts as its own root, so a slice is judged
    on its own ranks (:func:`check_mesh_covers_world` then rejects a legitimate slice; its message
    names the opt-out)."""
    root = _torch.root_mesh(mesh)
    return root if isinstance(root, DeviceMesh) else mesh


def _ranks(mesh: DeviceMesh) -> list[int]:
    return [int(r) for r in mesh.mesh.flatten().tolist()]


def _shown(ranks: list[int], limit: int = 16) -> str:
    return str(ranks) if len(ranks) <= limit else f"[{', '.join(map(str, ranks[:limit]))}, ...]"


def check_mesh_covers_world(mesh: DeviceMesh, world: int) -> None:
    """Raise ``ValueError`` unless ``mesh`` covers all ``world`` ranks of the default process
    group or is a slice of a mesh that does (e.g. ``mesh["dp"]`` of a ``("pp", "dp")`` mesh).

    Only the mesh and the world size decide, never this rank's place in them: every rank that
    passes the same mesh gets the same answer, before shardc issues any collective."""
    ranks = _ranks(mesh)
    if sorted(ranks) == list(range(world)):
        return
    root = root_mesh(mesh)
    root_ranks = _ranks(root) if root is not mesh else ranks
    if sorted(root_ranks) == list(range(world)):
        return
    names = f" {mesh.mesh_dim_names}" if mesh.mesh_dim_names else ""
    sliced = "" if root is mesh else (
        f", sliced from a mesh over ranks {_shown(sorted(root_ranks))} that does not cover it "
        "either")
    raise ValueError(
        f"shardc.shard: the mesh{names} of shape {tuple(mesh.shape)} over ranks "
        f"{_shown(ranks)} does not cover the world (the default process group has {world} ranks)"
        f"{sliced}. Sharding over it would leave the ranks outside it unsynchronized: each group "
        "of ranks would train its own copy of the model. Build one mesh over every rank with "
        "init_device_mesh (e.g. init_device_mesh(device_type, (pp, dp), mesh_dim_names=('pp', "
        "'dp'))) and pass the slice you shard over (mesh['dp']), or pass the world's mesh; if "
        "you synchronize the model across these meshes yourself, pass "
        "shardc.shard(..., allow_partial_mesh=True)."
    )


def resolve_layout(mesh: DeviceMesh) -> MeshLayout:
    """Check ``mesh`` and name the role of each of its dimensions (raises with the fix)."""
    if mesh.ndim == 1:
        return MeshLayout("fsdp", mesh, mesh)
    if mesh.ndim != 2:
        raise NotImplementedError(
            f"shardc.shard: got a {mesh.ndim}-D mesh {tuple(mesh.shape)}; shardc supports 1-D "
            f"meshes (FSDP) and 2-D meshes named {HSDP_DIM_NAMES} (HSDP) or {TP_DIM_NAMES} "
            "(FSDP+TP). Flatten the other dimensions or pass a sub-mesh, e.g. mesh['dp', 'tp']."
        )
    names = tuple(mesh.mesh_dim_names or ())
    if names == HSDP_DIM_NAMES:
        return MeshLayout("hsdp", mesh, mesh["shard"], replicate_mesh=mesh["replicate"])
    if names == TP_DIM_NAMES:
        return MeshLayout("fsdp+tp", mesh, mesh["dp"], tp_mesh=mesh["tp"])
    raise ValueError(
        f"shardc.shard: a 2-D mesh {tuple(mesh.shape)} needs mesh_dim_names {HSDP_DIM_NAMES} "
        f"(HSDP: replicate across, shard within) or {TP_DIM_NAMES} (FSDP on dp of a "
        f"tensor-parallel model on tp), in that order; got {names or None}. Build it with "
        f"init_device_mesh(device_type, (r, s), mesh_dim_names={HSDP_DIM_NAMES!r})."
    )


def check_param(fqn: str, p: torch.Tensor, layout: MeshLayout) -> None:
    """Raise if parameter ``p`` cannot be sharded on ``layout`` (naming the parameter and fix)."""
    if not isinstance(p, DTensor):
        return
    if layout.tp_mesh is None:
        raise ValueError(
            f"shardc.shard: parameter {fqn!r} is already a DTensor (on mesh "
            f"{p.device_mesh.mesh_dim_names or tuple(p.device_mesh.shape)}); shardc shards plain "
            "parameters, or tensor-parallel ones when given a 2-D mesh named ('dp', 'tp') whose "
            "'tp' sub-mesh is the one the model was parallelized on."
        )
    if p.device_mesh != layout.tp_mesh:
        raise ValueError(
            f"shardc.shard: parameter {fqn!r} is a DTensor on mesh "
            f"{p.device_mesh.mesh_dim_names} {p.device_mesh.mesh.tolist()}, which is not the 'tp' "
            f"sub-mesh {layout.tp_mesh.mesh.tolist()} of the mesh given to shardc.shard; "
            "parallelize the model on mesh['tp'] of the same (dp, tp) mesh."
        )
    for placement in p.placements:
        if not isinstance(placement, (Shard, Replicate)) or (
            isinstance(placement, Shard) and type(placement) is not Shard
        ):
            raise NotImplementedError(
                f"shardc.shard: parameter {fqn!r} has tensor-parallel placement {placement}; "
                "shardc supports Shard(d) and Replicate() on the tp dimension."
            )


def tp_spec(p: torch.Tensor) -> TpSpec | None:
    """The tensor-parallel placement of ``p``, or None for a plain parameter."""
    if not isinstance(p, DTensor):
        return None
    return TpSpec(p.device_mesh, tuple(p.placements), p.shape, tuple(p.stride()))


def rank_tensor(p: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``p`` before shardc: the tp-local tensor or the plain tensor."""
    return p.to_local() if isinstance(p, DTensor) else p


def placements(layout: MeshLayout, tp: TpSpec | None) -> list[Placement]:
    """The placements of a sharded parameter on ``layout.mesh`` (see the module docstring)."""
    if layout.kind == "fsdp":
        return [Shard(0)]
    if layout.kind == "hsdp":
        return [Replicate(), Shard(0)]
    if tp is None:
        return [Shard(0), Replicate()]
    (tp_placement,) = tp.placements
    split = layout.tp_mesh.size()
    if isinstance(tp_placement, Shard) and tp_placement.dim == 0 and split > 1:
        return [_strided_shard(0, split), tp_placement]
    return [Shard(0), tp_placement]


def wrap_tp(full_local: torch.Tensor, tp: TpSpec) -> DTensor:
    """The gathered tp-local tensor as the DTensor the tensor-parallel module expects."""
    return DTensor.from_local(full_local, tp.mesh, tp.placements, run_check=False,
                              shape=tp.shape, stride=tp.stride)
