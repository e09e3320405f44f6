"""`python -m cli ARGS`: `moe-pipeline ARGS`, the module the DeepSpeed launcher starts on each rank."""

import sys

from cli.main import main

sys.exit(main())
