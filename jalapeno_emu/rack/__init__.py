"""The rack: scale-up collectives over the switched domain, priced with the chip spec's link model.

Stage: rack, between the model (one die) and the serving sweep. ``collectives`` prices
all-reduce, all-gather, reduce-scatter and all-to-all per algorithm (alpha-beta); ``emit``
writes one chip's view of a collective into a kernel as ``link.send``/``link.recv`` so the
emulator's timing pass shows it beside compute and HBM traffic. Public names are re-exported here.
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
from jalapeno_emu.rack.emit import EmittedCollective as EmittedCollective
from jalapeno_emu.rack.emit import LinkStep as LinkStep
from jalapeno_emu.rack.emit import emit_collective as emit_collective

__all__ = [
    "ALGORITHMS",
    "CollectiveTime",
    "EmittedCollective",
    "LinkStep",
    "Schedule",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "best_all_gather",
    "best_all_reduce",
    "best_all_to_all",
    "best_reduce_scatter",
    "byte_matrix",
    "collective",
    "emit_collective",
    "reduce_scatter",
    "schedule",
]
