"""Exports of trained heads for the serving engines (`python -m heads.export`): `write` writes and
reads back the folders, `eagle3` and `medusa` hold each kind's formats, `check` the strict
read-back, `card` the model card and `hub` the upload.

This package's `__init__` imports nothing: the kinds' records (`heads.kinds`) hold the formats'
layouts from `heads.export.eagle3` and `heads.export.medusa`, and `write` reads the records, so
an import here would close a loop.
"""
