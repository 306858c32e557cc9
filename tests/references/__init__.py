"""Independent float64 numpy oracles (forward, final state, hand-written backward).

Plain time loops in the style of FLA's ``naive.py`` and mamba's ``selective_scan_ref``.
Nothing here imports ``recgen``: these modules are the independent reference that the
generated kernels and the recgen IR are checked against.  Every forward accepts complex
arrays (all ops are analytic), which is how ``test_references.py`` validates each
hand-written backward by complex-step differentiation.
"""
