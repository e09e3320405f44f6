"""Serving an exported package: `moe-pipeline serve PACKAGE`.

  config.py     ServeConfig: every serve setting, validated once
  server.py     the process: engine on every rank, uvicorn on rank 0, signals, shutdown
  http.py       the OpenAI-compatible API (FastAPI)
  metrics.py    Prometheus metrics
  engine.py     continuous batching over a slot KV cache (rank 0 schedules)
  ranks.py      rank 0 <-> other ranks: typed messages, status gathering
  placement.py  expert replicas, placement policies, offload and prefetch
  predictor.py  the expert-demand predictor (SRU) and the predictive policy
"""
