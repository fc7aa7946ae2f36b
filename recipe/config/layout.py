"""The parallel layout as plain arithmetic: tp x cp x dp x pp, alignment, and where a rank sits.

Every degree rule lives here, in one frozen dataclass that needs no process group, so a bad
layout is refused at start-up (or before a rendezvous) with the config field to change, and unit
tests can check the rules without spawning ranks. Ranks are numbered as megatron-core numbers
them (order tp-cp-dp-pp, tp fastest): `groups` checks megatron's own answer against this one.
"""

from __future__ import annotations

from dataclasses import dataclass

from recipe.errors import ConfigError

SUPPORTED_TP = (1, 2, 4)


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of the grid; world size = tp * cp * dp * pp."""

    tp: int = 1
    """Tensor-parallel size (`parallel.tp`)."""
    cp: int = 1
    """Context-parallel size (`cp.size`)."""
    dp: int = 1
    """Data-parallel size (`parallel.dp`)."""
    pp: int = 1
    """Pipeline-parallel stages (`parallel.pp`, megatron's engine only)."""

    def __post_init__(self) -> None:
        for field_name, value in (("parallel.tp", self.tp), ("cp.size", self.cp)):
            if value <= 0:
                raise ConfigError(f"{field_name} must be > 0, got {value}")
        for field_name, value in (("parallel.dp", self.dp), ("parallel.pp", self.pp)):
            if value <= 0:
                raise ConfigError(f"{field_name} must be > 0, got {value}")
        if self.tp not in SUPPORTED_TP:
            raise ConfigError(
                f"parallel.tp={self.tp} is not supported; use one of "
                f"{', '.join(map(str, SUPPORTED_TP))}"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def alignment(self) -> int:
        """Each sequence is padded to a multiple of this: 2*cp*tp under CP (two zigzag chunks per
        rank), tp otherwise."""
        if self.cp > 1:
            return 2 * self.cp * self.tp
        return self.tp

    def check_world_size(self, world_size: int) -> None:
        """Refuse a launcher world that is not this grid, before anyone waits on a rendezvous."""
        if world_size != self.world_size:
            raise ConfigError(
                f"the launcher started {world_size} ranks but {self.product()}; launch "
                f"{self.world_size} processes, or change cp / parallel.dp to fit the launched "
                "world"
            )

    def product(self) -> str:
        """`tp*cp*dp = 1*2*1 = 2` (with `*pp` when pipeline stages are in play), for messages."""
        names, sizes = ["tp", "cp", "dp"], [self.tp, self.cp, self.dp]
        if self.pp > 1:
            names.append("pp")
            sizes.append(self.pp)
        return f"{'*'.join(names)} = {'*'.join(map(str, sizes))} = {self.world_size}"

    def layout_of(self, rank: int) -> ParallelLayout:
        """Where global `rank` sits: megatron's order tp-cp-dp-pp, tensor-parallel ranks
        adjacent, pipeline stages outermost."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        return ParallelLayout(
            dims=self,
            rank=rank,
            tp_rank=rank % self.tp,
            cp_rank=rank // self.tp % self.cp,
            dp_rank=rank // (self.tp * self.cp) % self.dp,
            pp_rank=rank // (self.tp * self.cp * self.dp),
        )


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits in the tp x cp x dp grid."""

    dims: ParallelDims
    rank: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    pp_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @property
    def cp_size(self) -> int:
        return self.dims.cp

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def pp_size(self) -> int:
        return self.dims.pp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """The stage that holds the output layer, the losses (and the MTP block)."""
        return self.pp_rank == self.dims.pp - 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0
