"""The server's Prometheus metrics (`GET /metrics`): requests, tokens, latency, batch sizes, KV-cache usage,
prefix-cache queries and hits, preemptions, expert load
per expert and per rank (measured in the all-to-all on the data-parallel path), its balance per layer
and per step, and with expert placement its replicas, prefetch hits and predictor recall.

    curl -s 127.0.0.1:8000/metrics | grep moe_

Counters and histograms are updated as requests finish (`request`, `finished`); gauges are read
from the engine when /metrics is scraped (`render`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from export.serve.placement.algo import balancedness

CONTENT_TYPE = "text/plain; version=0.0.4"


class ServeMetrics:
    def __init__(self):
        self.registry = reg = CollectorRegistry()
        self.requests = Counter("moe_requests", "completion requests by HTTP status", ["status"], registry=reg)
        self.tokens_in = Counter("moe_prompt_tokens", "prompt tokens processed", registry=reg)
        self.tokens_out = Counter("moe_generated_tokens", "tokens generated", registry=reg)
        self.latency = Histogram("moe_request_latency_seconds", "request latency", registry=reg,
                                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.ttft = Histogram("moe_time_to_first_token_seconds", "time to first token", registry=reg,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        # observed by the engine after each decode step (Engine.on_decode): nothing kept per step
        self.batch = Histogram("moe_decode_batch_size", "sequences per decode step", registry=reg,
                               buckets=(1, 2, 4, 8, 16, 32, 64))
        self.running = Gauge("moe_running_sequences", "sequences decoding now", registry=reg)
        self.waiting = Gauge("moe_waiting_sequences", "sequences waiting for a slot", registry=reg)
        self.experts = Gauge("moe_expert_tokens", "tokens routed to each expert since start (prompts included), by "
                             "MoE layer (0-based among the MoE layers)", ["layer", "expert"], registry=reg)
        self.rank_experts = Gauge("moe_rank_expert_tokens", "tokens routed to the experts each rank holds since "
                                  "start, by MoE layer and rank", ["layer", "rank"], registry=reg)
        self.balance = Gauge("moe_expert_balancedness", "mean / max of the per-rank expert tokens, by MoE layer "
                             "(1: even)", ["layer"], registry=reg)
        self.place_balance = Gauge("moe_placement_balancedness", "with --placement: token-weighted mean over "
                                   "forwards of mean/max tokens per rank as placed (replicas included), by MoE layer",
                                   ["layer"], registry=reg)
        self.step_balance = Gauge("moe_step_balancedness", "data-parallel serving: per forward, summed mean over "
                                  "summed max across MoE layers of the tokens each rank's experts received in the "
                                  "all-to-all (vLLM's balancedness), token-weighted mean since start", registry=reg)
        self.replicas = Gauge("moe_placement_replicas", "with --placement: replicas in the table in force, by MoE "
                              "layer", ["layer"], registry=reg)
        self.hit_rate = Gauge("moe_expert_prefetch_hit_rate", "with --placement: experts needed that were resident "
                              "or prefetched / experts needed, by rank", ["rank"], registry=reg)
        self.replica_bytes = Gauge("moe_replica_bytes", "with --placement: bytes of replicas held, by rank", ["rank"],
                                   registry=reg)
        self.recall = Gauge("moe_predictor_recall", "with --placement predictive: predicted-active experts among "
                            "those used, by MoE layer (running mean)", ["layer"], registry=reg)
        self.table_changes = Gauge("moe_placement_table_changes", "with --placement: replica tables swapped in since "
                                   "start", registry=reg)
        self.late = Gauge("moe_predictor_late_steps", "with --placement predictive: decode steps whose predicted "
                          "table was not ready in time (the one in force was kept)", registry=reg)
        self.predictor_cpu = Gauge("moe_predictor_cpu_seconds", "with --placement predictive: CPU seconds of the "
                                   "predictor's thread since start (it shares rank 0's cores)", registry=reg)
        self.predictor_wait = Gauge("moe_predictor_wait_seconds", "with --placement predictive: seconds the scheduler "
                                    "waited for the predictor's table since start (every rank waits with it)",
                                    registry=reg)
        self.engine_tokens = Gauge("moe_engine_generated_tokens", "tokens the engine generated since start, for "
                                   "every request (aborted and failed ones included)", registry=reg)
        self.engine_failed = Gauge("moe_engine_failed_requests", "requests that failed alone (an error serving "
                                   "them) since start", registry=reg)
        self.kv_usage = Gauge("moe_kv_cache_usage_perc", "fraction of the KV cache blocks in use, over every rank's "
                              "pool (vLLM's kv_cache_usage_perc; cached blocks no sequence holds count as free)",
                              registry=reg)
        self.prefix_queries = Gauge("moe_prefix_cache_queries", "prompt tokens looked up in the prefix cache since "
                                    "start (at each admission, recomputations after preemption included)", registry=reg)
        self.prefix_hits = Gauge("moe_prefix_cache_hits", "of moe_prefix_cache_queries, tokens found cached (their KV "
                                 "shared, not computed)", registry=reg)
        self.preemptions = Gauge("moe_preemptions", "sequences preempted for lack of KV blocks since start (recomputed "
                                 "later)", registry=reg)
        self.rank_rss = Gauge("moe_rank_resident_mib", "resident memory of each rank at its last health check",
                              ["rank"], registry=reg)

    def request(self, status: int) -> None:
        """A request answered without completing (a 4xx or 5xx)."""
        self.requests.labels(str(status)).inc()

    def finished(self, req) -> None:
        """A request (one prompt) completed."""
        self.requests.labels("200").inc()
        self.tokens_in.inc(len(req.prompt))
        self.tokens_out.inc(len(req.generated))
        if req.first_token_at is not None:
            self.ttft.observe(req.first_token_at - req.arrived)

    def render(self, engine) -> str:
        """The exposition text, gauges read from `engine` now."""
        running, waiting = engine.queue_lengths()
        self.running.set(running)
        self.engine_tokens.set(engine.stats["tokens_out"])
        self.engine_failed.set(engine.stats["failed"])
        self.waiting.set(waiting)
        sched = engine.scheduler_stats()
        self.kv_usage.set(engine.kv_usage())
        self.prefix_queries.set(sched["prefix_queries"])
        self.prefix_hits.set(sched["prefix_hits"])
        self.preemptions.set(sched["preemptions"])
        for layer, counts in enumerate(list(engine.expert_tokens)):
            for e, c in enumerate(counts.tolist()):
                self.experts.labels(str(layer), str(e)).set(c)
        for layer, per_rank in enumerate(engine.rank_expert_tokens()):
            for r, c in enumerate(per_rank):
                self.rank_experts.labels(str(layer), str(r)).set(c)
            if max(per_rank):
                self.balance.labels(str(layer)).set(balancedness(per_rank))
        for status in list(engine.rank_status):
            self.rank_rss.labels(str(status["rank"])).set(status["rss_mib"])
            if "expert_hits" in status:
                needed = status["expert_hits"] + status["expert_misses"]
                self.hit_rate.labels(str(status["rank"])).set(status["expert_hits"] / needed if needed else 1.0)
                self.replica_bytes.labels(str(status["rank"])).set(status["replica_bytes"])
        self._placement(engine.placement_stats())
        return generate_latest(self.registry).decode()

    def _placement(self, stats) -> None:
        """From `Engine.placement_stats()`: the exchange's measured balance (the data-parallel path, with or without
        --placement), and with --placement the controller's table and policy."""
        ex, ctl = stats.exchange, stats.controller
        if ex is not None and ex.forwards:
            self.step_balance.set(ex.step_balancedness)
        if ctl is None:
            return
        if ex is not None and ex.forwards:
            for i, value in enumerate(ex.balancedness):
                self.place_balance.labels(str(i)).set(value)
                self.replicas.labels(str(i)).set(ctl.replicas[i])
        for i, recall in enumerate(ctl.recall or ()):
            self.recall.labels(str(i)).set(recall)
        self.table_changes.set(ctl.table_changes)
        if ctl.late_steps is not None:
            self.late.set(ctl.late_steps)
        if ctl.cpu_s is not None:
            self.predictor_cpu.set(ctl.cpu_s)
        if ctl.waited_s is not None:
            self.predictor_wait.set(ctl.waited_s)
