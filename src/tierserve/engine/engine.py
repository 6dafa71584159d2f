"""The engine: requests in, tokens out, one ``step`` at a time on the caller's thread."""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer

from tierserve.cache.allocator import PageAllocator
from tierserve.cache.base import PrefixCache
from tierserve.cache.device_pool import DeviceKVPool, KVGeometry
from tierserve.cache.factory import build_cache
from tierserve.cache.hashing import Namespace
from tierserve.cache.loads import HostLoadError
from tierserve.cache.options import object_format
from tierserve.cache.sharded.cp_pages import page_allocator
from tierserve.core.model_config import ModelConfig
from tierserve.core.sampling import InvalidRequestError, SamplingParams
from tierserve.core.scope import NO_SCOPE, CacheScope
from tierserve.core.storage import StorageAction, StorageKind
from tierserve.engine import l3_admin
from tierserve.engine.append import Appender, finish
from tierserve.engine.config import EngineConfig
from tierserve.engine.cp.runner import context_parallel
from tierserve.engine.handoff import Handoff, HandoffCheckError, KVCheck
from tierserve.engine.model_runner import ModelRunner, StepResult
from tierserve.engine.procs.ranks import Ranks, single_rank
from tierserve.engine.procs.token_share import token_share
from tierserve.engine.request import FinishReason, Request, RequestOutput, RequestStatus
from tierserve.engine.reservations import DEFAULT_TERMS, Reservations, ReservationTerms
from tierserve.engine.restores import WAIT_SHARE, StepRestores, lent_failed
from tierserve.engine.scheduler import Scheduled, Scheduler, SchedulerConfig, pages_for
from tierserve.engine.spec.decoder import SpecDecoder
from tierserve.engine.spec.draft_pools import DraftPlan
from tierserve.engine.text_stream import TextStream
from tierserve.model.identity import model_identity
from tierserve.model.loader import load_model, resolve_dtype
from tierserve.structured.grammars import GrammarCompiler

log = logging.getLogger(__name__)

PrefixCacheFactory = Callable[[PageAllocator, DeviceKVPool], PrefixCache]
CPU_DEFAULT_TOKENS = 16384


class Engine:
    """Continuous-batching engine over a paged KV pool.

    Not thread-safe: one thread calls ``add_request``, ``abort`` and ``step`` (see ``EngineLoop``
    for serving). Every page a request uses returns to the allocator (or the prefix cache) when
    it finishes, is aborted or is preempted.

    ``ranks``: this process's rank of a tensor- or pipeline-parallel node (default: the only one).
    Every rank builds the same engine over its shard of the model and of the KV pool (its heads of
    its stage's layers); fed the same commands in the same order, the ranks keep the same requests,
    tree and page ids (docs/ranks.md, docs/pp.md).
    """

    def __init__(self, config: EngineConfig, prefix_cache: PrefixCacheFactory | None = None,
                 ranks: Ranks | None = None) -> None:
        self.config = config
        self.ranks = ranks or single_rank(config)
        if self.ranks.size != config.num_ranks or self.ranks.pp.size != config.pp_size:
            raise ValueError(f"tp_size {config.tp_size} x pp_size {config.pp_size} x cp_size {config.cp_size} but "
                             f"the engine runs on {self.ranks.size} rank(s) of {self.ranks.pp.size} stage(s)")
        self.device = self.ranks.device
        torch.manual_seed(config.seed)
        model_dir = Path(config.model_dir)
        self.dtype = resolve_dtype(config.dtype, ModelConfig.from_dir(model_dir), self.device)
        self.model = load_model(model_dir, self.device, self.dtype, self.ranks.tp, self.ranks.pp)
        self.model_config = self.model.config
        self.max_model_len = config.max_model_len or self.model_config.max_position
        if self.max_model_len > self.model_config.max_position:
            raise ValueError(f"context length {self.max_model_len} exceeds the model's "
                             f"{self.model_config.max_position} positions")
        self.tokenizer = _load_tokenizer(model_dir)
        self._grammars: GrammarCompiler | None = None  # built at the first structured output
        eos_ids = set(self.model_config.eos_token_ids) | _generation_eos(model_dir)
        heads = self.ranks.tp.heads(self.model_config.num_heads, self.model_config.num_kv_heads)
        self.geometry = KVGeometry(  # this rank's KV heads of its stage's layers only
            len(self.model.layer_ids), heads.kv_heads, self.model_config.head_dim, config.page_size, self.dtype,
        )
        self.draft = DraftPlan.of(config, self.geometry, self.max_model_len,  # checks the draft
                                  self.model_config.num_kv_heads, self.ranks.tp, here=self.ranks.pp.last)
        self.draft_bytes = self.draft.bytes_per_token if self.draft else 0
        pool_geometry = self.draft.pool_geometry(self.geometry) if self.draft else self.geometry
        self.kv_shard = self.ranks.kv_shard(heads, self.model_config.num_kv_heads, self.model_config.num_layers,
                                            self.draft.packed_layers if self.draft else 0)
        # Page ids are the same on every rank, so every rank's pool has the smallest rank's page count.
        self.pool = DeviceKVPool(pool_geometry, self.ranks.agree_min(self._num_pages()), self.device)
        self.draft_pool = self.draft.sidecar_pool(self.pool.num_pages, self.device) if self.draft else None
        self.num_pages = self.pool.num_pages * self.ranks.cp.size  # logical: a CP rank stores its share
        self.allocator = page_allocator(self.ranks.cp, self.pool.num_pages)
        self.namespace = Namespace(  # the model's layers and KV heads, not this rank's: the same at any TP/PP/CP size
            model_identity(model_dir), str(self.dtype).removeprefix("torch."), config.page_size,
            self.model_config.num_layers, self.model_config.num_kv_heads, self.geometry.head_dim,
            object_format(config.hicache.mem_layout), draft=self.draft.identity if self.draft else "",
        )
        self.cache = (prefix_cache or self._build_cache)(self.allocator, self.pool)
        cp = context_parallel(self.ranks.cp, self.pool, self.device, self.ranks.cp_merge, config.cp_attention,
                              self.ranks.cp_group)
        self.runner = ModelRunner(self.model, self.pool, self.device, token_share(self.ranks), cp)
        draft_kv = self.draft.store(self.pool, self.draft_pool, self.geometry.num_layers) if self.draft else None
        self.spec = SpecDecoder.of(config, self.model, self.pool, draft_kv, self.runner, self.ranks.tp)
        sched = SchedulerConfig(config.page_size, config.chunked_prefill_size, config.max_running_requests,
                                config.schedule_policy)
        self.scheduler = Scheduler(sched, self.allocator, self.cache, self.spec.lookahead if self.spec else None,
                                   draft_kv=self.draft is not None)
        self.reservations = Reservations(self.allocator, self.cache, config.page_size)
        self.restore_agreement = self.ranks.agreement()  # whether a step's restores failed anywhere
        self.before_step: list[Callable[[], None]] = []  # e.g. a prefill node's handoff agreement
        self.requests: dict[str, Request] = {}
        self.appender = Appender(eos_ids, self.max_model_len, self.requests, self.scheduler)
        self.failures: list[tuple[str, Exception]] = []
        self.last_batch_size = 0
        self.last_step_tokens = 0  # tokens the last step scheduled (the watchdog's expected time, engine/step_watch.py)
        self.prefill_tokens_computed = 0  # prompt tokens this engine computed (not taken from the cache)
        self.late_first_tokens = 0  # first tokens sampled after their request's deadline (``SamplingParams``)
        self._generate_ids = itertools.count()  # the same on every rank, as ids must be
        self.ranks.started()  # the start's collectives are done: steps get --dist-timeout (docs/ranks.md)
        log.info("engine ready: model=%s device=%s dtype=%s kv_pages=%d page_size=%d rank=%d/%d stage=%d/%d "
                 "layers=%d-%d namespace=%s threads=%d", model_dir.name, self.device, self.dtype, self.num_pages,
                 config.page_size, self.ranks.rank, self.ranks.size, self.ranks.pp.stage, self.ranks.pp.size,
                 self.model.layer_ids.start, self.model.layer_ids.stop - 1, self.namespace.digest(),
                 torch.get_num_threads())

    @property
    def eos_ids(self) -> set[int]:
        """The token ids that end a request (unless ``ignore_eos``)."""
        return self.appender.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: set[int]) -> None:
        self.appender.eos_ids = ids

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.config.page_size

    def add_request(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, scope: CacheScope = NO_SCOPE,
        handoff: Handoff | None = None, l3_pending: int = 0,
    ) -> None:
        """Queues a request; raises ``InvalidRequestError`` if it can never be served. Requests
        of different ``scope`` (tenant, ``cache_salt``) never share cached KV. ``handoff`` receives
        the prompt's KV layer by layer as it is computed. ``l3_pending``: the prompt's leading pages
        another node is writing to L3 now (``PrefixCache.prefetch``)."""
        prompt = list(prompt_ids)
        self._validate(request_id, prompt, params)
        request = Request(request_id, prompt, params, scope=scope, handoff=handoff, l3_pending=l3_pending)
        self._prepare(request)
        self.requests[request_id] = request
        self.scheduler.add(request)

    def reserve(self, request_id: str, prompt_ids: Sequence[int], max_new_tokens: int, scope: CacheScope = NO_SCOPE,
                terms: ReservationTerms = DEFAULT_TERMS, now: float | None = None, source_tp: int = 0) -> Request:
        """Sets pages aside for a prompt another node computes (decode role) on the role's
        ``terms``, leased from ``now`` (default: this process's clock; a node of several ranks passes
        rank 0's); returns the reservation's request (``pages`` is the page table, ``num_computed``
        the tokens this engine already caches; ``source_tp``: the writer's TP size, 0 if unknown).
        Raises ``InvalidRequestError`` or ``CapacityError``."""
        prompt = list(prompt_ids)
        params = SamplingParams(max_tokens=max_new_tokens)
        self._validate(request_id, prompt, params)
        if request_id in self.reservations.active:
            raise InvalidRequestError(f"request id {request_id!r} is already reserved")
        request = Request(request_id, prompt, params, scope=scope)
        headroom = min(max_new_tokens, terms.headroom_tokens)
        self.reservations.reserve(request, len(prompt) + max(1, headroom), terms, _clock(now), source_tp)
        return request

    def start_reserved(self, request_id: str, first_token: int, params: SamplingParams,
                       resumed: int = 0, check: KVCheck | None = None) -> RequestOutput:
        """The prompt's KV is in the reserved pages and ``first_token`` was sampled from it: the
        request joins the running batch and its full prompt pages the prefix cache (in-flight
        sharing); returns the output for the first token. ``resumed``: the prompt's last tokens
        were generated elsewhere (a migration), and the text continues theirs.
        ``check`` (the handoff's digests, ``--handoff-integrity``) may refuse the KV that arrived:
        the pages are then freed, none cached, and ``HandoffCheckError`` raised."""
        self._check_params(params)
        if params.constraint is not None:  # compiled (or refused) before the reservation is taken
            self.grammars().matcher(params.constraint)
        request = self.reservations.take(request_id)
        problem = check(self, request) if check is not None else None
        if problem is not None:
            self.cache.release(request.prompt_ids, request.pages, request.num_computed, request.hit)
            raise HandoffCheckError(problem)
        request.params = params
        self._prepare(request)
        if resumed and request.text is not None:
            request.text.prime(request.prompt_ids[-resumed:])
        request.num_computed, request.status = len(request.prompt_ids), RequestStatus.RUNNING
        request.draft_computed = request.num_computed  # the prefill node sent the draft's KV too
        request.first_token_at = time.monotonic()
        self.requests[request_id] = request
        self.scheduler.running.append(request)
        # The received prompt pages join the tree now, before the first output leaves (the router
        # sends a prompt's other choices here once it sees it: docs/pd.md, n choices); a command,
        # so at the same point on every rank (docs/ranks.md).
        self.scheduler.share(request)
        return self.appender.append(request, first_token)

    def cancel_reservation(self, request_id: str, writer_stopped: bool, now: float | None = None) -> bool:
        """Ends a reservation that will not run; see ``Reservations.cancel`` (``now`` as in ``reserve``)."""
        return self.reservations.cancel(request_id, writer_stopped, _clock(now))

    def _prepare(self, request: Request) -> None:
        params = request.params
        if self.tokenizer is not None:
            request.text = TextStream(self.tokenizer, params.stop, params.skip_special_tokens, params.min_tokens)
        if params.min_tokens:
            request.banned = tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(self.eos_ids))
        c = params.constraint
        if c is not None:  # after a migration the grammar resumes after the prompt's generated tail
            request.grammar = self.grammars().state(c, request.prompt_ids)

    def grammars(self) -> GrammarCompiler:
        """The compiler of structured outputs for this model's tokenizer (docs/structured.md)."""
        if self._grammars is None:
            path = Path(self.config.model_dir) / "tokenizer.json"
            if not path.is_file():
                raise InvalidRequestError("structured outputs need the model's tokenizer.json")
            self._grammars = GrammarCompiler(path.read_text(encoding="utf-8"), sorted(self.eos_ids),
                                             self.model_config.vocab_size)
        return self._grammars

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stops a waiting or running request and frees its pages; None if it is unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.remove(request)
        return finish(request, FinishReason.ABORT, [], "")

    def has_work(self) -> bool:
        """Requests, reservations, or cache copies that finish only through steps."""
        return self.scheduler.has_work() or bool(self.reservations) or self.cache.busy

    def only_reservations(self) -> bool:
        """Reservations are all the work there is: only time (a lease or quarantine ending) or a
        command changes anything."""
        return bool(self.reservations) and not self.scheduler.has_work() and not self.cache.busy

    def stats(self) -> dict[str, float]:
        """Occupancy counters; engine thread only (other threads read ``EngineLoop.stats``, which
        the engine thread publishes). ``kv_pages_used`` counts pages held by requests,
        ``kv_pages_cached`` those the prefix cache keeps for reuse (freed on demand)."""
        cached = self.cache.num_cached_pages
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_pages_used": self.allocator.num_used - cached,
            "kv_pages_cached": cached,
            "kv_pages_total": self.allocator.num_pages,
            "preemptions": self.scheduler.num_preemptions,
            "priority_preemptions": self.scheduler.num_priority_preemptions,
            "late_first_tokens": self.late_first_tokens,
            "prefill_tokens_computed": self.prefill_tokens_computed,
            "schedule_held_steps": self.scheduler.num_held,
            "admitted_requests": self.scheduler.num_admitted,
            "queue_seconds": self.scheduler.queue_seconds,
            "reservations": len(self.reservations.active),
            "reservation_pages_quarantined": self.reservations.quarantined_pages,
            "reservation_staging_bytes": self.reservations.staging.used_bytes if self.reservations.staging else 0,
            "reservation_leases_expired": self.reservations.expired_leases,
            "handoff_pages_parked": sum(len(p.pages) for p in self.scheduler.parked),
        } | {f"cache_{k}": v for k, v in self.cache.stats().items()} | self._gather_stats() \
            | (self.spec.counters.stats() if self.spec is not None else {})

    def _gather_stats(self) -> dict[str, float]:
        """Under CP, this rank's seconds spent waiting for per-layer gathers (``GatherClock``) and its
        short steps' merges (``MergeClock``)."""
        return self.runner.cp.stats() if self.runner.cp is not None else {}

    def step(self, now: float | None = None) -> list[RequestOutput]:
        """Runs one batch; returns an output for every request that got a token or finished.
        ``now`` is the step's time for lease expiry (a node of several ranks passes rank 0's, so
        every rank expires a lease at the same step); ``before_step`` hooks run first, on every
        rank at the same point (they may run collectives)."""
        for hook in self.before_step:
            hook()
        self.reservations.tick(_clock(now))
        batch = self.scheduler.schedule()
        self.last_batch_size, self.last_step_tokens = len(batch), sum(s.num_tokens for s in batch)
        if not batch:
            return []
        restores = StepRestores.of(batch, self.config.dist_timeout_s * WAIT_SHARE)
        started = time.perf_counter()
        result = self._run(batch, restores)
        failed = self._fail_restores(batch, restores)
        prefilled = [_prompt_tokens(s) for s in batch]  # before the step advances the requests
        self.cache.record_compute(sum(prefilled), time.perf_counter() - started)
        self.prefill_tokens_computed += sum(prefilled)
        outputs = []
        for scheduled, prompt_tokens in zip(batch, prefilled, strict=True):
            request = scheduled.request
            rid = request.request_id
            if rid in failed:
                continue
            request.advance(scheduled.num_tokens)
            if prompt_tokens:  # before the append, which may release it (docs/cache.md, in-flight sharing)
                self.scheduler.share(request)
            request.prompt_logprobs += result.logprobs.prompt.get(rid, [])
            if rid in result.tokens:
                first = not request.output_ids
                outputs.append(self.appender.append_all(request, result.tokens[rid], result.logprobs.sampled.get(rid)))
                if first:
                    self._note_first_token(request)
            if scheduled.draft_tokens and request.status is RequestStatus.RUNNING:
                self.scheduler.trim(request)
        if self.config.offload_generated:
            self.scheduler.checkpoint()
        return outputs

    def _note_first_token(self, request: Request) -> None:
        """Counts a first token that came later than the request's deadline (from its arrival here)."""
        deadline = request.params.deadline_ms
        if deadline is not None and (time.monotonic() - request.arrival) * 1000 > deadline:
            self.late_first_tokens += 1

    def _run(self, batch: list, restores: StepRestores) -> StepResult:
        """The tokens each request of ``batch`` gets this step, in order (several when speculating)."""
        return self.spec.run(batch, restores) if self.spec is not None else self.runner.run(batch, restores)

    def take_failures(self) -> list[tuple[str, Exception]]:
        """Requests that failed alone (e.g. their prefix's host copy could not be loaded) since the
        last call: they are gone from the engine and hold no pages."""
        failures, self.failures = self.failures, []
        return failures

    def _fail_restores(self, batch: list, restores: StepRestores) -> set[str]:
        """After the forward, on every rank at the same point: the ranks agree (one collective, in
        steps with restores not yet landed) on the L2 -> L1 restores that failed, or were given up,
        on any rank; the requests lent one fail on every rank and their step's results are dropped
        (the rest of the batch keeps its own: they never read those pages). The next ``on_step``
        drops the failed restore's device copies everywhere (docs/ranks.md). Returns their ids."""
        failed = lent_failed(batch, restores.failed(self.restore_agreement))
        for request in failed:
            self._fail_request(request, HostLoadError("loading KV from host memory failed"))
        return {r.request_id for r in failed}

    def _fail_request(self, request: Request, exc: Exception) -> None:
        log.warning("request %s failed: %s", request.request_id, exc)
        self.requests.pop(request.request_id, None)
        self.scheduler.remove(request)
        self.failures.append((request.request_id, exc))

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Runs prompts to completion (a convenience for tests and benchmarks); returns output ids."""
        ids = [f"gen-{next(self._generate_ids)}" for _ in prompts]
        for rid, prompt in zip(ids, prompts, strict=True):
            self.add_request(rid, prompt, params)
        done: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_work():
            for out in self.step():
                done[out.request_id] += out.new_token_ids
            for _, exc in self.take_failures():
                raise exc
        return [done[rid] for rid in ids]

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self._check_params(params)
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request "
                f"needs {total} ({len(prompt)} prompt + {params.max_tokens} max_tokens)"
            )
        if pages_for(total, self.config.page_size) > self.num_pages:
            raise InvalidRequestError(
                f"the request needs {total} tokens of KV cache but the pool holds {self.capacity_tokens}"
            )

    def _check_params(self, params: SamplingParams) -> None:
        params.validate()
        if (params.logprobs is not None or params.prompt_logprobs is not None) and self.ranks.sampler != 0:
            raise InvalidRequestError("logprobs are not supported with pipeline stages yet")

    def storage_admin(self, action: StorageAction, kind: StorageKind | None = None,
                      config: dict | None = None) -> dict:
        """Runtime L3 control (``PrefixCache.storage_admin``); ``ATTACH`` builds this rank's backend of
        ``kind`` from its extra ``config``. All but ``STATUS`` need an idle engine (``StorageBusyError``)
        and, at several ranks, run on every rank at once (``engine/l3_admin.py``): every rank of the
        node calls this at the same point of its command stream (``StorageControl``)."""
        return l3_admin.storage_admin(self, StorageAction.parse(action), kind, config or {})

    def _build_cache(self, allocator: PageAllocator, pool: DeviceKVPool) -> PrefixCache:
        return build_cache(self.config.cache_kind, allocator, pool, self.namespace.seed(), self.config.hicache,
                           self.kv_shard, self.ranks.agreement(), self.ranks.cp, self.draft_pool,
                           self.draft.shard if self.draft else None)

    def _num_pages(self) -> int:
        tokens = self.config.max_total_tokens
        if tokens is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            tokens = int(free * self.config.mem_fraction_static) // (self.geometry.bytes_per_token + self.draft_bytes)
        tokens = tokens or CPU_DEFAULT_TOKENS
        return max(1, tokens // self.config.page_size)


def _prompt_tokens(scheduled: Scheduled) -> int:
    """Prompt tokens ``scheduled`` computes (before the step advanced its request)."""
    request = scheduled.request
    return max(0, min(scheduled.num_tokens, len(request.prompt_ids) - request.num_computed))


def _clock(now: float | None) -> float:
    return time.monotonic() if now is None else now


def _load_tokenizer(model_dir: Path) -> Tokenizer | None:
    path = model_dir / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def _generation_eos(model_dir: Path) -> set[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return set()
    value = json.loads(path.read_text()).get("eos_token_id")
    return set(value) if isinstance(value, list) else ({value} if value is not None else set())
