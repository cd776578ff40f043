"""The Megatron trainer group's options as `dsv4flash serve` takes them; parsed without importing torch or veRL,
so a bad flag answers in milliseconds (exit 2, one line naming it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

TRAINERS = ("local", "megatron")
SAMPLERS = ("local", "dsv4flash", "vllm")
LAYOUT_KEYS = ("tp", "ep", "cp", "pp", "dp")


@dataclass(frozen=True)
class TrainerLayout:
    """Megatron parallel sizes of the trainer group: tensor, expert, context, pipeline and data parallel."""

    tp: int = 1
    ep: int = 1
    cp: int = 1
    pp: int = 1
    dp: int | None = None  # None: what the number of workers leaves (world / (tp·cp·pp))

    @classmethod
    def parse(cls, text: str) -> "TrainerLayout":
        """`ep=2,tp=1,…` (any subset of tp, ep, cp, pp, dp; each a positive integer) -> TrainerLayout."""
        sizes: dict[str, int] = {}
        for part in (p.strip() for p in str(text).split(",")):
            if not part:
                continue
            key, eq, value = part.partition("=")
            key = key.strip()
            if not eq or key not in LAYOUT_KEYS:
                raise ValueError(f"--trainer-layout: {part!r} is not one of {', '.join(k + '=N' for k in LAYOUT_KEYS)}")
            if key in sizes:
                raise ValueError(f"--trainer-layout: {key} is given twice")
            try:
                size = int(value)
            except ValueError:
                size = 0
            if size < 1:
                raise ValueError(f"--trainer-layout: {key}={value.strip()!r} is not a positive integer")
            sizes[key] = size
        return cls(**sizes)

    def world(self, workers: int | None = None) -> int:
        """The group's number of ranks: `workers` when given (checked), else the least that holds the layout."""
        dense = self.tp * self.cp * self.pp  # ranks of one data-parallel replica
        experts = self.ep * self.tp * self.pp  # Megatron's expert layout needs world % (ep·tp·pp) == 0
        least = math.lcm(dense * (self.dp or 1), experts)
        if workers is None:
            return least if self.dp is None else self._checked(dense * self.dp, experts)
        if workers < 1:
            raise ValueError(f"--workers: expected a positive integer, got {workers}")
        if self.dp is not None and workers != dense * self.dp:
            raise ValueError(f"--workers {workers}: the layout's tp·cp·pp·dp is {dense * self.dp}")
        return self._checked(workers, experts, dense)

    @staticmethod
    def _checked(world: int, experts: int, dense: int | None = None) -> int:
        if dense is not None and world % dense:
            raise ValueError(f"--workers {world}: not a multiple of tp·cp·pp = {dense}")
        if world % experts:
            raise ValueError(f"--workers {world}: not a multiple of the layout's ep·tp·pp = {experts}"
                             if dense is not None else
                             f"--trainer-layout: {world} ranks are not a multiple of ep·tp·pp = {experts}")
        return world

    def describe(self) -> str:
        """`tp=1,ep=2,cp=1,pp=1` (dp left out when derived)."""
        return ",".join(f"{k}={getattr(self, k)}" for k in LAYOUT_KEYS if getattr(self, k) is not None)


@dataclass(frozen=True)
class ComputePlane:
    """What trains and what samples: `dsv4flash serve --trainer/--sampler/--ray-address/--trainer-layout/--workers`
    plus the trainer group's placement shell (`placement` preset at `max_rank`: every admitted policy's LoRA
    modules and rank fit inside it)."""

    trainer: str = "local"
    sampler: str = "local"
    ray_address: str = "local"
    layout: TrainerLayout = TrainerLayout()
    workers: int | None = None
    placement: str = "decoder_half"
    max_rank: int = 16
    micro_batch: int = 1  # rows per micro-batch: the CSA2 model takes packed (THD) input one sequence at a time
    replicas: int = 1  # sampler replicas (--sampler dsv4flash|vllm)
    max_adapters: int = 8  # adapters a replica keeps loaded (LRU; an evicted one is reloaded from the store)
    sampler_model: str | None = None  # --sampler vllm: the release-layout checkpoint vLLM serves

    def __post_init__(self) -> None:
        if self.trainer not in TRAINERS:
            raise ValueError(f"--trainer: {self.trainer!r} is not one of {', '.join(TRAINERS)}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"--sampler: {self.sampler!r} is not one of {', '.join(SAMPLERS)}")
        check_ray_address(self.ray_address)
        if self.max_rank < 1:
            raise ValueError(f"--trainer-max-rank: expected a positive integer, got {self.max_rank}")
        if self.sampler == "vllm" and not self.sampler_model:
            raise ValueError("--sampler vllm: needs --sampler-model DIR, the release-layout checkpoint of the served "
                             "base (vLLM loads the release layout)")
        for flag, value in (("--sampler-replicas", self.replicas), ("--sampler-max-adapters", self.max_adapters)):
            if value < 1:
                raise ValueError(f"{flag}: expected a positive integer, got {value}")
        if self.micro_batch < 1:
            raise ValueError(f"--trainer-micro-batch: expected a positive integer, got {self.micro_batch}")
        self.world()  # the layout and --workers agree

    @property
    def remote(self) -> bool:
        """Whether anything runs on Ray (a Megatron trainer group or sampler replicas)."""
        return self.trainer == "megatron" or self.sampler in ("dsv4flash", "vllm")

    def world(self) -> int:
        """Ranks of the trainer group."""
        return self.layout.world(self.workers)


def check_ray_address(address: str) -> str:
    """`local` (a Ray cluster of this process, on 127.0.0.1), `auto` (the cluster `ray start` made here) or
    HOST:PORT of a cluster's head; ValueError naming the flag otherwise."""
    if address in ("local", "auto"):
        return address
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--ray-address: {address!r} is not local, auto or HOST:PORT")
    return address
