"""The rack: scale-up collectives over the switched domain, priced with the chip spec's link model,
and a model mapped onto many chips for the serving sweep.

Stage: rack, between the model (one die) and the serving sweep. ``collectives`` prices
all-reduce, all-gather, reduce-scatter and all-to-all per algorithm (alpha-beta); ``emit``
writes one chip's view of a collective into a kernel as ``link.send``/``link.recv`` so the
emulator's timing pass shows it beside compute and HBM traffic. ``mapping`` (tp/ep/dp/pp and
what fits), ``routing`` (expert load), ``slices`` (one chip's launches and collectives),
``step_model`` (:class:`RackStepModel`, the serving step-time model), ``search`` (best mapping)
and ``deployment`` (:func:`predict`, sweeps, :func:`rack_estimate`) model serving on a rack.
Public names are re-exported here.
"""

from jalapeno_emu.rack.collectives import ALGORITHMS as ALGORITHMS
from jalapeno_emu.rack.collectives import CollectiveTime as CollectiveTime
from jalapeno_emu.rack.collectives import Schedule as Schedule
from jalapeno_emu.rack.collectives import all_gather as all_gather
from jalapeno_emu.rack.collectives import all_reduce as all_reduce
from jalapeno_emu.rack.collectives import all_to_all as all_to_all
from jalapeno_emu.rack.collectives import best_all_gather as best_all_gather
from jalapeno_emu.rack.collectives import best_all_reduce as best_all_reduce
from jalapeno_emu.rack.collectives import best_all_to_all as best_all_to_all
from jalapeno_emu.rack.collectives import best_reduce_scatter as best_reduce_scatter
from jalapeno_emu.rack.collectives import byte_matrix as byte_matrix
from jalapeno_emu.rack.collectives import collective as collective
from jalapeno_emu.rack.collectives import reduce_scatter as reduce_scatter
from jalapeno_emu.rack.collectives import schedule as schedule
from jalapeno_emu.rack.deployment import Prediction as Prediction
from jalapeno_emu.rack.deployment import predict as predict
from jalapeno_emu.rack.deployment import rack_estimate as rack_estimate
from jalapeno_emu.rack.emit import EmittedCollective as EmittedCollective
from jalapeno_emu.rack.emit import LinkStep as LinkStep
from jalapeno_emu.rack.emit import emit_collective as emit_collective
from jalapeno_emu.rack.mapping import FitError as FitError
from jalapeno_emu.rack.mapping import Mapping as Mapping
from jalapeno_emu.rack.mapping import fits as fits
from jalapeno_emu.rack.mapping import parse_mapping as parse_mapping
from jalapeno_emu.rack.routing import Routing as Routing
from jalapeno_emu.rack.routing import parse_routing as parse_routing
from jalapeno_emu.rack.search import best_mapping as best_mapping
from jalapeno_emu.rack.step_model import RackStepModel as RackStepModel

__all__ = [
    "ALGORITHMS",
    "CollectiveTime",
    "EmittedCollective",
    "FitError",
    "LinkStep",
    "Mapping",
    "Prediction",
    "RackStepModel",
    "Routing",
    "Schedule",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "best_all_gather",
    "best_all_reduce",
    "best_all_to_all",
    "best_mapping",
    "best_reduce_scatter",
    "byte_matrix",
    "collective",
    "emit_collective",
    "fits",
    "parse_mapping",
    "parse_routing",
    "predict",
    "rack_estimate",
    "reduce_scatter",
    "schedule",
]
