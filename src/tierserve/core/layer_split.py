"""How a pipeline-parallel node's stages split a model's layers (``docs/pp.md``): vLLM's default
split or a partition the user gives (``--pp-layer-partition``, as vLLM's ``VLLM_PP_LAYER_PARTITION``).
Torch-free, so the command line checks a partition before anything heavy loads."""

from __future__ import annotations


class PipelineParallelError(ValueError):
    """The model cannot be split into these stages; the message names the numbers."""


def default_split(num_layers: int, size: int) -> tuple[int, ...]:
    """vLLM's default split (``get_pp_indices``): ``num_layers // size`` layers per stage, and one
    more on each of the ``num_layers % size`` stages just before the last, so 3 layers at PP 2 are
    (2, 1), 4 at PP 3 (1, 2, 1), 5 at PP 3 (2, 2, 1). The last stage never takes an extra layer as
    it also runs the final norm and the LM head; the first takes one only when every stage but the
    last does, as it also holds the embedding (compute and memory stay balanced)."""
    base, extra = divmod(num_layers, size)
    counts = [base] * size
    for i in range(2, extra + 2):
        counts[-i] += 1
    return tuple(counts)


def split_layers(num_layers: int, size: int, partition: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Layers per stage: ``partition`` when given, else ``default_split``; ``PipelineParallelError``
    unless every one of the ``size`` stages gets at least one layer and they add up to ``num_layers``."""
    check_layers(num_layers, size, partition)
    return partition if partition is not None else default_split(num_layers, size)


def check_layers(num_layers: int, size: int, partition: tuple[int, ...] | None = None) -> None:
    """Raises ``PipelineParallelError`` unless ``size`` stages can split ``num_layers`` (as ``partition``
    says, when given), each holding at least one layer."""
    if size < 1:
        raise PipelineParallelError(f"pipeline-parallel size must be at least 1, not {size}")
    if partition is not None:
        check_partition(partition, size)
        if sum(partition) != num_layers:
            raise PipelineParallelError(f"the layer partition {_text(partition)} adds up to {sum(partition)} "
                                        f"layers, but the model has {num_layers}")
    elif num_layers < size:
        raise PipelineParallelError(
            f"pipeline-parallel size {size} is above the model's {num_layers} layers: a stage would hold none")


def check_partition(partition: tuple[int, ...], size: int) -> None:
    """What needs no model: one entry per stage, each at least one layer (``PipelineParallelError``)."""
    if len(partition) != size:
        raise PipelineParallelError(f"the layer partition {_text(partition)} names {len(partition)} stage(s), "
                                    f"but the pipeline-parallel size is {size}")
    if min(partition) < 1:
        raise PipelineParallelError(f"the layer partition {_text(partition)} leaves a stage without layers "
                                    "(each needs at least one)")


def layer_partition(text: str) -> tuple[int, ...]:
    """``--pp-layer-partition``'s value: layers per stage, comma-separated ("11,10,10")."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"not a comma-separated list of layer counts: {text!r}") from None


def _text(partition: tuple[int, ...]) -> str:
    return ",".join(map(str, partition))
