"""Thin adapters that take a trainer's own tensors to Steptally's exact diagnostics.

One module per trainer (``steptally.integrations.trl``), each importing its trainer
package, an optional extra (``pip install steptally[trl]``); nothing here imports the
service. The trainer's loss and gradients are never changed.
"""
