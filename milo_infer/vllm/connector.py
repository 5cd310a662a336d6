"""A vLLM KV connector (``KVConnectorBase_V1``) that loads a request's [anchor][blocks] prefix from milo stores.

Select it with::

    --kv-transfer-config '{"kv_connector": "MiloConnector", "kv_connector_module_path":
      "milo_infer.vllm.connector", "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"stores": {"banking77": "/path/or/url"}}}'

(extra keys: ``tier``, ``memory_cache_bytes``, ``block_cache_dir``, ``block_cache_bytes``, as `MiloStore.open`
takes them). Scheduler side: a request whose ``kv_transfer_params`` name a store and blocks and whose prompt
begins with exactly the token ids that store encoded them from (`transfer.PrefixClaims`) has that
whole prefix claimed as externally computed (a partial last vLLM block included, so the K/V are the
store's, exactly as milo's own engine would rebuild them); every other request is plain
vLLM. Worker side: each step's claimed requests are rebuilt together (`PrefixRebuild`: each store's
union of their blocks fetched once, then one layer at a time), keys rotated at the request's own
positions (vLLM's paged cache holds keys after RoPE), and written through the attention backend's own
cache update, never by slicing its (backend-packed) cache tensor: each layer into its KV cache group's slots, so
under vLLM's hybrid KV cache manager a sliding-window layer only into the pages its window still reaches. Under
tensor or pipeline parallelism each worker rebuilds only what its cache holds (a `KVShare`: its pipeline stage's layers, its
tensor-parallel rank's KV heads), reading whole blocks (each block's checksum covers the whole block).
A request whose blocks cannot be read
(a checksum fails, a remote read fails) is reported as a load error, so vLLM recomputes it or fails it
(``kv_load_failure_policy``); nothing it would have loaded is written, and other requests load as usual.

Loads are synchronous: a request's load is claimed, scheduled and written within one vLLM step, so
none is ever pending when vLLM preempts a request (vLLM's ``handle_preemptions`` hook, which lets
connectors with asynchronous transfers finish them before a preempted request's blocks are reused, has
nothing to do here); a preempted request that resumes is claimed again and loaded into its new blocks.
Each worker reports what its loads cost (`MiloConnectorStats`), which vLLM adds up over the workers,
logs, and exports on its Prometheus ``/metrics`` (`MiloPromMetrics`: ``vllm:milo_*``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole, SupportsHMA)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.distributed.parallel_state import (get_pp_group, get_tensor_model_parallel_rank,
                                             get_tensor_model_parallel_world_size)
from vllm.distributed.utils import get_pp_indices
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from milo_store import MiloStore, StoreError
from milo_store.blockcache import BlockCache

from ..models import UnsupportedModelError, check_compatible, config_identity, config_layer_rope_tables
from ..models.families import vllm_problem
from ..runtime.prefix import BlockPlacement, KVShare, PrefixRebuild, StorePrefix
from ..runtime.timing import StageClock
from .transfer import Load, LoadSchedule, PrefixClaims

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

UNREADABLE = (StoreError, OSError)  # a block failing its checksum; a read that failed after its retries
logger = init_logger(f"vllm.{__name__}")  # vLLM configures handlers for its own namespace only


@dataclass
class MiloConnectorMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)


COUNTS = ("loads", "tokens_loaded", "layer_tokens_written", "load_errors", "blocks_read",
          "bytes_read")  # summed, per worker
SECONDS = ("read_seconds", "rebuild_seconds")


@dataclass
class MiloConnectorStats(KVConnectorStats):
    """What the workers' loads cost since vLLM last collected them, per worker (``"tp<i>-pp<j>"``: its tier,
    rank and sums): requests loaded and their tokens, the K/V written into vLLM's cache (one token of one layer
    each: every layer's loaded tokens, a window layer's only those its KV cache group holds pages for), requests
    whose blocks could not be read, store blocks and bytes read (each step's union of blocks once per worker;
    whole blocks, whatever the worker's share), seconds reading them and rebuilding (staging, reconstruction, the write into vLLM's cache)."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data

    def add(self, worker: str, tier: str, tp_rank: int, pp_rank: int, **values) -> None:
        entry = self.data.setdefault(worker, {"tier": tier, "tp_rank": tp_rank, "pp_rank": pp_rank,
                                              **{k: 0 for k in COUNTS + SECONDS}})
        for key, value in values.items():
            entry[key] += value

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for worker, entry in other.data.items():
            self.add(worker, entry["tier"], entry["tp_rank"], entry["pp_rank"],
                     **{k: entry[k] for k in COUNTS + SECONDS})
        return self

    def reduce(self) -> dict[str, int | float]:
        """Sums over the workers, for vLLM's periodic log line."""
        out = {k: sum(e[k] for e in self.data.values()) for k in COUNTS}
        out.update({k: round(sum(e[k] for e in self.data.values()), 3) for k in SECONDS})
        return out


class MiloPromMetrics(KVConnectorPromMetrics):
    """``vllm:milo_<count>`` counters (``_total`` in the exposition), labelled by tier and worker rank."""

    def __init__(self, vllm_config: "VllmConfig", metric_types: dict[type["PromMetric"], type["PromMetricT"]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        help_of = {"loads": "Requests whose store prefix a worker loaded",
                   "tokens_loaded": "Prefix tokens loaded from milo stores, per worker",
                   "layer_tokens_written": "K/V written into vLLM's cache, one token of one layer each (a window "
                                           "layer's only where its KV cache group holds pages)",
                   "load_errors": "Requests whose store blocks a worker could not read",
                   "blocks_read": "Store blocks read by the milo connector (each step's union once)",
                   "bytes_read": "Store factor bytes read by the milo connector",
                   "read_seconds": "Seconds reading store blocks",
                   "rebuild_seconds": "Seconds rebuilding K/V from factors and writing them into vLLM's cache"}
        names = labelnames + ["tier", "tp_rank", "pp_rank"]
        self.counters = {key: self._counter_cls(name=f"vllm:milo_{key}", documentation=text, labelnames=names)
                         for key, text in help_of.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for entry in transfer_stats_data.values():
            labels = [*self.per_engine_labelvalues[engine_idx], entry["tier"], str(entry["tp_rank"]),
                      str(entry["pp_rank"])]
            for key, counter in self.counters.items():
                if entry[key]:
                    counter.labels(*labels).inc(entry[key])


def open_stores(extra: dict, metadata_only: bool) -> dict[str, MiloStore]:
    """The configured stores; ``metadata_only`` (the scheduler: token ids, never factors) mounts them from disk."""
    stores = extra.get("stores")
    if not isinstance(stores, dict) or not stores:
        raise ValueError("MiloConnector needs kv_connector_extra_config {'stores': {name: store path or URL}}")
    options: dict[str, Any] = {"tier": "disk" if metadata_only else extra.get("tier", "host")}
    if "memory_cache_bytes" in extra:
        options["memory_cache_bytes"] = int(extra["memory_cache_bytes"])
    if "block_cache_dir" in extra or "block_cache_bytes" in extra:
        options["block_cache"] = BlockCache(extra.get("block_cache_dir"), extra.get("block_cache_bytes"))
    return {name: MiloStore.open(path, **options) for name, path in stores.items()}


class MiloConnector(KVConnectorBase_V1, SupportsHMA):
    """Supports vLLM's hybrid KV cache manager (`SupportsHMA`): a model with sliding-window layers keeps them in KV
    cache groups of their own, whose pages cover only the blocks each window still reaches, and the connector
    writes each layer into its group's pages, a window layer only where its group holds pages."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        groups = kv_cache_config.kv_cache_groups
        if any(g.kv_cache_spec.block_size != self.block_size for g in groups):
            raise ValueError(f"MiloConnector: KV cache groups of block sizes "
                             f"{sorted({g.kv_cache_spec.block_size for g in groups})}, it takes one "
                             f"({self.block_size}, --block-size)")
        self.groups = groups
        self.group_of = {name: i for i, group in enumerate(groups) for name in group.layer_names}
        self.stores = open_stores(self._kv_transfer_config.kv_connector_extra_config or {},
                                  metadata_only=role == KVConnectorRole.SCHEDULER)
        model_config = vllm_config.model_config
        if (problem := vllm_problem(model_config.hf_config)) is not None:
            raise UnsupportedModelError(f"MiloConnector: {problem}")
        identity = config_identity(model_config.hf_config, model_config.dtype)
        for store in self.stores.values():
            check_compatible(store, identity)
        # scheduler side
        self.schedule = LoadSchedule(PrefixClaims(self.stores), self.block_size)
        # worker side
        self._prefixes: dict[str, StorePrefix] | None = None
        self._rebuild: PrefixRebuild | None = None
        self._loads: list[Load] = []
        self._slots: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per load, per KV cache group
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._load_errors: set[int] = set()
        self._written = 0  # this step's K/V written, one token of one layer each
        self._forward_context = None
        self._stats = MiloConnectorStats()
        logger.info("MiloConnector (%s): stores %s", role.name.lower(),
                    ", ".join(f"{n} ({s.num_blocks} blocks)" for n, s in self.stores.items()))

    # -- scheduler side ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        tokens, why = self.schedule.claim(request.request_id, request.kv_transfer_params,
                                          list(request.prompt_token_ids or []), num_computed_tokens)
        if why and request.kv_transfer_params:
            logger.warning("request %s is served without the store: %s", request.request_id, why)
        return tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self.schedule.allocated(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        blocks_of = {new.req_id: new.block_ids for new in scheduler_output.scheduled_new_reqs}  # per group
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):  # a preempted request resumes with all its blocks anew
            if req_id in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                blocks_of[req_id] = cached.new_block_ids[i]
        return MiloConnectorMetadata(loads=self.schedule.loads(blocks_of))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict | None]:
        self.schedule.finished(request.request_id)
        return False, None

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        return self.request_finished(request, [])  # what vLLM calls under its hybrid KV cache manager

    # -- worker side -------------------------------------------------------------------------------
    def _mount(self) -> None:
        """The stores' anchors and RoPE tables on the worker's device, and this worker's share, once."""
        model_config = self._vllm_config.model_config
        device = torch.device(self._vllm_config.device_config.device)
        longest = min(s.meta["model"]["max_position_embeddings"] for s in self.stores.values())
        self.rope = config_layer_rope_tables(model_config.hf_config, longest, device)
        self.device, self.dtype = device, model_config.dtype
        self._prefixes = {name: StorePrefix(name, store, self.rope, device, self.dtype)
                          for name, store in self.stores.items()}
        self.share = self._worker_share()

    def _worker_share(self) -> KVShare:
        """The layers and KV heads this worker's cache holds: its pipeline stage's layers (vLLM's own split)
        and its tensor-parallel rank's heads of each layer."""
        layout = next(iter(self._prefixes.values())).layout  # stores of one model share K/V shapes
        pp = get_pp_group()
        self.tp_rank, self.pp_rank = get_tensor_model_parallel_rank(), pp.rank_in_group
        share = KVShare(range(*get_pp_indices(layout.num_layers, self.pp_rank, pp.world_size)),
                        tp=(get_tensor_model_parallel_world_size(), self.tp_rank))
        model_config, parallel = self._vllm_config.model_config, self._vllm_config.parallel_config
        heads = share.layer_heads(layout.layers[0])
        if layout.uniform and len(heads) != model_config.get_num_kv_heads(parallel):
            raise RuntimeError(f"MiloConnector: rank {self.tp_rank} would rebuild {len(heads)} KV heads, "
                               f"vLLM's cache holds {model_config.get_num_kv_heads(parallel)}")
        logger.info("MiloConnector (worker tp %d, pp %d): layers %d..%d, KV heads %d..%d of %d (the first layer's)",
                    self.tp_rank, self.pp_rank, share.layers.start, share.layers.stop - 1, heads.start, heads.stop - 1,
                    layout.layers[0].kv_heads)
        return share

    def _rows(self, loads: list[Load]) -> list[BlockPlacement]:
        """The loads' placements; a claim checked against another version than this worker's mount (the store
        was updated between their starts) is unreadable here, as a damaged block is."""
        rows = []
        for load in loads:
            prefix = self._prefixes[load.claim.store]
            if prefix.store.version != load.claim.version:
                raise StoreError(f"store {load.claim.store!r}: the scheduler checked version {load.claim.version}, "
                                 f"this worker mounted {prefix.store.version}")
            rows.append(prefix.place(load.claim.blocks))
        return rows

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MiloConnectorMetadata)
        self._rebuild, self._loads, self._forward_context = None, [], forward_context
        if not meta.loads:
            return
        if self._prefixes is None:
            self._mount()
        loads = meta.loads
        try:
            rebuild = self._rebuild_of(loads)
        except UNREADABLE:  # find the requests whose blocks fail; the others still load
            readable = []
            for load in loads:
                try:
                    self._rebuild_of([load])
                    readable.append(load)
                except UNREADABLE as err:
                    logger.error("request %s: its prefix from store %r is not loaded (%s)", load.req_id,
                                 load.claim.store, err)
                    if len(self.groups) > 1:
                        logger.error("vLLM 0.32 cannot recompute a request whose blocks failed to load under its "
                                     "hybrid KV cache manager (%d KV cache groups): it stops instead; start it with "
                                     "--disable-hybrid-kv-cache-manager to have such requests recomputed",
                                     len(self.groups))
                    self._load_errors.update(load.block_ids)
                    self._count(load_errors=1)
            loads = readable
            rebuild = self._rebuild_of(loads) if loads else None
        self._rebuild, self._loads = rebuild, loads
        self._slots = [[self._held(slots) for slots in load.slots] for load in loads]
        self._written = 0
        if rebuild is not None:  # one pair of buffers per shape the share's layers hold
            longest, layers = max(row.prefix_tokens for row in rebuild.rows), rebuild.rows[0].prefix.layers
            shapes = {(len(rebuild.heads(l)), layers[l].head_dim) for l in self.share.layers if layers[l].holds_cache}
            self._buffers = {shape: tuple(torch.zeros(len(loads), shape[0], longest, shape[1], dtype=self.dtype,
                                                      device=self.device) for _ in range(2)) for shape in shapes}
            logger.debug("loading %d tokens for %d requests from the store",
                         sum(load.end - load.start for load in loads), len(loads))

    def _held(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A load's tokens (offsets from its start) that a KV cache group holds pages for, and their slots."""
        slots = torch.tensor(slots, dtype=torch.long)
        tokens = torch.nonzero(slots >= 0).flatten()
        return tokens.to(self.device), slots[tokens].to(self.device)

    def _rebuild_of(self, loads: list[Load]) -> PrefixRebuild:
        """These loads' blocks read (raises what an unreadable block raises), to rebuild this worker's share."""
        return PrefixRebuild(self._rows(loads), self.rope, self.device,
                             share=self.share, clock=StageClock(self.device))

    def _count(self, **values) -> None:
        tier = next(iter(self.stores.values())).tier  # one tier for every store (kv_connector_extra_config)
        self._stats.add(f"tp{self.tp_rank}-pp{self.pp_rank}", tier, self.tp_rank, self.pp_rank, **values)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._rebuild is None:
            return
        layer, index = self._forward_context.no_compile_layers[layer_name], extract_layer_index(layer_name)
        spec = self._rebuild.rows[0].prefix.layers[index]
        if not spec.holds_cache:  # it attends its source layer's cache, written there
            return
        k_buf, v_buf = self._buffers[len(self._rebuild.heads(index)), spec.head_dim]
        self._rebuild.fill(index, k_buf, v_buf)
        group = self.group_of[layer_name]
        with self._rebuild.clock.device_stage("write"):
            for r, (load, held) in enumerate(zip(self._loads, self._slots)):
                tokens, slots = held[group]  # a window layer's group: only the tokens its pages hold
                if not len(tokens):
                    continue
                keys = k_buf[r, :, load.start:load.end][:, tokens].transpose(0, 1).contiguous()  # [T, H, d]
                values = v_buf[r, :, load.start:load.end][:, tokens].transpose(0, 1).contiguous()
                layer.impl.do_kv_cache_update(layer, keys, values, layer.kv_cache, slots)
                self._written += len(tokens)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # a consumer: the store is written by `milo build`, never by vLLM

    def wait_for_save(self):
        """The end of a step (vLLM calls it after every forward): count this step's loads and let their
        buffers go."""
        rebuild, self._rebuild, self._buffers, self._slots = self._rebuild, None, None, []
        if rebuild is None:
            return
        seconds = rebuild.clock.read()
        self._count(loads=len(self._loads), tokens_loaded=sum(load.end - load.start for load in self._loads),
                    layer_tokens_written=self._written,
                    blocks_read=rebuild.fetch_stats["unique_blocks"], bytes_read=rebuild.fetch_stats["bytes"],
                    read_seconds=seconds.get("read", 0.0),
                    rebuild_seconds=sum(seconds.get(stage, 0.0) for stage in ("wait", "reconstruct", "write")))
        self._loads = []

    def get_kv_connector_stats(self) -> MiloConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, MiloConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> MiloConnectorStats:
        return MiloConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict[type["PromMetric"], type["PromMetricT"]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> MiloPromMetrics:
        return MiloPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

