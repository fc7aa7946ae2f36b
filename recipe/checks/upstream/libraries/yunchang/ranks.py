"""The stand-ins and the rank runner: one process plays every rank of one ring x ulysses group,
the release's own set_seq_parallel_pg building the groups its functions read.

Shipped into reproducers verbatim (`inspect.getsource`, with truth.py): every class and function
here is self-contained (torch and the shipped truth only), so a reproducer runs a release exactly
as the checker does.
"""

from recipe.checks.upstream.libraries.yunchang.truth import group_ranks, make_value


class StandInMissing(RuntimeError):
    """The release asked a stand-in for something it does not play: the checker must learn it."""


class Group:
    """A process group as torch's new_group numbers it: group rank = index in the sorted ranks."""

    def __init__(self, ranks):
        self.ranks = sorted(int(r) for r in ranks)

    def __repr__(self):
        return f"Group({self.ranks})"


class GroupMaker:
    """The `torch` set_seq_parallel_pg sees: only distributed.new_group, returning a Group."""

    def __init__(self):
        self.distributed = self

    def new_group(self, ranks=None, *args, **kwargs):
        return Group(ranks)

    def __getattr__(self, name):
        raise StandInMissing(f"set_seq_parallel_pg asked torch for {name!r}")


class DistOfRank:
    """torch.distributed as the functions see it on rank `rank`: group ranks and sizes."""

    def __init__(self, rank):
        self.rank = rank

    def get_rank(self, group=None):
        if group is None:
            return self.rank
        if self.rank not in group.ranks:
            raise StandInMissing(f"rank {self.rank} asks its rank in {group}, not its own group")
        return group.ranks.index(self.rank)

    def get_world_size(self, group=None):
        if group is None:
            raise StandInMissing("the functions asked the world size of the default group")
        return len(group.ranks)

    def __getattr__(self, name):
        raise StandInMissing(f"the functions asked torch.distributed for {name!r}")


def run_ranks(module, groups, function_name, case, options):
    """The release's function on every rank of one sequence-parallel group: per rank
    {"shape", "ids"} of its shard, or {"raises": "..."}. `groups` is the release's globals module
    (its set_seq_parallel_pg builds the groups the function reads)."""
    ring, ulysses = case["ring"], case["ulysses"]
    world = ring * ulysses
    low = options.get("use_ulysses_low", True)
    extra = {"dim": options["dim"]} if "dim" in options else {}
    value = make_value(case, options.get("dim", 1))
    groups.torch = GroupMaker()
    outputs = []
    for rank in range(world):
        groups.set_seq_parallel_pg(ulysses, ring, rank, world, use_ulysses_low=low)
        made = groups.PROCESS_GROUP
        says = (made.RING_PG.ranks.index(rank), made.ULYSSES_PG.ranks.index(rank))
        if says != group_ranks(rank, ring, ulysses, low):
            raise StandInMissing(
                f"set_seq_parallel_pg gives rank {rank} (ring, ulysses) ranks {says} in "
                f"{made.RING_PG} and {made.ULYSSES_PG}; the checker expects "
                f"{group_ranks(rank, ring, ulysses, low)}"
            )
        module.dist = DistOfRank(rank)
        try:
            shard = getattr(module, function_name)(
                value.clone(), rank, world_size=world, rd=ring, ud=ulysses, **extra
            )
        except StandInMissing:
            raise
        except Exception as err:  # noqa: BLE001 (a raise is the release's answer on this case)
            outputs.append({"raises": f"{type(err).__name__}: {err}".strip()})
            continue
        outputs.append({"shape": list(shard.shape), "ids": shard.flatten().tolist()})
    return outputs
