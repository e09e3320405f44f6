"""`moe-pipeline`, the command line: the top floor. It maps command names to the stage functions of pipeline/,
distill/, eval/ and export/ and does nothing else; it may import any of them, and none of them imports it.

main.py: the parser and `main`; train.py: prepare, teacher, distill, plan; export.py: export, verify; eval.py: eval;
serve.py: serve (its flags, one per ServeConfig field) and predictor; common.py: --nproc and the relaunch.
"""
