"""The simulator's reference engine, in pure Python: the oracle of the Rust engine.

:class:`ReferenceSimulation` runs a scenario with Python objects (:class:`Replica`, the
:class:`~llmsched.Router` behind :class:`RouterPolicy`, :class:`FlowGate`, a
:class:`~llmsched.slices.SliceTracker`) and returns the same :class:`~llmsched.sim.SimResult`
through the same collector as the Rust engine. The equivalence tests hold the two engines to
the same requests, timings and counters, bit for bit. Use :class:`llmsched.sim.Simulation`
for experiments: it runs the Rust engine.

Components take narrow interfaces (a :class:`ReplicaHost`, a clock, the replicas' roles), not
the simulation object, so nothing here imports the engine module but the package itself.
"""

from __future__ import annotations

from llmsched.reference.sim.engine import ReferenceSimulation, ideal_time
from llmsched.reference.sim.gate import FlowGate
from llmsched.reference.sim.replica import Replica, ReplicaHost
from llmsched.reference.sim.router import RouterPolicy, make_policy

__all__ = [
    "FlowGate",
    "ReferenceSimulation",
    "Replica",
    "ReplicaHost",
    "RouterPolicy",
    "ideal_time",
    "make_policy",
]
