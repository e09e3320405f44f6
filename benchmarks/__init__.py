"""The benchmark scripts (README.md): each is run as a script; common.py is what they share. A package only so that
research/common.py can import `benchmarks.common`."""
