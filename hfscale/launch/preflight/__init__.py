"""Preflight: ``probes`` (what to ask every host before a launch and what the answers mean, pure
but for ``local_need``) and ``network`` (``hfscale preflight --network``: which hosts measure each
other when, and what the numbers say; hfscale.launch.netcheck measures on each host).

May import the layers below hfscale.launch, the top modules of hfscale.launch and node/ (probes reach
a host as the launch does); no runner, nothing of attempt/ or recovery/ (tests/test_architecture.py
holds this). attempt.execute runs the probes, recovery.supervisor asks them between attempts.
"""
