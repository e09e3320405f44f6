"""Build hook: ship `moe_pipeline_lm_eval.pth` (see eval/lm_eval_plugin.py) to site-packages.

All project metadata is in pyproject.toml; this file only adds one build sub-command,
`build_lm_eval_pth`, that writes the .pth whose `import` line hooks lm-eval at interpreter start:

  * `pip install .` (a wheel): into `build_lib`, i.e. the root of the wheel = site-packages.
  * `pip install -e .` (PEP 660 editable wheel): setuptools runs every build sub-command with
    `editable_mode = True` and points the `install` command's `install_lib` at the directory the
    editable wheel is assembled from (its root = site-packages; it is how setuptools ships data and
    scripts of editable installs); the .pth is written there. `build_lib` is a throwaway directory in
    that mode.

Uninstalling removes the file (it is in the wheel's RECORD either way).
"""

from __future__ import annotations

import os
import runpy

from setuptools import Command, setup
from setuptools.command.build import build

HERE = os.path.dirname(os.path.abspath(__file__))


def _pth():
    """(file name, contents): defined next to the code that the .pth line loads."""
    plugin = runpy.run_path(os.path.join(HERE, "eval", "lm_eval_plugin.py"))
    return plugin["PTH_NAME"], plugin["PTH_LINE"]


class build_lm_eval_pth(Command):
    description = "write moe_pipeline_lm_eval.pth (lm-eval plugin hook) into the wheel root"
    user_options: list = []

    def initialize_options(self):
        self.build_lib = None
        self.editable_mode = False  # set by setuptools' editable_wheel
        self.outputs: list[str] = []

    def finalize_options(self):
        self.set_undefined_options("build", ("build_lib", "build_lib"))

    def run(self):
        name, line = _pth()
        if self.editable_mode:
            target = self.get_finalized_command("install").install_lib
        else:
            target = self.build_lib
        if not target:
            raise RuntimeError(f"{self.get_command_name()}: no directory to write {name} to")
        os.makedirs(target, exist_ok=True)
        path = os.path.join(target, name)
        with open(path, "w", encoding="utf-8") as f:  # .pth files are read in the locale encoding: ASCII only
            f.write(line)
        # editable: the file is not a build output (not in build_lib, nothing to link or map)
        self.outputs = [] if self.editable_mode else [path]

    def get_outputs(self):
        return self.outputs

    def get_output_mapping(self):
        return {}

    def get_source_files(self):
        return []


class build_with_lm_eval_pth(build):
    sub_commands = [*build.sub_commands, ("build_lm_eval_pth", None)]


setup(cmdclass={"build": build_with_lm_eval_pth, "build_lm_eval_pth": build_lm_eval_pth})
