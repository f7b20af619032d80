"""Stage 4, rows and states -> the data folder, and from it to the trainer.

In: the config, the target and a `CaptureSpec`. Out: a built folder (`build.build_folder`: the
rows spilled to disk, answered by the target where regeneration is on, the shards captured, the
draft vocabulary `vocab` and the manifest), read back as a `folder.DataFolder`; its name, and the
answer cache's, by what their contents depend on (`keys`); its format and the Dataset the trainer
reads (`store`); and for an online folder the states each batch needs, from servers
(`online_engine`, asking ahead with `prefetch`).

The last stage: imports every earlier one; `data_prep.prepare` runs it."""
