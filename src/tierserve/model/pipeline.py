"""Pipeline-parallel placement of one rank: which contiguous layers its stage holds, and where its
hidden states come from and go (``docs/pp.md``).

A node of ``pp_size`` S and ``tp_size`` T has S * T ranks; rank ``s * T + t`` is tensor rank t of
stage s. Stage 0 embeds the tokens, the last stage applies the final norm and the LM head; between
them each tensor rank sends its (replicated) hidden states to the same tensor rank of the next stage.
Stages hold the layers of a partition: the one given (``--pp-layer-partition``) or vLLM's default
split, as even as can be (``default_split``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tierserve.core.layer_split import split_layers


@dataclass(frozen=True)
class PipelineStage:
    """Stage ``stage`` of ``size``. ``prev``/``next``: the global ranks this rank receives hidden
    states from and sends them to (None at the first / last stage); ``group``: the process group
    of those point-to-point messages (None: the default group, whose timeout bounds each one)."""

    stage: int = 0
    size: int = 1
    prev: int | None = None
    next: int | None = None
    group: dist.ProcessGroup | None = None
    partition: tuple[int, ...] | None = None  # layers per stage; None: ``default_split``

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.size - 1

    def layers(self, num_layers: int) -> range:
        """This stage's layers of a model of ``num_layers``: its share of ``partition`` (or of the
        default split); ``PipelineParallelError`` when that does not split these layers."""
        counts = split_layers(num_layers, self.size, self.partition)
        start = sum(counts[: self.stage])
        return range(start, start + counts[self.stage])

    def receive(self, rows: int, hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The previous stage's hidden states for ``rows`` tokens (every stage runs the same batch,
        so the shape is known without a message)."""
        buffer = torch.empty(rows, hidden, dtype=dtype, device=device)
        dist.recv(buffer, src=self.prev, group=self.group)
        return buffer

    def send(self, hidden: torch.Tensor) -> None:
        """Hands this stage's output to the next stage (blocks until it is taken: gloo's send)."""
        dist.send(hidden.contiguous(), dst=self.next, group=self.group)


SOLE = PipelineStage()


def stage_of(rank: int, tp_size: int, pp_size: int, group: dist.ProcessGroup | None = None,
             partition: tuple[int, ...] | None = None) -> PipelineStage:
    """The stage of global ``rank`` in a node of ``tp_size`` x ``pp_size`` ranks, with its peers and
    the node's layer ``partition`` (None: the default split)."""
    stage, tp_rank = divmod(rank, tp_size)
    prev = (stage - 1) * tp_size + tp_rank if stage > 0 else None
    nxt = (stage + 1) * tp_size + tp_rank if stage < pp_size - 1 else None
    return PipelineStage(stage, pp_size, prev, nxt, group, partition)
