"""``python -m pipeline.data``: the corpus summary of ``pipeline.data.summary``."""

from pipeline.data.summary import main

if __name__ == "__main__":
    raise SystemExit(main())
