"""The CPU kernels' options in force: what `serve`'s flags decide for them (export/serve/config.py's kernel fields),
one record a process, set before a model is built and read where each choice is made.

    from export.serve.kernels import options
    options.configure(options.KernelOptions(head_screen=False))   # Engine.from_config: KernelOptions.of(config)
    options.current().head_screen                                 # False
    with options.using(map_weights=False): ...                    # a test's or a benchmark's variant, then back

Like torch.backends' flags, they are process-wide: a server runs one configuration. The prefetch hint is compiled
into the extension (export/serve/kernels/extension.py), so it is fixed once this process has built the kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class KernelOptions:
    # who runs the linears: our few-row kernel with oneDNN for more rows, oneDNN at every row count, or every layer
    # left as it is (PyTorch's F.linear)
    linears: Literal["kernel", "onednn", "aten"] = "kernel"
    head_screen: bool = True  # greedy and top-k rows' logits through the output layer's int8 screen
    map_weights: bool = True  # the large weights moved into a file mapping (2 MB pages)
    local_reduce: bool = True  # the data-parallel ranks' sums through the kernel's shared-memory reduce
    prefetch: Literal["auto", "t0", "nta"] = "auto"  # the weight prefetch hint compiled in; auto: by CPU vendor
    attention_kernel_rows: int = 128  # a packed forward's rows of up to this many new tokens attend in the kernel

    @classmethod
    def of(cls, config) -> "KernelOptions":
        """The options of a ServeConfig (its fields of the same meaning)."""
        return cls(linears=config.cpu_linears, head_screen=config.head_screen, map_weights=config.map_weights,
                   local_reduce=config.local_reduce, prefetch=config.prefetch,
                   attention_kernel_rows=config.attention_kernel_rows)


_current = KernelOptions()


def current() -> KernelOptions:
    return _current


def configure(opts: KernelOptions) -> None:
    """Set the options in force, before a model is built (the prefetch hint takes effect where the kernel is not
    built yet: extension.py `built_hint` says which one it has)."""
    global _current
    _current = opts


@contextlib.contextmanager
def using(**changes):
    """The options with `changes` in force inside the block (tests, benchmarks' variants), then as they were."""
    global _current
    before = _current
    _current = dataclasses.replace(_current, **changes)
    try:
        yield _current
    finally:
        _current = before
