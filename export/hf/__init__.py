"""Hugging Face remote-code files of an exported package (copied into it by export/package.py).

`configuration_moe_pipeline.py` and `modeling_moe_pipeline.py` import the model with a relative
import (`from .moe_model import ...`): they run inside a package directory, next to the copy of
pipeline/model.py, not from here. Only `configuration_moe_pipeline.hf_config_dict` and `auto_map`
are meant to be imported from the repository (by the export step).
"""
