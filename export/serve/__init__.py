"""Serving an exported package: `moe-pipeline serve PACKAGE`.

  config.py     ServeConfig: every serve setting, validated once
  server.py     the process: engine on every rank, uvicorn on rank 0, signals, shutdown
  http.py       the OpenAI-compatible API (FastAPI)
  metrics.py    Prometheus metrics
  request.py    a request: sampling parameters, tokens, text (incremental detokenization)
  scheduler.py  rank 0's queues, token budgets, data-parallel ranks, KV blocks, preemption, prefix cache (no torch)
  step.py       the typed step the scheduler sends every rank, and what each rank returns
  engine.py     the loop: schedule -> send -> execute -> gather -> update
  worker.py     one rank's side of a step: its paged KV cache (kv_cache.py), samplers (sampling.py), forwards
  ranks.py      rank 0 <-> other ranks: typed messages, status gathering
  kernels/      CPU serving kernels: our C++ extension (kernels/csrc/) and the linears, experts, screens on it
  lifecycle.py  `serve --nproc N`: relaunched under the DeepSpeed launcher, stopped gracefully
  placement/    expert replicas, placement policies, the expert-demand predictor, offload and prefetch,
                the data-parallel path's expert exchange
"""
