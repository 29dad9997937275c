"""Transformer layers and whole models on one die: plans of kernel launches, timing, functional runs.

Stage: model, on top of the kernel library. ``load_model_config`` reads a model; ``layer_launches``
turns a layer and a step into kernel launches; ``time_layer`` / ``time_model`` time them with the
emulator's timing pass (timing-only, any size); ``TinyModel`` runs a tiny model functionally on
the emulated die and ``reference_forward`` is its pure-JAX reference.
"""

from jalapeno_emu.model.config import MODEL_NAMES as MODEL_NAMES
from jalapeno_emu.model.config import ModelConfig as ModelConfig
from jalapeno_emu.model.config import RopeConfig as RopeConfig
from jalapeno_emu.model.config import from_hf_config as from_hf_config
from jalapeno_emu.model.config import load_model_config as load_model_config
from jalapeno_emu.model.footprint import Footprint as Footprint
from jalapeno_emu.model.footprint import footprint as footprint
from jalapeno_emu.model.footprint import kv_cache_bytes as kv_cache_bytes
from jalapeno_emu.model.footprint import layer_weight_bytes as layer_weight_bytes
from jalapeno_emu.model.footprint import model_weight_bytes as model_weight_bytes
from jalapeno_emu.model.plan import Launch as Launch
from jalapeno_emu.model.plan import Step as Step
from jalapeno_emu.model.plan import head_launches as head_launches
from jalapeno_emu.model.plan import layer_launches as layer_launches
from jalapeno_emu.model.plan import tail_launches as tail_launches
