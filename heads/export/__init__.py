"""Exports of trained heads for the serving engines (`python -m heads.export`), the parts every
kind shares: `core` the layouts and folders, `check` the strict read-back, `card` the model card,
`write` the writing and reading back, `hub` the upload. Each kind's formats are its own
(`heads/<kind>/export.py`).

This package's `__init__` imports nothing: the kinds' records (`heads.kinds`) hold their formats'
layouts, built on `core`, `check` and `card`, and `write` reads the records.
"""
