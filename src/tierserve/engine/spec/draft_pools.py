"""Where a speculative draft's KV lives beside the target's (docs/speculative.md, draft KV in the cache): checked and
planned before the engine sizes its pools."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tierserve.cache.device_pool import DeviceKVPool, KVGeometry
from tierserve.cache.draft_kv import DraftShard
from tierserve.cache.options import DraftLayout
from tierserve.cache.sharded.shards import HeadRange
from tierserve.core.model_config import ModelConfig, UnsupportedModelError
from tierserve.engine.config import EngineConfig, SpeculativeAlgorithm
from tierserve.model.attention import KVStore, LayerHooks
from tierserve.model.eagle import EagleSpec, eagle_spec
from tierserve.model.identity import model_identity
from tierserve.model.parallel import SINGLE, TensorParallel, TensorParallelError, check_model, kv_heads_of


class DraftMismatchError(ValueError):
    """The draft model cannot serve this target (missing folder, other vocabulary, too short)."""


def check_draft(target_dir: Path, draft_dir: Path, max_model_len: int | None = None) -> ModelConfig:
    """The draft's config, or ``DraftMismatchError`` saying why ``draft_dir`` cannot draft for the
    model in ``target_dir``: drafts are verified token id by token id, so vocabularies must match."""
    if not (Path(draft_dir) / "config.json").is_file():
        raise DraftMismatchError(f"--speculative-draft-model-path {draft_dir} is not a model folder (no config.json)")
    target, draft = ModelConfig.from_dir(Path(target_dir)), _draft_config(Path(draft_dir))
    if draft.vocab_size != target.vocab_size:
        raise DraftMismatchError(f"the draft model's vocabulary ({draft.vocab_size} tokens) differs from the "
                                 f"target's ({target.vocab_size}): drafts could not be verified")
    needed = max_model_len or target.max_position
    if draft.max_position < needed:
        raise DraftMismatchError(f"the draft model has {draft.max_position} positions, the engine needs {needed}")
    return draft


def _draft_config(draft_dir: Path) -> ModelConfig:
    """The draft's config; ``DraftMismatchError`` naming what this build cannot read in it."""
    try:
        return ModelConfig.from_dir(draft_dir)
    except (UnsupportedModelError, KeyError) as exc:
        raw = json.loads((draft_dir / "config.json").read_text())
        hint = "; a speculators-format head: flatten its transformer_layer_config into config.json" \
            if "transformer_layer_config" in raw else ""
        what = f"config.json has no {exc}" if isinstance(exc, KeyError) else str(exc)
        raise DraftMismatchError(f"--speculative-draft-model-path {draft_dir}: {what}{hint}") from None


def draft_geometry(draft: ModelConfig, target: KVGeometry, plane: int = 0,
                   tp: TensorParallel = SINGLE) -> KVGeometry:
    """The draft's KV shape on tensor rank ``tp``: its layers and its share of the KV heads (split as
    the target's are, docs/tp.md), the target's page size and dtype; an EAGLE head's layers come
    after its feature plane's ``plane`` layers (``engine/spec/eagle.py``)."""
    heads = tp.heads(draft.num_heads, draft.num_kv_heads).kv_heads
    return KVGeometry(plane + draft.num_layers, heads, draft.head_dim, target.page_size, target.dtype)


def check_draft_split(draft: ModelConfig, tp_size: int) -> None:
    """The draft is split over the target's tensor ranks like the target (its heads and MLP rows):
    ``DraftMismatchError`` when ``tp_size`` cannot split it."""
    try:
        check_model(draft, tp_size)
    except TensorParallelError as exc:
        raise DraftMismatchError(f"the draft model cannot be split like the target: {exc}") from None


def check_eagle(target_dir: Path, draft_dir: Path, draft: ModelConfig) -> EagleSpec:
    """What the EAGLE head in ``draft_dir`` is (either layout); it reads the target's hidden states,
    so their widths must match, and an EAGLE-3 head's layers must be the target's."""
    target = ModelConfig.from_dir(Path(target_dir))
    try:
        spec = eagle_spec(Path(draft_dir), target.num_layers)
    except (FileNotFoundError, ValueError) as exc:
        raise DraftMismatchError(str(exc)) from None
    hidden = target.hidden_size
    if draft.hidden_size != hidden:
        raise DraftMismatchError(f"the EAGLE head's hidden size ({draft.hidden_size}) differs from the target's "
                                 f"({hidden}): it could not read the target's hidden states")
    return spec


def resolve_layout(asked: DraftLayout, target: KVGeometry, draft: KVGeometry) -> DraftLayout:
    """Packed needs the draft's KV rows shaped like the target's (heads, head size, dtype), so its
    layers can be more layers of the same pages; ``AUTO`` packs whenever they are."""
    fits = (draft.num_kv_heads, draft.head_dim, draft.dtype) == (target.num_kv_heads, target.head_dim, target.dtype)
    if asked is DraftLayout.AUTO:
        return DraftLayout.PACKED if fits else DraftLayout.SIDECAR
    if asked is DraftLayout.PACKED and not fits:
        raise DraftMismatchError(f"--speculative-draft-layout packed needs the draft's KV rows shaped like the "
                                 f"target's: {draft.num_kv_heads} x {draft.head_dim} vs {target.num_kv_heads} x "
                                 f"{target.head_dim} ({draft.dtype} vs {target.dtype}); use sidecar or auto")
    return asked


def draft_layout(config: EngineConfig) -> DraftLayout | None:
    """The layout ``config``'s draft resolves to at its TP size (None without a draft), read from the
    model folders before anything loads; ``DraftMismatchError`` when the draft cannot run. A draft
    model's is the same at any size; an EAGLE head's ``auto`` is packed at TP 1 and, where a tensor
    rank holds fewer of the target's KV heads than the replicated head has, the sidecar."""
    path = config.speculative_draft_model_path
    if path is None:
        return None
    draft = check_draft(config.model_dir, path, config.max_model_len)
    eagle = config.spec_algorithm is SpeculativeAlgorithm.EAGLE
    if eagle:
        check_eagle(config.model_dir, path, draft)
    else:
        check_draft_split(draft, config.tp_size)
    target = ModelConfig.from_dir(config.model_dir)
    # a replicated EAGLE head's rows beside one tensor rank's of the target, else the whole models'
    target_heads = kv_heads_of(0, config.tp_size, target.num_kv_heads)[1] if eagle else target.num_kv_heads
    shape = [KVGeometry(c.num_layers, heads, c.head_dim, 1, torch.float32)
             for c, heads in ((target, target_heads), (draft, draft.num_kv_heads))]
    return resolve_layout(config.speculative_draft_layout, *shape)


def draft_problem(config: EngineConfig) -> str | None:
    """Why ``config``'s draft cannot run, or None (also without one), read from the model folders
    before anything loads (``tierserve serve``, prefill and decode nodes, ``tierserve up``)."""
    try:
        draft_layout(config)
    except DraftMismatchError as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class DraftPlan:
    """The draft's KV ``geometry`` and resolved ``layout``; ``identity`` names both in the cache
    namespace (the draft's weights, and the layout: packed and sidecar store other bytes);
    ``heads``: this tensor rank's KV heads of the draft (the sidecar's L3 objects name them);
    ``here``: whether this rank runs the draft and holds its KV (pipeline stages: the last only,
    docs/speculative.md, layouts). Every rank has the plan, so every rank keeps the same books.
    ``writes``: whether this rank writes the sidecar's L3 objects (of the tensor ranks holding the
    same rows, the first: an EAGLE head is replicated on every one, a draft with fewer KV heads than
    ranks shares each head as the target does)."""

    layout: DraftLayout
    geometry: KVGeometry
    identity: str
    heads: HeadRange
    here: bool = True
    writes: bool = True

    @classmethod
    def of(cls, config: EngineConfig, target: KVGeometry, max_model_len: int, target_kv_heads: int | None = None,
           tp: TensorParallel = SINGLE, here: bool = True) -> DraftPlan | None:
        """The plan for ``config`` (None without a draft) on tensor rank ``tp``, whose ``target``
        geometry holds its share of the target's ``target_kv_heads`` (default: all of them); raises
        ``DraftMismatchError``. A draft model is split like the target, so its layout is decided on
        the whole models' KV rows (every rank decides alike); an EAGLE head is replicated on every
        tensor rank (``engine/spec/eagle.py``), so on its whole rows beside one rank's of the target."""
        path = config.speculative_draft_model_path
        if path is None:
            return None
        draft = check_draft(config.model_dir, path, max_model_len)
        eagle = config.spec_algorithm is SpeculativeAlgorithm.EAGLE
        plane = check_eagle(config.model_dir, path, draft).plane_layers if eagle else 0
        if not eagle:
            check_draft_split(draft, tp.size)
        split = SINGLE if eagle else tp
        whole = target if eagle else dataclasses.replace(target, num_kv_heads=target_kv_heads or target.num_kv_heads)
        layout = resolve_layout(config.speculative_draft_layout, whole, draft_geometry(draft, target, plane))
        mine = split.heads(draft.num_heads, draft.num_kv_heads)
        # the ranks holding the same rows (a replicated head; more ranks than KV heads): the first writes them
        replicas = tp.size // split.size * max(1, split.size // draft.num_kv_heads)
        identity = f"{model_identity(Path(path))}/{layout.value}{'/eagle' if eagle else ''}"  # eagle: read another way
        return cls(layout, draft_geometry(draft, target, plane, split), identity,
                   HeadRange(mine.kv_start, mine.kv_heads, draft.num_kv_heads), here, tp.rank % replicas == 0)

    @property
    def shard(self) -> DraftShard:
        """This rank's share of a sidecar's rows, as its L3 objects see it."""
        return DraftShard(self.heads, self.writes)

    @property
    def packed_layers(self) -> int:
        """Layers the draft adds to every page of the target's pools (packed; 0: sidecar), on the
        ranks that hold it."""
        return self.geometry.num_layers if self.layout is DraftLayout.PACKED else 0

    @property
    def bytes_per_token(self) -> int:
        """This rank's draft KV bytes per token (0 where it holds none)."""
        return self.geometry.bytes_per_token if self.here else 0

    def pool_geometry(self, target: KVGeometry) -> KVGeometry:
        """The engine pool's: packed (where the draft is), the target's layers then the draft's."""
        if not self.here or not self.packed_layers:
            return target
        return dataclasses.replace(target, num_layers=target.num_layers + self.packed_layers)

    def sidecar_pool(self, num_pages: int, device: torch.device) -> DeviceKVPool | None:
        """The sidecar's device pool, with the target pool's page ids; None when packed or elsewhere."""
        sidecar = self.layout is DraftLayout.SIDECAR and self.here
        return DeviceKVPool(self.geometry, num_pages, device) if sidecar else None

    def store(self, pool: DeviceKVPool, sidecar: DeviceKVPool | None, target_layers: int) -> DraftKV | None:
        """Where the draft's KV is (None on a rank without the draft)."""
        if not self.here:
            return None
        kv = sidecar if sidecar is not None else OffsetKV(pool, target_layers)
        return DraftKV(kv, target_layers)


class OffsetKV:
    """The draft's layers of a packed pool: draft layer i is pool layer ``offset + i``. Its
    ``geometry`` and ``num_pages`` are those layers' (context parallelism reads it as a pool)."""

    def __init__(self, pool: DeviceKVPool, offset: int) -> None:
        self.pool, self.offset, self.buffer = pool, offset, pool.buffer
        self.geometry = dataclasses.replace(pool.geometry, num_layers=pool.geometry.num_layers - offset)
        self.num_pages = pool.num_pages

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.layer(self.offset + layer_id)


class _OffsetHooks:
    """A step's layer hooks as the draft sees them: its layer i is layer ``offset + i`` of the
    step's loads (whose events cover the draft's copies) and handoffs (which send its KV)."""

    def __init__(self, inner: LayerHooks, offset: int) -> None:
        self.inner, self.offset = inner, offset

    def before_attention(self, layer_id: int) -> None:
        self.inner.before_attention(self.offset + layer_id)

    def after_kv_written(self, layer_id: int) -> None:
        self.inner.after_kv_written(self.offset + layer_id)


@dataclass(frozen=True)
class DraftKV:
    """Where the draft model reads and writes its KV (``kv``: a packed pool's draft layers or the
    sidecar pool, both indexed by the target's page ids); its layer i is layer ``offset + i`` of
    loads and handoffs."""

    kv: KVStore
    offset: int

    def hooks(self, inner: LayerHooks | None) -> LayerHooks | None:
        return _OffsetHooks(inner, self.offset) if inner is not None else None
