"""SimpleMPIScheduler: every MPI rank takes one device of its node, by its rank on that node.

NEML2's MPI scheduler, for jobs launched with ``mpiexec``: the ranks are
grouped by host, and the k-th rank on a host uses the k-th listed device, so
each rank owns one device of its node exclusively. The helpers here (which
ranks share a node) also place the device workers of :mod:`dsched.mpi`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from dsched.schedulers.base import DeviceStatus, SingleDeviceScheduler, build_status

__all__ = ["SimpleMPIScheduler", "NodePlacement", "node_name", "world_comm", "place_on_nodes"]

# Set by MPI launchers (MPICH/Hydra, Open MPI, PMIx, Slurm): their presence means
# "started under mpiexec/srun", so initialising MPI is expected, not a side effect.
_LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "SLURM_PROCID")

# Overrides the host name ranks are grouped by: for nodes that share a host name
# (containers), or to lay out several "nodes" on one machine for testing.
NODE_NAME_VARIABLE = "DSCHED_NODE_NAME"


def node_name() -> str:
    """The name this rank's node is grouped by: ``$DSCHED_NODE_NAME``, else MPI's processor name."""
    name = os.environ.get(NODE_NAME_VARIABLE, "").strip()
    if name:
        return name
    if "mpi4py.MPI" in sys.modules:  # never initialise MPI just to learn the host name
        return sys.modules["mpi4py.MPI"].Get_processor_name()
    import socket

    return socket.gethostname()


def world_comm():
    """``MPI.COMM_WORLD`` when this process runs under an MPI launcher, else ``None`` (one rank).

    Outside a launcher MPI is not initialised at all (importing ``mpi4py.MPI``
    would), unless the program already imported it.
    """
    launched = any(v in os.environ for v in _LAUNCHER_VARIABLES)
    if not launched and "mpi4py.MPI" not in sys.modules:
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD


@dataclass(frozen=True)
class NodePlacement:
    """Where one rank stands among the participating ranks of its node.

    ``local_rank`` is its index among them (in rank order), ``local_size`` their
    number, ``nodes`` maps every node name to the world ranks taking part there.
    """

    host: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    nodes: dict


def place_on_nodes(comm, participate: bool = True) -> NodePlacement:
    """Group the ranks of ``comm`` by node (a collective call: every rank must make it).

    Ranks passing ``participate=False`` (a Dask scheduler or client rank, say)
    are left out of the local numbering; their ``local_rank`` is ``-1``.
    With ``comm=None`` this process is the only rank.
    """
    host = node_name()
    if comm is None:
        return NodePlacement(host, 0, 1, 0 if participate else -1, int(participate), {host: [0] if participate else []})
    rank, size = comm.Get_rank(), comm.Get_size()
    everyone = comm.allgather((host, bool(participate)))
    nodes: dict = {}
    for r, (name, takes_part) in enumerate(everyone):
        nodes.setdefault(name, [])
        if takes_part:
            nodes[name].append(r)
    mine = nodes[host]
    local_rank = mine.index(rank) if participate else -1
    return NodePlacement(host, rank, size, local_rank, len(mine), nodes)


def check_ranks_fit(
    placement: NodePlacement,
    devices,
    what: str = "MPI ranks",
    hint: str = "start at most {n} ranks per node, list more devices, or pass allow_shared=True to share devices round-robin",
) -> None:
    """A ValueError naming the first node with more participating ranks than devices.

    Every rank sees every node, so all ranks raise the same error together
    (none is left waiting in a collective call).
    """
    for host, ranks in placement.nodes.items():
        if len(ranks) > len(devices):
            listed = ", ".join(str(d) for d in devices)
            raise ValueError(
                f"devices: host {host!r} runs {len(ranks)} {what} but only {len(devices)} devices are listed "
                f"({listed}); {hint.format(n=len(devices))}"
            )


def _check_comm(comm):
    if comm is not None and not all(hasattr(comm, m) for m in ("Get_rank", "Get_size", "allgather")):
        raise ValueError(f"comm: expected an mpi4py communicator, got {comm!r}")
    return comm


class SimpleMPIScheduler(SingleDeviceScheduler):
    """One device per MPI rank, chosen by the rank's index among the ranks on its node.

    Ranks are grouped by host (MPI's processor name, or ``$DSCHED_NODE_NAME``);
    the k-th rank of a node takes ``devices[k]`` with its batch size and
    capacity, then schedules exactly like :class:`SimpleScheduler` on it.
    Fewer ranks than devices leaves the rest idle.

    Parameters
    ----------
    devices : list of str or Device
        No duplicates, at most one CPU, a bare ``cuda`` never next to ``cuda:N``.
    batch_sizes, capacities : scalar or list
        A scalar or a list of one broadcasts; otherwise one value per device.
        Capacities default to the batch sizes.
    comm : mpi4py communicator, optional
        Defaults to ``MPI.COMM_WORLD``; without mpi4py or outside ``mpiexec``
        this process is the only rank. Construction is collective over ``comm``.
    allow_shared : bool
        More ranks on a node than devices is a ValueError unless this is true;
        then devices are assigned round-robin (``devices[k % len(devices)]``)
        and ranks sharing a device each keep their own capacity.

    Attributes
    ----------
    device : Device
        This rank's device.
    local_rank, local_size : int
        This rank's index among the ranks of its node, and their number.
    host : str
        The node name the ranks were grouped by.

    Examples
    --------
    Outside ``mpiexec`` the process is one rank and takes the first device:

    >>> s = SimpleMPIScheduler(["cpu", "cuda:0"], batch_sizes=[8, 64])
    >>> s.device, s.local_rank, s.local_size, s.schedule_work()
    (Device('cpu'), 0, 1, (Device('cpu'), 8))
    """

    def __init__(self, devices, batch_sizes, capacities=None, *, comm=None, allow_shared=False):
        if not isinstance(allow_shared, bool):
            raise ValueError(f"allow_shared: expected True or False, got {allow_shared!r}")
        listed = build_status(devices, batch_sizes, capacities)
        placement = place_on_nodes(_check_comm(comm) if comm is not None else world_comm())
        if not allow_shared:
            check_ranks_fit(placement, [s.device for s in listed])
        chosen = listed[placement.local_rank % len(listed)]
        super().__init__([DeviceStatus(chosen.device, chosen.batch_size, chosen.capacity)])
        self.listed_devices = [s.device for s in listed]
        self.placement = placement
        self.host = placement.host
        self.local_rank = placement.local_rank
        self.local_size = placement.local_size

    def __repr__(self):
        s = self._status[0]
        return (
            f"SimpleMPIScheduler(host={self.host!r}, rank={self.placement.rank}, local_rank={self.local_rank}/"
            f"{self.local_size}, device={s.device}, batch={s.batch_size}, capacity={s.capacity}, load={s.load})"
        )
