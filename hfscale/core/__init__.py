"""Foundations every layer uses: commands as data (shell), the one reader of files hfscale did not just write
(untrusted), the typed records read back (records), atomic file sets, process identity, exit codes.

Layer 0: imports nothing from hfscale.
"""
