"""Export and serve: the package format (`package.py`, Hugging Face remote code in `hf/`), loading a
package for a multi-rank layout (`inference.py`), and the HTTP server (`serve/`).

    moe-pipeline export runs/tiny          # -> runs/tiny/package
    moe-pipeline verify runs/tiny/package
    moe-pipeline serve runs/tiny/package --ep-size 2
"""
