"""The worker's command line resolved into one configuration: flags, engine-setting layers,
model resolution, KV and sampling defaults, and the report `--dry-run` prints.
"""
