"""Test helpers and reference implementations (never shipped in the package).

`tests/conftest.py` puts `tests/` on sys.path, so tests import them as `support.<module>`;
bench scripts and subprocess checks do the same with `sys.path.insert`.
"""
