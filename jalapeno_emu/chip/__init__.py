"""The chip spec: frozen hardware descriptions with provenance, shipped presets and overrides.

Stage: chip spec, between the ISA and the emulator. ``load_preset("jalapeno-v1")`` reads a TOML
preset into a validated :class:`ChipSpec`; engines, the memory map, the timing pass and the rack
model read hardware parameters from it. Public names are re-exported here, one per line.
"""

from jalapeno_emu.chip._units import format_quantity as format_quantity
from jalapeno_emu.chip._units import parse_quantity as parse_quantity
from jalapeno_emu.chip.load import apply_overrides as apply_overrides
from jalapeno_emu.chip.load import list_presets as list_presets
from jalapeno_emu.chip.load import load_preset as load_preset
from jalapeno_emu.chip.load import parse_field_value as parse_field_value
from jalapeno_emu.chip.spec import BLOCKS as BLOCKS
from jalapeno_emu.chip.spec import DERIVED_QUANTITIES as DERIVED_QUANTITIES
from jalapeno_emu.chip.spec import FIELDS as FIELDS
from jalapeno_emu.chip.spec import MX_BLOCK as MX_BLOCK
from jalapeno_emu.chip.spec import OVERRIDE as OVERRIDE
from jalapeno_emu.chip.spec import PROVENANCE_KINDS as PROVENANCE_KINDS
from jalapeno_emu.chip.spec import ChipSpec as ChipSpec
from jalapeno_emu.chip.spec import CoreSpec as CoreSpec
from jalapeno_emu.chip.spec import DerivedQuantity as DerivedQuantity
from jalapeno_emu.chip.spec import DmaSpec as DmaSpec
from jalapeno_emu.chip.spec import FieldInfo as FieldInfo
from jalapeno_emu.chip.spec import HbmSpec as HbmSpec
from jalapeno_emu.chip.spec import Limit as Limit
from jalapeno_emu.chip.spec import LinkSpec as LinkSpec
from jalapeno_emu.chip.spec import MatrixUnitSpec as MatrixUnitSpec
from jalapeno_emu.chip.spec import PowerSpec as PowerSpec
from jalapeno_emu.chip.spec import Provenance as Provenance
from jalapeno_emu.chip.spec import SoftwareSpec as SoftwareSpec
from jalapeno_emu.chip.spec import SramSpec as SramSpec
from jalapeno_emu.chip.spec import SyncSpec as SyncSpec
from jalapeno_emu.chip.spec import VectorUnitSpec as VectorUnitSpec

__all__ = [
    "BLOCKS",
    "DERIVED_QUANTITIES",
    "FIELDS",
    "MX_BLOCK",
    "OVERRIDE",
    "PROVENANCE_KINDS",
    "ChipSpec",
    "CoreSpec",
    "DerivedQuantity",
    "DmaSpec",
    "FieldInfo",
    "HbmSpec",
    "Limit",
    "LinkSpec",
    "MatrixUnitSpec",
    "PowerSpec",
    "Provenance",
    "SoftwareSpec",
    "SramSpec",
    "SyncSpec",
    "VectorUnitSpec",
    "apply_overrides",
    "format_quantity",
    "list_presets",
    "load_preset",
    "parse_field_value",
    "parse_quantity",
]
