"""A flow-level simulator of KV handoffs on a cluster fabric (issue 30): max-min fair sharing on SimPy.

Modules: :mod:`~kvlab.fabric.topology` (links and routes), :mod:`~kvlab.fabric.sharing` (max-min rates,
start costs), :mod:`~kvlab.fabric.flows` (flows on a SimPy clock), :mod:`~kvlab.fabric.workload` (the
config and the drawn requests), :mod:`~kvlab.fabric.sim` (the serving simulation),
:mod:`~kvlab.fabric.sweep` (many simulations on Dask), :mod:`~kvlab.fabric.calibrate` (fitting and
validating against measured contention) and :mod:`~kvlab.fabric.command` (``kvlab simulate``).

Import the submodules you need; this package imports nothing heavy on its own.
"""
