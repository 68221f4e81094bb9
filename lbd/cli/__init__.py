"""The ``lbd`` command line: one module per verb group, wired together in :mod:`lbd.cli.main`."""
