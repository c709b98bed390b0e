"""A test's change to a library, put in from outside as a user's site hook would be: the text of a
``sitecustomize.py`` for the ranks' PYTHONPATH that patches a module when it is imported, in whichever
process imports it first: a rank started as a new interpreter, or the launcher that forks the ranks warm
(runner.warm_start: their interpreter started as the launcher's, without RANK), whose ranks inherit it."""

from __future__ import annotations

import textwrap

AFTER_IMPORT = '''\
import importlib.abc
import importlib.util
import os
import sys


def _after_import(name, patch):
    """Run patch(module) once ``name`` is imported, after its own code."""
    class _AfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _AfterImport())


'''


def site_hook(body: str) -> str:
    """``sitecustomize.py`` text: ``body`` (which calls ``_after_import(name, patch)``) after the hook's helper."""
    return AFTER_IMPORT + textwrap.dedent(body)
