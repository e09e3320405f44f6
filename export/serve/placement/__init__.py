"""Expert placement in the serving runtime: physical replicas, placement policies, offload and prefetch.

    moe-pipeline serve runs/tiny/package --ep-size 2 --placement reactive
    moe-pipeline serve runs/tiny/package --ep-size 2 --placement predictive --replica-budget 0.5
    moe-pipeline serve runs/tiny/package --placement predictive --resident-experts 0.5
    moe-pipeline predictor train runs/tiny/package     # the predictor --placement predictive needs

On the data-parallel serving path every MoE layer's tokens cross ranks in an expert exchange, sent to
the holders of their experts in a replica table; rank 0's controller decides the table (and the
experts to prefetch) before each forward, and every rank applies it. Outputs do not depend on the table.

  algo.py        replica tables, water-filled splits, planning under a budget (pure Python)
  controller.py  rank 0's decisions: the none, reactive and predictive policies, `make_controller`
  predictor.py   the SRU expert-demand predictor: traces, training, the package files
  residency.py   the experts a rank holds: the mapped package, LRU residency, replicas, prefetch
  exchange.py    the token exchange and the MoE layer that runs it: `place_experts` (served: ../served.py)
"""
